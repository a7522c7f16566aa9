"""The gated delta rule over ragged rows (pallas_kernels/delta_rule.py; compiled on a GPU,
interpret mode on CPU): the kernel computes its jnp reference for rows of any length, empty
rows and tokens in no row; the reference equals transformers' recurrent form; a row's tokens
give the same outputs and state bit for bit whether they come in one call or one at a time
(a verify block computes what single steps compute)."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.chunked_delta_rule import chunked_delta_rule_pallas
from pallas_kernels.delta_rule import delta_rule_pallas, delta_rule_reference

HERE = Path(__file__).resolve().parent


def random_inputs(rng, T, R, Hk=2, Hv=4, dk=16, dv=64):
    q, k = (rng.normal(size=(T, Hk, dk)).astype(np.float32) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = rng.normal(size=(T, Hv, dv)).astype(np.float32)
    g = -np.abs(rng.normal(size=(T, Hv))).astype(np.float32)
    beta = rng.uniform(size=(T, Hv)).astype(np.float32)
    state = rng.normal(size=(R, Hv, dk, dv)).astype(np.float32)
    return [jnp.asarray(x) for x in (q, k, v, g, beta, state)]


# rows as (start, end): contiguous, an empty row, a padding tail no row holds
ROWS = [((0, 5), (5, 6), (6, 6), (6, 13)), ((0, 1),), ((0, 16), (16, 17), (17, 20))]


@pytest.mark.parametrize("rows", ROWS, ids=["mixed", "one-token", "prefill-then-decode"])
@pytest.mark.parametrize("block_v", [32, 64])
def test_kernel_computes_its_reference(rows, block_v):
    rng = np.random.default_rng(len(rows))
    starts, ends = (jnp.asarray(x, jnp.int32) for x in zip(*rows))
    inputs = random_inputs(rng, T=24, R=len(rows))
    want_out, want_state = delta_rule_reference(*inputs, starts, ends)
    got_out, got_state = delta_rule_pallas(*inputs, starts, ends, block_v=block_v, interpret=True)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_state, want_state, rtol=1e-5, atol=1e-5)
    assert not np.asarray(got_out)[int(ends.max()):].any()  # tokens in no row: zero outputs
    untouched = [r for r, (s, e) in enumerate(rows) if s == e]
    np.testing.assert_array_equal(np.asarray(got_state)[untouched], np.asarray(inputs[5])[untouched])
    _, states_only = delta_rule_pallas(*inputs, starts, ends, outputs=False, interpret=True)
    np.testing.assert_array_equal(states_only, got_state)
    commits = jnp.arange(len(rows)) % 2 == 0  # every other row's state comes back as it went in
    outputs_kept, some_states = delta_rule_pallas(*inputs, starts, ends, commits_R=commits, interpret=True)
    np.testing.assert_array_equal(outputs_kept, got_out)
    want_some = np.where(np.asarray(commits)[:, None, None, None], np.asarray(want_state), np.asarray(inputs[5]))
    np.testing.assert_allclose(some_states, want_some, rtol=1e-5, atol=1e-5)
    _, reference_some = delta_rule_reference(*inputs, starts, ends, commits_R=commits)
    np.testing.assert_array_equal(reference_some, np.where(np.asarray(commits)[:, None, None, None],
                                                           np.asarray(want_state), np.asarray(inputs[5])))


def assert_equals_transformers(ours, theirs, num_tokens: int):
    """`ours` (`delta_rule_reference`'s signature) over one row of random inputs equals
    transformers' `theirs` (its recurrent or chunked form) from the same state."""
    torch = pytest.importorskip("torch")
    q, k, v, g, beta, state = random_inputs(np.random.default_rng(3), T=num_tokens, R=1)
    q_rep, k_rep = (jnp.repeat(x, 2, axis=1) for x in (q * 16 ** 0.5, k))  # its heads repeated already; it scales q
    out, final = theirs(*(torch.tensor(np.asarray(x))[None] for x in (q_rep, k_rep, v, g, beta)),
                        initial_state=torch.tensor(np.asarray(state)), output_final_state=True,
                        use_qk_l2norm_in_kernel=False)
    got, last = ours(q, k, v, g, beta, state, jnp.array([0]), jnp.array([num_tokens]))
    np.testing.assert_allclose(got, out[0].numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(last, final.numpy(), rtol=1e-4, atol=1e-5)


def test_reference_matches_transformers_recurrent_form():
    pytest.importorskip("torch")
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    assert_equals_transformers(delta_rule_reference, torch_recurrent_gated_delta_rule, 9)


def assert_block_equals_its_tokens(rule, inputs):
    q, k, v, g, beta, state = inputs
    T = q.shape[0]
    block_out, block_state = rule(q, k, v, g, beta, state, jnp.array([0]), jnp.array([T]))
    for t in range(T):
        one = [x[t:t + 1] for x in (q, k, v, g, beta)]
        out, state = rule(*one, state, jnp.array([0]), jnp.array([1]))
        np.testing.assert_array_equal(out[0], block_out[t])
    np.testing.assert_array_equal(state, block_state)


def block_equals_its_tokens(kernel: str) -> None:
    rule = {"pallas": lambda *a: delta_rule_pallas(*a, interpret=True),
            "pallas-unroll-1": lambda *a: delta_rule_pallas(*a, unroll=1, interpret=True),
            "reference": delta_rule_reference}[kernel]
    assert_block_equals_its_tokens(rule, random_inputs(np.random.default_rng(5), T=6, R=1))


@pytest.mark.parametrize("kernel", ["pallas", "pallas-unroll-1", "reference"])
def test_a_block_equals_its_tokens_one_at_a_time(kernel):
    """6 tokens: in runs of 4 (few programs), tokens 0-3 come in a run and 4-5 one at a time;
    in runs of 1 (many programs) each alone.

    Run in a fresh interpreter with XLA CPU's code generation at optimization level 0 and its
    fusion emitters, and nothing else: the interpreted kernel's run of 4 tokens keeps the single
    tokens' order of float operations there, and LLVM's optimized code (XLA's default) or the
    older emitters (the suite's other fast-compile flag) reorder it by an ulp."""
    env = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", f"import test_delta_rule_kernel as t; t.block_equals_its_tokens({kernel!r})"],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("kernel", [delta_rule_pallas, chunked_delta_rule_pallas], ids=["walk", "chunked"])
def test_shapes_the_kernels_cannot_tile_are_refused(kernel):
    q, k, v, g, beta, state = random_inputs(np.random.default_rng(0), T=4, R=1, dk=12)
    with pytest.raises(ValueError, match="power-of-two key dim"):
        kernel(q, k, v, g, beta, state, jnp.array([0]), jnp.array([4]), interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("block_v", [32, 64])
def test_gpu_compiled_kernel_matches_reference(block_v):
    """Qwen3.5-9B's linear-attention heads: 16 key heads, 32 value heads of 128."""
    rng = np.random.default_rng(0)
    rows = ((0, 1), (1, 17), (17, 17), (17, 300))
    starts, ends = (jnp.asarray(x, jnp.int32) for x in zip(*rows))
    inputs = random_inputs(rng, T=320, R=len(rows), Hk=16, Hv=32, dk=128, dv=128)
    with jax.default_matmul_precision("highest"):
        want_out, want_state = delta_rule_reference(*inputs, starts, ends)
    got_out, got_state = delta_rule_pallas(*inputs, starts, ends, block_v=block_v, interpret=False)
    np.testing.assert_allclose(got_out, want_out, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(got_state, want_state, rtol=2e-4, atol=2e-4)
    commits = jnp.array([True, False, True, False])  # rows 1 and 3: states back as they came in
    _, some_states = delta_rule_pallas(*inputs, starts, ends, commits_R=commits, block_v=block_v, interpret=False)
    np.testing.assert_array_equal(np.asarray(some_states)[[1, 3]], np.asarray(inputs[5])[[1, 3]])
    np.testing.assert_allclose(np.asarray(some_states)[[0, 2]], np.asarray(want_state)[[0, 2]], rtol=2e-4, atol=2e-4)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_gpu_verify_block_equals_its_tokens_one_at_a_time():
    """A 17-token verify row (runs of tokens, then the last alone) against 17 one-token
    calls, bit for bit, at Qwen3.5-9B's heads."""
    inputs = random_inputs(np.random.default_rng(2), T=17, R=1, Hk=16, Hv=32, dk=128, dv=128)
    assert_block_equals_its_tokens(jax.jit(lambda *a: delta_rule_pallas(*a, interpret=False)), inputs)
