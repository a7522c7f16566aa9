"""The gated delta rule over a ragged batch as one Pallas kernel (Triton lowering on a GPU,
interpret mode on CPU), and its jnp reference.

Per token, per value head, with S a [key dim, value dim] float32 state:
S <- exp(g) S; S <- S + k (x) beta (v - S^T k); out = S^T q. Each value column of S evolves
on its own (the rule mixes key rows, never value columns), so a program owns one batch row,
one value head and `block_v` value columns, keeps that slice of S in registers and walks the
row's tokens in order: the state is read once and written once per call, whatever the
tokens, which is what decode and verify steps (a few tokens per row) need. Rows are
`[start, end)` token ranges; tokens in no range are not touched and their outputs are zero.
A row of `chunk` tokens or more (a prefill chunk) walks its whole chunks in the chunked (WY)
form instead, a few small products per chunk where the token walk makes `chunk` dependent
steps, and its last tokens one at a time.

A row shorter than a chunk goes through the same operations in the same order whatever else
is in the call, so a verify block computes exactly what single steps compute.
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
CHUNK = 64  # tokens per chunk of the chunked form (prefill rows)


def _token_rows(starts_R, ends_R, num_tokens: int):
    """(row [T], in a row [T]) of each token given the rows' [start, end) ranges."""
    t_T = jnp.arange(num_tokens)[:, None]
    in_TR = (t_T >= starts_R[None, :]) & (t_T < ends_R[None, :])
    return jnp.argmax(in_TR, axis=1), jnp.any(in_TR, axis=1)


def delta_rule_reference(q_THK, k_THK, v_THV, g_TH, beta_TH, state_RHKV, starts_R, ends_R, *, outputs: bool = True):
    """(out [T, value heads, value dim] float32, state [R, value heads, key dim, value dim]):
    each row's tokens `[starts_R[r], ends_R[r])` run through the rule from `state_RHKV[r]`.
    q and k (float32, prepared: L2-normed, q scaled) have key heads, each shared by value
    heads / key heads consecutive value heads; g and beta are per value head. With
    `outputs=False` the outputs are zeros (a caller that wants the states alone)."""
    repeat = v_THV.shape[1] // q_THK.shape[1]
    q_THK, k_THK = (jnp.repeat(x, repeat, axis=1) for x in (q_THK, k_THK))
    row_T, in_row_T = _token_rows(starts_R, ends_R, q_THK.shape[0])

    def step(state_RHKV, token):
        q_HK, k_HK, v_HV, g_H, beta_H, row, in_row = token
        state_HKV = state_RHKV[row] * jnp.exp(g_H)[:, None, None]
        remembered_HV = jnp.einsum("hkv,hk->hv", state_HKV, k_HK)
        state_HKV = state_HKV + k_HK[:, :, None] * ((v_HV - remembered_HV) * beta_H[:, None])[:, None, :]
        out_HV = jnp.where(in_row, jnp.einsum("hkv,hk->hv", state_HKV, q_HK), 0)
        return state_RHKV.at[row].set(jnp.where(in_row, state_HKV, state_RHKV[row])), out_HV

    tokens = (q_THK, k_THK, v_THV, g_TH, beta_TH, row_T, in_row_T)
    state_RHKV, out_THV = lax.scan(step, state_RHKV, tokens)
    return (out_THV if outputs else jnp.zeros_like(out_THV)), state_RHKV


def _dot(a, b, contract=((1,), (0,))):
    return lax.dot_general(a, b, (contract, ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _chunk_step(q_ref, k_ref, v_ref, g_ref, beta_ref, out_ref, t0, state_KV, *, chunk: int, key_head, head, cols,
                write_out: bool):
    """The state after the `chunk` tokens from `t0` (and their outputs), in the chunked
    (WY) form: with gamma_t the decay from the chunk's start through token t, the values the
    tokens write are U = T (beta V - beta gamma K S0), T = (I + M)^-1 for the strictly lower
    M_tj = beta_t (gamma_t / gamma_j) k_t.k_j, found row by row (forward substitution)."""
    tokens = pl.ds(t0, chunk)
    q_CK, k_CK = q_ref[tokens, key_head, :], k_ref[tokens, key_head, :]
    v_CV, g_C, beta_C = v_ref[tokens, head, cols], g_ref[tokens, head], beta_ref[tokens, head]
    t_C1, j_1C = jnp.arange(chunk)[:, None], jnp.arange(chunk)[None, :]
    log_gamma_C = jnp.sum(jnp.where(t_C1 >= j_1C, g_C[None, :], 0.0), axis=1)  # cumulative decay
    decay_CC = jnp.exp(jnp.where(t_C1 >= j_1C, log_gamma_C[:, None] - log_gamma_C[None, :], -jnp.inf))
    m_CC = jnp.where(t_C1 > j_1C, beta_C[:, None] * decay_CC * _dot(k_CK, k_CK, ((1,), (1,))), 0.0)

    def substitute(i, inverse_CC):  # row i of (I + M)^-1 from the rows before it
        m_C = jnp.sum(jnp.where(t_C1 == i, m_CC, 0.0), axis=0)
        row_C = jnp.where(jnp.arange(chunk) == i, 1.0, 0.0) - jnp.sum(m_C[:, None] * inverse_CC, axis=0)
        return jnp.where(t_C1 == i, row_C[None, :], inverse_CC)

    inverse_CC = lax.fori_loop(0, chunk, substitute, jnp.zeros((chunk, chunk), jnp.float32))
    gamma_C = jnp.exp(log_gamma_C)
    written_CV = _dot(inverse_CC, v_CV * beta_C[:, None]) - _dot(
        _dot(inverse_CC, k_CK * (beta_C * gamma_C)[:, None]), state_KV)
    if write_out:
        out_ref[tokens, head, cols] = (_dot(q_CK * gamma_C[:, None], state_KV)
                                       + _dot(_dot(q_CK, k_CK, ((1,), (1,))) * decay_CC, written_CV))
    log_last = jnp.sum(jnp.where(jnp.arange(chunk) == chunk - 1, log_gamma_C, 0.0))
    return jnp.exp(log_last) * state_KV + _dot(k_CK * jnp.exp(log_last - log_gamma_C)[:, None], written_CV,
                                               ((0,), (0,)))


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, state_in_ref, starts_ref, ends_ref, out_ref, state_ref, *,
            repeat: int, block_v: int, write_out: bool, chunk: int):
    row, head, col_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    key_head = head // repeat
    cols = pl.ds(col_block * block_v, block_v)

    def step(t, state_KV):
        k_K = k_ref[t, key_head, :]
        state_KV = state_KV * jnp.exp(g_ref[t, head])
        remembered_V = jnp.sum(state_KV * k_K[:, None], axis=0)
        update_V = (v_ref[t, head, cols] - remembered_V) * beta_ref[t, head]
        state_KV = state_KV + k_K[:, None] * update_V[None, :]
        if write_out:
            out_ref[t, head, cols] = jnp.sum(state_KV * q_ref[t, key_head, :][:, None], axis=0)
        return state_KV

    start, end = starts_ref[row], ends_ref[row]
    state_KV = state_in_ref[row, head, :, cols]
    if chunk:  # whole chunks first (prefill rows), then the rest one token at a time
        chunks = (end - start) // chunk
        state_KV = lax.fori_loop(0, chunks, lambda c, s: _chunk_step(
            q_ref, k_ref, v_ref, g_ref, beta_ref, out_ref, start + c * chunk, s, chunk=chunk, key_head=key_head,
            head=head, cols=cols, write_out=write_out), state_KV)
        start = start + chunks * chunk
    state_ref[row, head, :, cols] = lax.fori_loop(start, end, step, state_KV)


def delta_rule_pallas(q_THK, k_THK, v_THV, g_TH, beta_TH, state_RHKV, starts_R, ends_R, *, outputs: bool = True,
                      block_v: int = BLOCK_V, chunk: int = CHUNK, num_warps: int = 4, interpret: bool | None = None):
    """`delta_rule_reference` (same arguments and result) as one kernel, which with
    `outputs=False` writes no outputs. Rows of at least `chunk` tokens (prefill) take their
    whole chunks in the chunked form (0: never). interpret: None runs compiled on a GPU
    backend and in interpret mode elsewhere."""
    T, Hk, K = q_THK.shape
    R, H, _, V = state_RHKV.shape
    block_v = min(block_v, V)
    if not (is_pow2(K) and is_pow2(block_v)) or V % block_v:
        raise ValueError(f"the delta-rule kernel needs a power-of-two key dim ({K}) and value columns in "
                         f"power-of-two blocks ({V} by {block_v}); use delta_rule_reference.")
    interpret = runs_interpreted(interpret)
    out, state = pl.pallas_call(
        functools.partial(_kernel, repeat=H // Hk, block_v=block_v, write_out=outputs,
                          chunk=chunk if T >= chunk else 0),
        out_shape=(jax.ShapeDtypeStruct((T, H, V), jnp.float32), jax.ShapeDtypeStruct(state_RHKV.shape, jnp.float32)),
        grid=(R, H, V // block_v),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        input_output_aliases={5: 1},
        name="gated_delta_rule",
    )(q_THK, k_THK, v_THV, g_TH, beta_TH, state_RHKV, starts_R.astype(jnp.int32), ends_R.astype(jnp.int32))
    if not outputs:
        return jnp.zeros_like(out), state
    _, in_row_T = _token_rows(starts_R, ends_R, T)
    return jnp.where(in_row_T[:, None, None], out, 0), state
