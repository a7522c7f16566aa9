"""The gated delta rule in chunks (pallas_kernels/chunked_delta_rule.py; its walk over chunks
compiled on a GPU, interpret mode on CPU): the chunked form computes what the token-by-token
walk computes, to float rounding, for ragged rows of any length (shorter than a chunk, a
chunk exactly, several with a partial last one, empty) and tokens in no row; the kernel
computes its reference; it equals transformers' chunked form; strong decays stay finite
(shapes it cannot tile: test_delta_rule_kernel.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.chunked_delta_rule import chunked_delta_rule_pallas, chunked_delta_rule_reference, chunks_for
from pallas_kernels.delta_rule import delta_rule_pallas, delta_rule_reference
from test_delta_rule_kernel import assert_equals_transformers, random_inputs

# rows as (start, end) for chunks of 8: short, one chunk exactly, empty, three chunks with a
# partial last, then a padding tail no row holds
ROWS = ((0, 5), (5, 13), (13, 13), (13, 33))


def row_bounds(rows):
    return tuple(jnp.asarray(x, jnp.int32) for x in zip(*rows))


@pytest.mark.parametrize("decay", ["fast", "slow"])
@pytest.mark.parametrize("rule", ["reference", "pallas-16", "pallas-64"])
def test_chunks_compute_the_token_walk(rule, decay):
    """The kernel with 16 value columns a program (4 programs a head) and 64 (one); decays
    of ~0.8 a token, and of ~0.01 (the state carried into a chunk then shows throughout it)."""
    chunked = chunked_delta_rule_reference if rule == "reference" else (
        lambda *a, **kw: chunked_delta_rule_pallas(*a, **kw, block_v=int(rule[7:]), interpret=True))
    inputs = random_inputs(np.random.default_rng(0), T=40, R=len(ROWS))
    if decay == "slow":
        inputs[3] = inputs[3] * 0.01
    starts, ends = row_bounds(ROWS)
    want_out, want_state = delta_rule_reference(*inputs, starts, ends)
    out, state = chunked(*inputs, starts, ends, chunk=8)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state, want_state, rtol=1e-5, atol=1e-5)
    assert not np.asarray(out)[33:].any()  # tokens in no row: zero outputs
    np.testing.assert_array_equal(np.asarray(state)[2], np.asarray(inputs[5])[2])  # the empty row
    _, states_only = chunked(*inputs, starts, ends, chunk=8, outputs=False)
    np.testing.assert_array_equal(states_only, state)
    commits = jnp.array([True, False, True, False])  # rows 1 and 3: states back as they came in
    kept_out, some = chunked(*inputs, starts, ends, chunk=8, commits_R=commits, num_chunks=5)  # the rows' chunks
    np.testing.assert_array_equal(kept_out, out)
    np.testing.assert_array_equal(np.asarray(some)[[1, 3]], np.asarray(inputs[5])[[1, 3]])
    np.testing.assert_array_equal(np.asarray(some)[[0, 2]], np.asarray(state)[[0, 2]])


def test_chunks_for_holds_any_rows():
    """The chunks laid out hold every row's: rows of any length, and (the runtime's tighter
    bound) rows of a chunk or more, whose count it exceeds at some lengths."""
    rng = np.random.default_rng(4)
    for _ in range(500):
        chunk = int(rng.choice([8, 64]))
        short, long = rng.integers(0, 3 * chunk, size=rng.integers(1, 9)), rng.integers(chunk, 3 * chunk, size=3)
        for lengths, least in ((short, 1), (long[: rng.integers(1, 4)], chunk)):
            needed = sum(-(-int(n) // chunk) for n in lengths)
            assert needed <= chunks_for(int(lengths.sum()), len(lengths), chunk, min_row_tokens=least)
    assert chunks_for(640, 32, 64, min_row_tokens=64) == 20 < chunks_for(640, 32, 64) == 42


def test_strong_decays_stay_finite():
    """exp of a chunk's summed decays underflows to zero: no inf or NaN, the state forgets."""
    q, k, v, g, beta, state = random_inputs(np.random.default_rng(2), T=16, R=1)
    g = jnp.full_like(g, -60.0)
    bounds = jnp.array([0]), jnp.array([16])
    want = delta_rule_reference(q, k, v, g, beta, state, *bounds)
    got = chunked_delta_rule_reference(q, k, v, g, beta, state, *bounds, chunk=8)
    for a, b in zip(got, want):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_equals_transformers_chunked_form():
    pytest.importorskip("torch")
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    assert_equals_transformers(chunked_delta_rule_reference, torch_chunk_gated_delta_rule, 100)


@pytest.mark.parametrize("kernel", [delta_rule_pallas, chunked_delta_rule_pallas], ids=["walk", "chunked"])
@pytest.mark.parametrize("block_v", [32, 64])
def test_kernels_lower_to_triton_for_a_gpu_from_any_host(kernel, block_v):
    """At Qwen3.5-9B's heads each kernel lowers for CUDA to one Triton call (conftest's
    `triton_calls_for_cuda`)."""
    from conftest import triton_calls_for_cuda

    T, R, Hk, Hv, K, V = 1024, 4, 16, 32, 128, 128
    shapes = [(T, Hk, K), (T, Hk, K), (T, Hv, V), (T, Hv), (T, Hv), (R, Hv, K, V)]
    arrays = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes] + [jax.ShapeDtypeStruct((R,), jnp.int32)] * 2
    assert triton_calls_for_cuda(lambda *a: kernel(*a, block_v=block_v, interpret=False), *arrays) == 1


def test_heads_too_small_for_triton_products_take_the_reference_walk():
    """A tiny model's value heads of 8 (blocks under Triton's 16-wide products): compiled for
    CUDA, the chunked form runs its reference walk, no kernel."""
    from conftest import triton_calls_for_cuda

    inputs = random_inputs(np.random.default_rng(0), T=80, R=1, dv=8)
    kernel = lambda *a: chunked_delta_rule_pallas(*a, interpret=False)  # noqa: E731
    assert triton_calls_for_cuda(kernel, *inputs, jnp.array([0]), jnp.array([80])) == 0


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("block_v", [32, 64])
def test_gpu_compiled_kernel_matches_the_token_walk(block_v):
    """Qwen3.5-9B's linear-attention heads: 16 key heads, 32 value heads of 128; rows of 1,
    299 and 700 tokens and an empty one, in chunks of 64."""
    rows = ((0, 1), (1, 300), (300, 300), (300, 1000))
    starts, ends = row_bounds(rows)
    inputs = random_inputs(np.random.default_rng(0), T=1024, R=len(rows), Hk=16, Hv=32, dk=128, dv=128)
    with jax.default_matmul_precision("highest"):
        want_out, want_state = delta_rule_reference(*inputs, starts, ends)
    got_out, got_state = chunked_delta_rule_pallas(*inputs, starts, ends, block_v=block_v, interpret=False)
    np.testing.assert_allclose(got_out, want_out, rtol=5e-4, atol=5e-4)
    np.testing.assert_allclose(got_state, want_state, rtol=5e-4, atol=5e-4)
    commits = jnp.array([True, False, True, False])
    _, some = chunked_delta_rule_pallas(*inputs, starts, ends, commits_R=commits, block_v=block_v, interpret=False)
    np.testing.assert_array_equal(np.asarray(some)[[1, 3]], np.asarray(inputs[5])[[1, 3]])


def test_kernels_choose_the_prefill_rule():
    """Long prefill rows go in chunks on a CPU and token by token on a GPU (where the chunked
    walk measured no faster); `prefill_rule` overrides either way, from the command line's form too."""
    from dflash_jax.kernels import Kernels

    on_gpu = jax.default_backend() == "gpu"
    assert Kernels().resolve().prefill_rule == ("tokens" if on_gpu else "chunks")
    assert Kernels.parse("recurrence=pallas,prefill_rule=chunks").resolve().chunked_delta_rule is chunked_delta_rule_pallas
    assert Kernels.parse("recurrence=reference").resolve().chunked_delta_rule in (
        None if on_gpu else chunked_delta_rule_reference,)
    assert Kernels(prefill_rule="tokens").resolve().chunked_delta_rule is None
    with pytest.raises(ValueError, match="prefill_rule kernel must be one of auto, chunks, tokens"):
        Kernels(prefill_rule="chunked")
