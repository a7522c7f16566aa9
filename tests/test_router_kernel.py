"""The MoE router's choice as one Pallas kernel (pallas_kernels/router.py; interpret mode on
CPU, compiled on a GPU) against its jnp reference: the same experts in the same order, the
same weights to rounding, for Qwen3-MoE's softmax-then-top-k (with and without
renormalisation) and gpt-oss's top-k-then-softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.router import route_pallas, route_reference

FAMILIES = {"qwen3-moe": dict(softmax_after_top_k=False, norm_topk_prob=True),
            "unnormalised": dict(softmax_after_top_k=False, norm_topk_prob=False),
            "gpt-oss": dict(softmax_after_top_k=True, norm_topk_prob=False)}


def check(logits, top_k, family, interpret=True):
    want_w, want_ids = route_reference(logits, top_k, **FAMILIES[family])
    got_w, got_ids = route_pallas(logits, top_k, **FAMILIES[family], interpret=interpret)
    assert got_w.dtype == jnp.float32 and got_ids.dtype == jnp.int32 and got_w.shape == (logits.shape[0], top_k)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("num_experts, top_k", [(8, 2), (32, 4), (12, 3)])  # 12: padded to 16 lanes
def test_kernel_routes_as_the_reference(family, num_experts, top_k):
    logits = jnp.asarray(np.random.default_rng(num_experts).normal(size=(5, num_experts)) * 3, jnp.bfloat16)
    check(logits, top_k, family)


def test_ties_go_to_the_lower_expert_as_lax_top_k():
    logits = jnp.asarray([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 2.0, 2.0]], jnp.float32)
    for family in FAMILIES:
        check(logits, 5, family)
    assert route_pallas(logits, 5, **FAMILIES["gpt-oss"], interpret=True)[1].tolist() == [[1, 2, 4, 6, 7]]


def test_bad_top_k_is_refused():
    with pytest.raises(ValueError, match="top_k must be in \\[1, 4\\] experts, got 5"):
        route_pallas(jnp.zeros((2, 4)), 5, **FAMILIES["gpt-oss"], interpret=True)


def test_kernel_lowers_to_triton_for_a_gpu_from_any_host():
    """Qwen3-30B-A3B's router (128 experts, top 8) over a 16-token verify block."""
    from conftest import triton_calls_for_cuda

    kernel = lambda x: route_pallas(x, 8, **FAMILIES["qwen3-moe"], interpret=False)  # noqa: E731
    assert triton_calls_for_cuda(kernel, jax.ShapeDtypeStruct((16, 128), jnp.bfloat16)) == 1


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_compiled_kernel_routes_as_the_reference(family):
    for num_experts, top_k, tokens in ((128, 8, 1), (128, 8, 300), (32, 4, 16)):
        logits = jnp.asarray(np.random.default_rng(tokens).normal(size=(tokens, num_experts)) * 3, jnp.bfloat16)
        check(logits, top_k, family, interpret=None)
