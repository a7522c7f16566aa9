"""The top k of a wide last axis (a vocabulary), exactly as `lax.top_k` ranks it, in two
cheap stages: XLA's GPU top-k gives each row one thread block and is slow on a few rows of
150k logits, while a max over slices and a top-k of k slices' elements stay small.

The k slices with the largest maxima hold every top-k element: a slice outside them has its
maximum, so each of its elements, at or below the k-th largest maximum, which k elements
already reach. Taking those slices in index order keeps `lax.top_k`'s ties (lower index
first)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

SLICES = 1024  # chosen by measurement: bench.kernels.top_k, bench/results/*-top-k-*


def chunk_max_top_k(x_NV, k: int, chunks: int):
    """(values, indices) of the top k along x's last axis, through `chunks` (>= k) slices."""
    V = x_NV.shape[-1]
    width = -(-V // chunks)
    pad = [(0, 0)] * (x_NV.ndim - 1) + [(0, chunks * width - V)]
    slices = jnp.pad(x_NV, pad, constant_values=-jnp.inf).reshape(*x_NV.shape[:-1], chunks, width)
    _, best = jax.lax.top_k(slices.max(axis=-1), k)
    best = jnp.sort(best, axis=-1)
    kept = jnp.take_along_axis(slices, best[..., None], axis=-2)
    index = (best[..., None] * width + jnp.arange(width, dtype=best.dtype)).reshape(*x_NV.shape[:-1], k * width)
    top, picked = jax.lax.top_k(kept.reshape(*x_NV.shape[:-1], k * width), k)
    return top, jnp.take_along_axis(index, picked, axis=-1)


def top_k(x_NV, k: int):
    """`lax.top_k(x, k)`, through `chunk_max_top_k` where the last axis spans many slices."""
    if x_NV.shape[-1] < SLICES * k or k > SLICES:
        return jax.lax.top_k(x_NV, k)
    return chunk_max_top_k(x_NV, k, SLICES)
