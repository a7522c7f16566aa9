"""The gated delta rule's inputs in one kernel (pallas_kernels/rule_inputs.py; interpret mode
on CPU, compiled on a GPU): the convolution over ragged rows continuing their histories,
SiLU and norms, as the runtime's jnp path computes them for the rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_conv_delta_rule_kernel import CFG, ROWS, nine_b_layer, random_layer

from dflash_jax.kernels import Kernels
from dflash_jax.recurrent_state import prepared_inputs
from pallas_kernels.common import TRITON_DEPRECATION
from pallas_kernels.delta_rule import token_rows
from pallas_kernels.rule_inputs import rule_inputs_pallas


def prepared(impl, inputs, history, starts, ends):
    """`prepared_inputs` with `impl` over rows [starts, ends), and which tokens are in a row."""
    rows_T, in_row_T = token_rows(starts, ends, inputs.mixed_TC.shape[0])
    kernels = Kernels(rule_inputs=impl).resolve()
    return prepared_inputs(inputs, history, rows_T, jnp.arange(len(rows_T)) - starts[rows_T], kernels), in_row_T


@pytest.mark.parametrize("rows", ROWS, ids=["mixed", "one-token", "verify-like"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernel_computes_the_jnp_inputs(rows, dtype):
    rng = np.random.default_rng(len(rows))
    starts, ends = (jnp.asarray(x, jnp.int32) for x in zip(*rows))
    inputs, history, _ = random_layer(rng, T=24, R=len(rows), dtype=jnp.dtype(dtype))
    want, in_row = prepared("reference", inputs, history, starts, ends)
    got, _ = prepared("pallas", inputs, history, starts, ends)
    for g, w in zip(got, want):  # the tokens in no row are never read
        assert g.shape == w.shape and g.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(g)[np.asarray(in_row)], np.asarray(w)[np.asarray(in_row)],
                                   rtol=1e-6, atol=1e-6)


def test_token_counts_without_a_power_of_two_block_are_covered():
    """T = 17 (programs of one token) and T = 48 (of 16): every token computed."""
    for T in (17, 48):
        inputs, history, _ = random_layer(np.random.default_rng(T), T=T, R=2)
        starts, ends = jnp.array([0, 5]), jnp.array([5, T])
        want, _ = prepared("reference", inputs, history, starts, ends)
        got, _ = prepared("pallas", inputs, history, starts, ends)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_channels_that_do_not_fit_are_refused():
    inputs, history, _ = random_layer(np.random.default_rng(0), T=4, R=1)
    rows, places = jnp.zeros(4, jnp.int32), jnp.arange(4)
    with pytest.raises(ValueError, match="power-of-two key dim"):
        rule_inputs_pallas(inputs.mixed_TC, history, inputs.conv_weight_C1K, rows, places,
                           num_key_heads=CFG.num_key_heads * 2, key_dim=CFG.key_head_dim // 2 + 1)


def test_kernel_lowers_to_triton_for_a_gpu_from_any_host():
    """A 16-token verify row with Qwen3.5-9B's heads lowers for CUDA to one Triton call."""
    from conftest import triton_calls_for_cuda

    cfg, (inputs, history, _) = nine_b_layer(16)
    kernel = lambda m, h, w, r, p: rule_inputs_pallas(  # noqa: E731
        m, h, w, r, p, num_key_heads=cfg.num_key_heads, key_dim=cfg.key_head_dim, interpret=False)
    assert triton_calls_for_cuda(kernel, inputs.mixed_TC, history, inputs.conv_weight_C1K,
                                 jnp.zeros(16, jnp.int32), jnp.arange(16, dtype=jnp.int32)) == 1


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_gpu_compiled_kernel_matches_the_jnp_inputs():
    import warnings

    _, (inputs, history, _) = nine_b_layer(32, R=2)
    starts, ends = jnp.array([0, 2]), jnp.array([2, 32])
    want, _ = prepared("reference", inputs, history, starts, ends)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
        got, _ = prepared("pallas", inputs, history, starts, ends)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_the_gpu_takes_the_kernel_unless_the_rule_is_the_reference(monkeypatch):
    """"auto" means the kernel on a GPU beside the Pallas rules, and jnp beside the jnp rule
    (the all-jnp path a model the kernels cannot tile falls back to)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert Kernels().resolve().rule_inputs == "pallas"
    assert Kernels(recurrence="pallas").resolve().rule_inputs == "pallas"
    assert Kernels(recurrence="reference").resolve().rule_inputs == "reference"
    assert Kernels(recurrence="reference", rule_inputs="pallas").resolve().rule_inputs == "pallas"
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert Kernels().resolve().rule_inputs == "reference"
