"""The exact two-stage top-k forms (the DFlash 2 selector's chunk-max, the bench's sliced one)
against `lax.top_k`: the same values and indices, ties included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.kernels.top_k import sliced_top_k
from dflash_jax.top_k import chunk_max_top_k, top_k


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


def test_top_k_takes_the_chunk_max_form_on_wide_axes():
    x = jnp.asarray(np.round(np.random.default_rng(0).standard_normal((2, 16 * 1024 + 5)) * 3), jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda x: top_k(x, 16))(x))
    assert "reduce_max" in jaxpr  # the chunk-max form
    for got, expected in zip(top_k(x, 16), jax.lax.top_k(x, 16)):
        np.testing.assert_array_equal(got, expected)
    assert "reduce_max" not in str(jax.make_jaxpr(lambda x: top_k(x, 16))(x[:, :4096]))
