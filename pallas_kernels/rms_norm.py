"""Residual add + RMSNorm as one Pallas kernel (Triton lowering on a GPU, interpret mode on
CPU), beside its jnp reference.

A pre-norm decoder layer computes ``x = x + delta; h = rmsnorm(x) * w`` twice. XLA on a GPU
makes three kernels of each: the add, the sum of squares, the scaling, every one reading
the row again; at batch 1 each is a launch-bound kernel. Here one program per row loads ``x``
and ``delta`` once and writes the sum and the normed row: faster at batch 1, no faster than
XLA's kernels at 16 verify rows (bench/results).

Numerics follow the reference step by step: the sum in the inputs' dtype, the mean square
and scaling in float32, cast back, then times the weight. Only the order of the float32
sum of squares may differ, so outputs agree to a rounding step of the output dtype.

Indexing: rows are flat ``[T * D]`` vectors; a program's columns run to the next power of
two of ``D`` (Triton block shapes), the lanes past ``D`` masked, their stores pointed one
row past the end (the GPU touches nothing there; interpret mode's scatter drops them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2, quiet_triton_deprecation


def add_rms_norm_reference(x_TD, delta_TD, weight_D, eps: float):
    """(x + delta, rmsnorm(x + delta) * weight); with `delta_TD` None, (x, rmsnorm(x) * weight).
    HF's RMSNorm: normalised in float32, cast back to x's dtype, then scaled."""
    if delta_TD is not None:
        x_TD = x_TD + delta_TD
    x32 = x_TD.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x_TD, weight_D * normed.astype(x_TD.dtype)


def _kernel(*refs, dim: int, block_d: int, size: int, eps: float, has_delta: bool):
    if has_delta:
        x_ref, delta_ref, w_ref, sum_ref, out_ref = refs
    else:
        x_ref, w_ref, out_ref = refs
    cols = jnp.arange(block_d)
    ok = cols < dim
    at = pl.program_id(0) * dim + cols
    x = plgpu.load(x_ref.at[at], mask=ok, other=0)
    if has_delta:
        x = x + plgpu.load(delta_ref.at[at], mask=ok, other=0)
    x32 = x.astype(jnp.float32)
    normed = (x32 * lax.rsqrt(jnp.sum(x32 * x32) / dim + eps)).astype(x.dtype)
    out = plgpu.load(w_ref.at[cols], mask=ok, other=0) * normed
    dest = jnp.where(ok, at, size)
    if has_delta:
        plgpu.store(sum_ref.at[dest], x, mask=ok)
    plgpu.store(out_ref.at[dest], out.astype(out_ref.dtype), mask=ok)


def _pallas(x_TD, delta_TD, weight_D, eps: float, interpret: bool):
    T, D = x_TD.shape
    has_delta = delta_TD is not None
    block_d = next_pow2(D)
    out_dtype = jnp.result_type(weight_D.dtype, x_TD.dtype)
    out_shape = [jax.ShapeDtypeStruct((T * D,), out_dtype)]
    if has_delta:
        out_shape.insert(0, jax.ShapeDtypeStruct((T * D,), x_TD.dtype))
    if not interpret:
        quiet_triton_deprecation()
    inputs = (x_TD, delta_TD, weight_D) if has_delta else (x_TD, weight_D)
    outs = pl.pallas_call(
        functools.partial(_kernel, dim=D, block_d=block_d, size=T * D, eps=eps, has_delta=has_delta),
        out_shape=out_shape,
        grid=(T,),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4 if block_d <= 2048 else 8, num_stages=1),
        name="add_rms_norm",
    )(*(a.reshape(-1) for a in inputs))
    normed = outs[-1].reshape(T, D)
    return (outs[0].reshape(T, D) if has_delta else x_TD), normed


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _differentiable(x_TD, delta_TD, weight_D, eps, interpret):
    return _pallas(x_TD, delta_TD, weight_D, eps, interpret)


def _forward(x_TD, delta_TD, weight_D, eps, interpret):
    return _pallas(x_TD, delta_TD, weight_D, eps, interpret), (x_TD, delta_TD, weight_D)


def _backward(eps, interpret, saved, grads):
    """The reference's gradients (training runs the kernel forward on a GPU too)."""
    x_TD, delta_TD, weight_D = saved
    _, vjp = jax.vjp(lambda x, d, w: add_rms_norm_reference(x, d, w, eps), x_TD, delta_TD, weight_D)
    return vjp(grads)


_differentiable.defvjp(_forward, _backward)


def add_rms_norm_pallas(x_TD, delta_TD, weight_D, eps: float, *, interpret: bool | None = None):
    """`add_rms_norm_reference` (same arguments and results) as one kernel; differentiable.
    `x_TD` [T, D], `delta_TD` [T, D] or None, `weight_D` [D]. interpret: None runs compiled on
    a GPU backend and in interpret mode elsewhere."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if delta_TD is not None and (delta_TD.shape != x_TD.shape or delta_TD.dtype != x_TD.dtype):
        raise ValueError(f"delta must match x; got {delta_TD.shape} {delta_TD.dtype} vs {x_TD.shape} {x_TD.dtype}: "
                         "pass a delta of x's shape and dtype (cast it first), or None for a plain norm.")
    return _differentiable(x_TD, delta_TD, weight_D, eps, interpret)
