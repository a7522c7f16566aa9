"""The exact two-stage top-k candidates bench.kernels.top_k times against `lax.top_k`: the
same values and indices, ties included (a DFlash 2 selector may only switch to one that is)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.kernels.top_k import chunk_max_top_k, sliced_top_k


@pytest.mark.parametrize("vocab,k,chunks", [(4096, 16, 256), (1000, 8, 64), (37, 3, 8), (64, 16, 16)])
@pytest.mark.parametrize("values", ["normal", "ties", "masked"])
def test_two_stage_top_k_equals_lax(vocab, k, chunks, values):
    x = np.random.default_rng(vocab + k).standard_normal((3, 2, vocab)).astype(np.float32)
    if values == "ties":
        x = np.round(x)
    if values == "masked":
        x[..., 1::3] = -np.inf
    expected = jax.lax.top_k(jnp.asarray(x), k)
    variants = [chunk_max_top_k] + [sliced_top_k] * (-(-vocab // chunks) >= k)
    for variant in variants:
        got = variant(jnp.asarray(x), k, chunks)
        np.testing.assert_array_equal(got[0], expected[0])
        np.testing.assert_array_equal(got[1], expected[1])
