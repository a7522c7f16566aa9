"""The gated delta rule over a ragged batch as one Pallas kernel (Triton lowering on a GPU,
interpret mode on CPU), and its jnp reference.

Per token, per value head, with S a [key dim, value dim] float32 state:
S <- exp(g) S; S <- S + k (x) beta (v - S^T k); out = S^T q. Each value column of S evolves
on its own (the rule mixes key rows, never value columns), so a program owns one batch row,
one value head and `block_v` value columns, keeps that slice of S in registers and walks the
row's tokens in order: the state is read once and written once per call, whatever the
tokens, which is what decode and verify steps (a few tokens per row) need. Rows are
`[start, end)` token ranges; tokens in no range are not touched and their outputs are zero.
The walk goes in runs of `unroll` tokens whose inputs are loaded before the first update
(a token's inputs do not depend on the state, so their loads overlap instead of each
waiting on memory in turn), then the row's last tokens one at a time.

Every token of a row goes through the same operations in the same order whatever else is
in the call and wherever it falls in a run, so a verify block computes exactly what single steps compute.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import is_pow2, runs_interpreted

BLOCK_V = 32  # value columns per program: a [key dim, 32] float32 slice of S fits a program's registers
UNROLL = 4  # tokens a program loads at once: a verify row's loads wait on memory once a run, not once a token
UNROLL_MAX_PROGRAMS = 512  # past ~4 programs an SM, others hide a program's waits, and runs only add registers


def token_rows(starts_R, ends_R, num_tokens: int):
    """(row [T], in a row [T]) of each token given the rows' [start, end) ranges."""
    t_T = jnp.arange(num_tokens)[:, None]
    in_TR = (t_T >= starts_R[None, :]) & (t_T < ends_R[None, :])
    return jnp.argmax(in_TR, axis=1), jnp.any(in_TR, axis=1)


def delta_rule_reference(q_THK, k_THK, v_THV, g_TH, beta_TH, state_RHKV, starts_R, ends_R, *, outputs: bool = True,
                         commits_R=None):
    """(out [T, value heads, value dim] float32, state [R, value heads, key dim, value dim]):
    each row's tokens `[starts_R[r], ends_R[r])` run through the rule from `state_RHKV[r]`.
    q and k (float32, prepared: L2-normed, q scaled) have key heads, each shared by value
    heads / key heads consecutive value heads; g and beta are per value head. With
    `outputs=False` the outputs are zeros (a caller that wants the states alone). `commits_R`
    (bool [R], None: every row): the rows whose advanced state is returned; the others' comes
    back as it went in (a caller that will advance them over fewer tokens)."""
    repeat = v_THV.shape[1] // q_THK.shape[1]
    q_THK, k_THK = (jnp.repeat(x, repeat, axis=1) for x in (q_THK, k_THK))
    row_T, in_row_T = token_rows(starts_R, ends_R, q_THK.shape[0])

    def step(state_RHKV, token):
        q_HK, k_HK, v_HV, g_H, beta_H, row, in_row = token
        state_HKV = state_RHKV[row] * jnp.exp(g_H)[:, None, None]
        remembered_HV = jnp.einsum("hkv,hk->hv", state_HKV, k_HK)
        state_HKV = state_HKV + k_HK[:, :, None] * ((v_HV - remembered_HV) * beta_H[:, None])[:, None, :]
        out_HV = jnp.where(in_row, jnp.einsum("hkv,hk->hv", state_HKV, q_HK), 0)
        return state_RHKV.at[row].set(jnp.where(in_row, state_HKV, state_RHKV[row])), out_HV

    tokens = (q_THK, k_THK, v_THV, g_TH, beta_TH, row_T, in_row_T)
    after_RHKV, out_THV = lax.scan(step, state_RHKV, tokens)
    if commits_R is not None:
        after_RHKV = jnp.where(commits_R[:, None, None, None], after_RHKV, state_RHKV)
    return (out_THV if outputs else jnp.zeros_like(out_THV)), after_RHKV


def make_advance(out_ref, head, cols, write_out: bool):
    """`advance(t, state_KV, inputs)`: one token of the rule on a program's [key dim,
    block_v] slice of S (inputs: k, q, v, g, beta), writing its output at (t, head, cols)."""

    def advance(t, state_KV, inputs):
        k_K, q_K, v_V, g, beta = inputs
        state_KV = state_KV * jnp.exp(g)
        remembered_V = jnp.sum(state_KV * k_K[:, None], axis=0)
        state_KV = state_KV + k_K[:, None] * ((v_V - remembered_V) * beta)[None, :]
        if write_out:
            out_ref[t, head, cols] = jnp.sum(state_KV * q_K[:, None], axis=0)
        return state_KV

    return advance


def walk_row(start, end, state_KV, token, advance, unroll: int):
    """The state after tokens [start, end): in runs of `unroll` tokens whose inputs
    (`token(t)`, independent of the state) are loaded before the run's chain of updates,
    then the last tokens one at a time."""

    def run(first, state_KV):
        tokens = [token(first + i) for i in range(unroll)]  # loads issued before the chain of updates
        for i, inputs in enumerate(tokens):
            state_KV = advance(first + i, state_KV, inputs)
        return state_KV

    runs = (end - start) // unroll
    state_KV = lax.fori_loop(0, runs, lambda i, s: run(start + i * unroll, s), state_KV)
    return lax.fori_loop(start + runs * unroll, end, lambda t, s: advance(t, s, token(t)), state_KV)


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, state_in_ref, starts_ref, ends_ref, commits_ref, out_ref, state_ref,
            *, repeat: int, block_v: int, unroll: int, write_out: bool):
    row, head, col_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    key_head = head // repeat
    cols = pl.ds(col_block * block_v, block_v)

    def token(t):
        return k_ref[t, key_head, :], q_ref[t, key_head, :], v_ref[t, head, cols], g_ref[t, head], beta_ref[t, head]

    state_KV = walk_row(starts_ref[row], ends_ref[row], state_in_ref[row, head, :, cols], token,
                        make_advance(out_ref, head, cols, write_out), unroll)

    @pl.when(commits_ref[row] != 0)  # else the row's state stays as it came in (the output aliases it)
    def _():
        state_ref[row, head, :, cols] = state_KV


def rule_call(kernel, inputs, state_RHKV, starts_R, ends_R, *, num_tokens: int, key_dim: int, block_v: int,
              unroll: int | None, outputs: bool, commits_R, num_warps: int, interpret: bool | None, name: str):
    """(out [T, value heads, value dim] float32, state) of a rule kernel over a program per
    (row, value head, `block_v` value columns) whose arguments are `inputs`, then the state,
    starts, ends and commits (`functools.partial` of a kernel taking `unroll` and
    `write_out`); checks the tiling, defaults `unroll`, zeroes the outputs of tokens in no row."""
    R, H, _, V = state_RHKV.shape
    if not (is_pow2(key_dim) and is_pow2(block_v)) or V % block_v:
        raise ValueError(f"the delta-rule kernel needs a power-of-two key dim ({key_dim}) and value columns in "
                         f"power-of-two blocks ({V} by {block_v}); use the jnp rule (Kernels(recurrence=\"reference\")).")
    if unroll is None:
        unroll = UNROLL if R * H * (V // block_v) <= UNROLL_MAX_PROGRAMS else 1
    commits_R = jnp.ones((R,), jnp.int32) if commits_R is None else commits_R.astype(jnp.int32)
    out, state = pl.pallas_call(
        functools.partial(kernel, unroll=unroll, write_out=outputs),
        out_shape=(jax.ShapeDtypeStruct((num_tokens, H, V), jnp.float32),
                   jax.ShapeDtypeStruct(state_RHKV.shape, jnp.float32)),
        grid=(R, H, V // block_v),
        interpret=runs_interpreted(interpret),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        input_output_aliases={len(inputs): 1},
        name=name,
    )(*inputs, state_RHKV.astype(jnp.float32), starts_R.astype(jnp.int32), ends_R.astype(jnp.int32), commits_R)
    if not outputs:
        return jnp.zeros_like(out), state
    _, in_row_T = token_rows(starts_R, ends_R, num_tokens)
    return jnp.where(in_row_T[:, None, None], out, 0), state


def delta_rule_pallas(q_THK, k_THK, v_THV, g_TH, beta_TH, state_RHKV, starts_R, ends_R, *, outputs: bool = True,
                      commits_R=None, block_v: int = BLOCK_V, unroll: int | None = None, num_warps: int = 4,
                      interpret: bool | None = None):
    """`delta_rule_reference` (same arguments and result) as one kernel, which with
    `outputs=False` writes no outputs. interpret: None runs compiled on a GPU backend and in
    interpret mode elsewhere. unroll: tokens per run (None: `UNROLL` where the
    call has at most `UNROLL_MAX_PROGRAMS` programs, else 1)."""
    T, Hk, K = q_THK.shape
    H, V = state_RHKV.shape[1], state_RHKV.shape[3]
    block_v = min(block_v, V)
    return rule_call(functools.partial(_kernel, repeat=H // Hk, block_v=block_v), (q_THK, k_THK, v_THV, g_TH, beta_TH),
                     state_RHKV, starts_R, ends_R, num_tokens=T, key_dim=K, block_v=block_v, unroll=unroll,
                     outputs=outputs, commits_R=commits_R, num_warps=num_warps, interpret=interpret,
                     name="gated_delta_rule")
