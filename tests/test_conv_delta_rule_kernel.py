"""The gated delta rule with its convolution and norms in the kernel
(pallas_kernels/conv_delta_rule.py; interpret mode on CPU, compiled on a GPU): it computes
what the runtime's jnp path (convolution, SiLU, norms, then the rule) computes, over ragged
rows continuing their histories and states, for the pass and for the commit's walk; a row's
tokens give the same outputs and state bit for bit in one call or one at a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config_types import GatedDeltaNetConfig
from dflash_jax.gated_delta_rule import RecurrentInputs
from dflash_jax.kernels import Kernels
from dflash_jax.recurrent_state import ragged_rule
from pallas_kernels.common import TRITON_DEPRECATION
from pallas_kernels.conv_delta_rule import conv_delta_rule_pallas
from pallas_kernels.delta_rule import token_rows

CFG = GatedDeltaNetConfig(conv_kernel_size=4, num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=64,
                          layers=(0,))
# rows as (start, end): rows shorter than the convolution (history taps), an empty row, padding
ROWS = [((0, 5), (5, 6), (6, 6), (6, 13)), ((0, 1),), ((0, 2), (2, 17), (17, 20))]


def random_layer(rng, T, R, cfg=CFG, dtype=jnp.bfloat16):
    """(RecurrentInputs, history [R, taps - 1, C], state) of one layer."""
    C, taps = cfg.conv_dim, cfg.conv_kernel_size
    mixed = jnp.asarray(rng.normal(size=(T, C)), dtype)
    weight = jnp.asarray(rng.normal(size=(C, 1, taps)) * 0.5, dtype)
    g = jnp.asarray(-np.abs(rng.normal(size=(T, cfg.num_value_heads))), jnp.float32)
    beta = jnp.asarray(rng.uniform(size=(T, cfg.num_value_heads)), jnp.float32)
    history = jnp.asarray(rng.normal(size=(R, taps - 1, C)), dtype)
    state = jnp.asarray(rng.normal(size=(R, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim)), jnp.float32)
    return RecurrentInputs(mixed, g, beta, weight, cfg), history, state


def run(impl, inputs, history, state, starts, ends, commits=None):
    """`ragged_rule` with the `impl` rule over rows [starts, ends): (outputs, pass)."""
    rows_T, in_row_T = token_rows(starts, ends, inputs.mixed_TC.shape[0])
    kernels = Kernels(recurrence=impl, prefill_rule="tokens").resolve()
    return ragged_rule(inputs, history, state, rows_T, starts, in_row_T, kernels, commits_R=commits)


@pytest.mark.parametrize("rows", ROWS, ids=["mixed", "one-token", "verify-like"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernel_computes_the_unfused_path(rows, dtype):
    rng = np.random.default_rng(len(rows))
    starts, ends = (jnp.asarray(x, jnp.int32) for x in zip(*rows))
    inputs, history, state = random_layer(rng, T=24, R=len(rows), dtype=jnp.dtype(dtype))
    commits = jnp.arange(len(rows)) % 2 == 0  # the others' states as they came in (verify rows)
    want_out, want_pass = run("reference", inputs, history, state, starts, ends, commits)
    got_out, got_pass = run("fused", inputs, history, state, starts, ends, commits)
    np.testing.assert_allclose(got_out, want_out, rtol=2e-5, atol=2e-5)
    for got, want in zip(got_pass.after, want_pass.after):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-5, atol=2e-5)
    assert not np.asarray(got_out)[int(ends.max()):].any()  # tokens in no row: zero outputs
    # the commit's walk over each row's first two tokens from the states the pass left
    kept_ends = jnp.minimum(starts + 2, ends)
    np.testing.assert_allclose(got_pass.walk(got_pass.after[1], starts, kept_ends),
                               want_pass.walk(want_pass.after[1], starts, kept_ends), rtol=2e-5, atol=2e-5)


def test_a_block_equals_its_tokens_one_at_a_time():
    """A 7-token row in one call and in seven one-token calls (each continuing the history
    and state the last one left): the same outputs and state, bit for bit."""
    rng = np.random.default_rng(5)
    inputs, history, state = random_layer(rng, T=7, R=1)
    block_out, block_state = conv_delta_rule_pallas(inputs.mixed_TC, history, inputs.conv_weight_C1K, inputs.g_TV,
                                                    inputs.beta_TV, state, jnp.array([0]), jnp.array([7]),
                                                    num_key_heads=CFG.num_key_heads, interpret=True)
    for t in range(7):
        out, state = conv_delta_rule_pallas(inputs.mixed_TC[t:t + 1], history, inputs.conv_weight_C1K,
                                            inputs.g_TV[t:t + 1], inputs.beta_TV[t:t + 1], state, jnp.array([0]),
                                            jnp.array([1]), num_key_heads=CFG.num_key_heads, interpret=True)
        history = jnp.concatenate([history[:, 1:], inputs.mixed_TC[None, t:t + 1]], axis=1)
        np.testing.assert_array_equal(out[0], block_out[t])
    np.testing.assert_array_equal(state, block_state)


def test_channels_that_do_not_fit_are_refused():
    inputs, history, state = random_layer(np.random.default_rng(0), T=3, R=1)
    with pytest.raises(ValueError, match="do not fit 3 key heads"):
        conv_delta_rule_pallas(inputs.mixed_TC, history, inputs.conv_weight_C1K, inputs.g_TV, inputs.beta_TV, state,
                               jnp.array([0]), jnp.array([3]), num_key_heads=3, interpret=True)


def nine_b_layer(T, R=1):
    """Qwen3.5-9B's gated-delta-net heads: 16 key heads, 32 value heads, 128 dims, 4 taps."""
    cfg = GatedDeltaNetConfig(conv_kernel_size=4, num_key_heads=16, num_value_heads=32, key_head_dim=128,
                              value_head_dim=128, layers=(0,))
    return cfg, random_layer(np.random.default_rng(1), T, R, cfg)


def test_kernel_lowers_to_triton_for_a_gpu_from_any_host():
    """A 17-token verify row with Qwen3.5-9B's heads lowers for CUDA to one Triton call."""
    from conftest import triton_calls_for_cuda

    cfg, (inputs, history, state) = nine_b_layer(17)
    kernel = lambda m, h, w, g, b, s: conv_delta_rule_pallas(  # noqa: E731
        m, h, w, g, b, s, jnp.array([0]), jnp.array([17]), num_key_heads=cfg.num_key_heads, interpret=False)
    assert triton_calls_for_cuda(kernel, inputs.mixed_TC, history, inputs.conv_weight_C1K, inputs.g_TV,
                                 inputs.beta_TV, state) == 1


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_gpu_compiled_kernel_matches_the_unfused_path():
    import warnings

    cfg, (inputs, history, state) = nine_b_layer(20, R=2)
    starts, ends = jnp.array([0, 3]), jnp.array([3, 20])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
        want_out, want_pass = run("pallas", inputs, history, state, starts, ends)
        got_out, got_pass = run("fused", inputs, history, state, starts, ends)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_pass.after[1], want_pass.after[1], rtol=1e-4, atol=1e-4)
