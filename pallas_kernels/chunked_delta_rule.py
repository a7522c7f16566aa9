"""The gated delta rule over long rows (prefill) in chunks of `CHUNK` tokens: products over a
chunk's tokens in place of a walk over them one at a time, as `delta_rule_reference` computes
it (same arguments and result, up to float rounding). The chunk-parallel part is jnp (batched
products and one triangular solve, what XLA does well); the walk from chunk to chunk, which
carries the state, is a Pallas kernel (Triton lowering on a GPU, interpret mode on CPU) with a
`lax.scan` reference.

Within a chunk (one value head; G the running sum of g from the chunk's start, S0 the state
before it) each token writes u_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_{j<i} exp(G_i - G_j)
(k_i . k_j) u_j) into the state: a unit lower-triangular system (I + A) U = beta V - diag(beta
exp(G)) K S0, solved once per chunk for the terms that do not depend on S0 (`_ChunkTerms`: U =
base - W S0). Then out = (Q exp(G)) S0 + tril(exp(G_i - G_j) q_i . k_j) U and the state after the
chunk is exp(G_last) S0 + (K exp(G_last - G))^T U. Every exponent is <= 0. Padding tokens at a
row's end carry g = beta = k = q = 0: they leave the state as it is.

A chunk's tokens are summed in a different order than the one-at-a-time walk, so where a step
must compute exactly what single steps compute (decode, verify) the runtime keeps the walk.

Shape letters here are the rule's own (as in `delta_rule.py`): H value heads, K key dim, V
value dim; and N chunks, C a chunk's tokens.
"""

from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import is_pow2, runs_interpreted
from pallas_kernels.delta_rule import token_rows

CHUNK = 64  # tokens a chunk solves at once (transformers' chunked form uses 64 too)
BLOCK_V = 32  # value columns per program of the walk
NUM_WARPS = 8  # at 4 the walk's tiles spill (bench/results)
MIN_DOT = 16  # Triton's products need at least 16 along each dimension

_HIGHEST = lax.Precision.HIGHEST


class _ChunkLayout(typing.NamedTuple):
    """Where each row's tokens sit in chunks: row r holds chunks `[chunk_starts_R[r],
    chunk_ends_R[r])`; chunk c belongs to row `row_N[c]` where `real_N[c]` (the chunks past the
    last row's are unused) and holds tokens `token_NC[c]` (T where it has none); token t is
    token `offset_T[t]` of chunk `chunk_T[t]` where it is in a row (`in_row_T`)."""

    token_NC: jax.Array
    row_N: jax.Array
    real_N: jax.Array
    chunk_starts_R: jax.Array
    chunk_ends_R: jax.Array
    chunk_T: jax.Array
    offset_T: jax.Array
    in_row_T: jax.Array


def chunks_for(num_tokens: int, num_rows: int, chunk: int = CHUNK, *, min_row_tokens: int = 1) -> int:
    """Chunks that hold any `num_rows` rows of `num_tokens` tokens in all, each row of
    `min_row_tokens` or more (or none): a row wastes less than one chunk, and rows of a chunk
    or more take at most twice their tokens' worth."""
    bound = num_tokens // chunk + num_rows
    return min(bound, 2 * num_tokens // chunk) if min_row_tokens >= chunk else bound


def _chunk_layout(starts_R, ends_R, num_tokens: int, chunk: int, num_chunks: int) -> _ChunkLayout:
    """Each row's tokens `[starts_R[r], ends_R[r])` cut into chunks of `chunk` from its first
    token, the rows' chunks one after another in `num_chunks` (at least all of theirs)."""
    num_rows = starts_R.shape[0]
    counts_R = (jnp.maximum(ends_R - starts_R, 0) + chunk - 1) // chunk
    chunk_ends_R = jnp.cumsum(counts_R)
    chunk_starts_R = chunk_ends_R - counts_R
    c_N = jnp.arange(num_chunks)
    row_N = jnp.minimum(jnp.searchsorted(chunk_ends_R, c_N, side="right"), num_rows - 1)
    real_N = c_N < chunk_ends_R[-1]
    token_NC = starts_R[row_N, None] + (c_N - chunk_starts_R[row_N])[:, None] * chunk + jnp.arange(chunk)[None, :]
    token_NC = jnp.where(real_N[:, None] & (token_NC < ends_R[row_N, None]), token_NC, num_tokens)
    row_T, in_row_T = token_rows(starts_R, ends_R, num_tokens)
    index_T = jnp.arange(num_tokens) - starts_R[row_T]
    return _ChunkLayout(token_NC, row_N, real_N, chunk_starts_R, chunk_ends_R, chunk_starts_R[row_T] + index_T // chunk,
                        index_T % chunk, in_row_T)


class _ChunkTerms(typing.NamedTuple):
    """Per chunk and value head, what the walk needs beside the state (float32): queries
    scaled by exp(G) [N, H, C, K], W [N, H, C, K] and the base values [N, H, C, V] of U =
    base - W S0, keys scaled by exp(G_last - G) [N, H, C, K], the causal query-key
    weights tril(exp(G_i - G_j) q_i . k_j) [N, H, C, C] and the chunk's decay exp(G_last)
    [N, H]."""

    q_NHCK: jax.Array
    w_NHCK: jax.Array
    base_NHCV: jax.Array
    k_NHCK: jax.Array
    weights_NHCC: jax.Array
    decay_NH: jax.Array


def _chunk_terms(q_THK, k_THK, v_THV, g_TH, beta_TH, token_NC) -> _ChunkTerms:
    """Every chunk's terms at once (batched products and solves, no dependence between
    chunks): the part of the rule that does not need the state."""
    repeat = v_THV.shape[1] // q_THK.shape[1]

    def gather(x, repeats=1):  # [T, heads, ...] -> [N, H, C, ...], zeros at padding
        x = jnp.take(x, token_NC, axis=0, mode="fill", fill_value=0)
        return jnp.moveaxis(jnp.repeat(x, repeats, axis=2), 2, 1)

    q_NHCK, k_NHCK = gather(q_THK, repeat), gather(k_THK, repeat)
    v_NHCV, g_NHC, beta_NHC = gather(v_THV), gather(g_TH), gather(beta_TH)
    chunk = token_NC.shape[1]
    cum_NHC = jnp.cumsum(g_NHC, axis=-1)
    causal_CC = jnp.arange(chunk)[:, None] >= jnp.arange(chunk)[None, :]
    # exp(G_i - G_j) where j <= i; above the diagonal the exponent would be positive: masked first
    decay_NHCC = jnp.exp(jnp.where(causal_CC, cum_NHC[..., :, None] - cum_NHC[..., None, :], -jnp.inf))
    strictly_CC = causal_CC & ~jnp.eye(chunk, dtype=bool)
    kk_NHCC = jnp.einsum("nhik,nhjk->nhij", k_NHCK, k_NHCK, precision=_HIGHEST)
    system_NHCC = jnp.eye(chunk) + jnp.where(strictly_CC, beta_NHC[..., None] * decay_NHCC * kk_NHCC, 0)
    rhs = jnp.concatenate([(beta_NHC * jnp.exp(cum_NHC))[..., None] * k_NHCK, beta_NHC[..., None] * v_NHCV], axis=-1)
    solved = lax.linalg.triangular_solve(system_NHCC, rhs, left_side=True, lower=True, unit_diagonal=True)
    w_NHCK, base_NHCV = jnp.split(solved, [k_NHCK.shape[-1]], axis=-1)
    qk_NHCC = jnp.einsum("nhik,nhjk->nhij", q_NHCK, k_NHCK, precision=_HIGHEST)
    last_NH = cum_NHC[..., -1]
    return _ChunkTerms(q_NHCK * jnp.exp(cum_NHC)[..., None], w_NHCK, base_NHCV,
                       k_NHCK * jnp.exp(last_NH[..., None] - cum_NHC)[..., None], decay_NHCC * qk_NHCC,
                       jnp.exp(last_NH))


def _advance_chunk(s_KV, terms, dot):
    """(the chunk's outputs [C, V], the state after it) from the state before it, for one
    chunk and value head's terms (`_ChunkTerms` without their leading axes)."""
    q_CK, w_CK, base_CV, k_CK, weights_CC, decay = terms
    u_CV = base_CV - dot(w_CK, s_KV, ((1,), (0,)))
    out_CV = dot(q_CK, s_KV, ((1,), (0,))) + dot(weights_CC, u_CV, ((1,), (0,)))
    return out_CV, decay * s_KV + dot(k_CK, u_CV, ((0,), (0,)))


def _dot(a, b, contracting):
    """A float32 product at full precision (Triton's IEEE mode on a GPU: no TF32)."""
    return lax.dot_general(a, b, (contracting, ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32)


def _walk_reference(terms: _ChunkTerms, state_RHKV, layout: _ChunkLayout, commits_R):
    """(outputs [N, H, C, V], states): the chunks one after another, each advancing its row's
    state (the kernel's walk as a `lax.scan`)."""
    advance = jax.vmap(functools.partial(_advance_chunk, dot=_dot))  # over value heads

    def step(state_RHKV, chunk):
        row, real, *terms_H = chunk
        out_HCV, after_HKV = advance(state_RHKV[row], tuple(terms_H))
        return state_RHKV.at[row].set(jnp.where(real, after_HKV, state_RHKV[row])), out_HCV

    after_RHKV, out_NHCV = lax.scan(step, state_RHKV, (layout.row_N, layout.real_N, *terms))
    return out_NHCV, jnp.where(commits_R[:, None, None, None], after_RHKV, state_RHKV)


def _walk_kernel(q_ref, w_ref, base_ref, k_ref, weights_ref, decay_ref, state_in_ref, chunk_starts_ref, chunk_ends_ref,
                 commits_ref, out_ref, state_ref, *, block_v: int, write_out: bool):
    row, head, col_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(col_block * block_v, block_v)

    def chunk(c, s_KV):
        terms = (q_ref[c, head], w_ref[c, head], base_ref[c, head, :, cols], k_ref[c, head], weights_ref[c, head],
                 decay_ref[c, head])
        out_CV, s_KV = _advance_chunk(s_KV, terms, _dot)
        if write_out:
            out_ref[c, head, :, cols] = out_CV
        return s_KV

    s_KV = lax.fori_loop(chunk_starts_ref[row], chunk_ends_ref[row], chunk, state_in_ref[row, head, :, cols])

    @pl.when(commits_ref[row] != 0)  # else the row's state stays as it came in (the output aliases it)
    def _():
        state_ref[row, head, :, cols] = s_KV


def _walk_pallas(terms: _ChunkTerms, state_RHKV, layout: _ChunkLayout, commits_R, *, outputs: bool, block_v: int,
                 num_warps: int, interpret: bool):
    R, H, K, V = state_RHKV.shape
    num_chunks, _, chunk, _ = terms.q_NHCK.shape
    return pl.pallas_call(
        functools.partial(_walk_kernel, block_v=block_v, write_out=outputs),
        out_shape=(jax.ShapeDtypeStruct((num_chunks, H, chunk, V), jnp.float32),
                   jax.ShapeDtypeStruct(state_RHKV.shape, jnp.float32)),
        grid=(R, H, V // block_v),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        input_output_aliases={6: 1},
        name="chunked_delta_rule_walk",
    )(*terms, state_RHKV, layout.chunk_starts_R.astype(jnp.int32), layout.chunk_ends_R.astype(jnp.int32),
      commits_R.astype(jnp.int32))


def _chunked(walk, q_THK, k_THK, v_THV, g_TH, beta_TH, state_RHKV, starts_R, ends_R, outputs, commits_R, chunk,
             num_chunks):
    num_tokens = q_THK.shape[0]
    num_chunks = chunks_for(num_tokens, starts_R.shape[0], chunk) if num_chunks is None else num_chunks
    layout = _chunk_layout(starts_R.astype(jnp.int32), ends_R.astype(jnp.int32), num_tokens, chunk, num_chunks)
    terms = _chunk_terms(q_THK, k_THK, v_THV, g_TH, beta_TH, layout.token_NC)
    commits_R = jnp.ones(starts_R.shape, bool) if commits_R is None else commits_R
    out_NHCV, after_RHKV = walk(terms, state_RHKV.astype(jnp.float32), layout, commits_R)
    if not outputs:
        return jnp.zeros(v_THV.shape, jnp.float32), after_RHKV
    out_THV = out_NHCV[layout.chunk_T, :, layout.offset_T]
    return jnp.where(layout.in_row_T[:, None, None], out_THV, 0), after_RHKV


def chunked_delta_rule_reference(q_THK, k_THK, v_THV, g_TH, beta_TH, state_RHKV, starts_R, ends_R, *,
                                 outputs: bool = True, commits_R=None, chunk: int = CHUNK,
                                 num_chunks: int | None = None):
    """`delta_rule_reference` (same arguments and result, to float rounding) in chunks of
    `chunk` tokens from each row's start, the walk over chunks a `lax.scan`. `num_chunks`:
    the chunks laid out, at least the rows' (None: `chunks_for` any rows)."""
    return _chunked(_walk_reference, q_THK, k_THK, v_THV, g_TH, beta_TH, state_RHKV, starts_R, ends_R, outputs,
                    commits_R, chunk, num_chunks)


def chunked_delta_rule_pallas(q_THK, k_THK, v_THV, g_TH, beta_TH, state_RHKV, starts_R, ends_R, *,
                              outputs: bool = True, commits_R=None, chunk: int = CHUNK,
                              num_chunks: int | None = None, block_v: int = BLOCK_V, num_warps: int = NUM_WARPS,
                              interpret: bool | None = None):
    """`chunked_delta_rule_reference` with the walk over chunks as one Pallas kernel (a program
    per row, value head and `block_v` value columns). Compiled, a key dim, chunk or value block
    under 16 (Triton's smallest product) takes the reference walk. interpret: None runs
    compiled on a GPU backend and in interpret mode elsewhere."""
    K, V = q_THK.shape[-1], v_THV.shape[-1]
    block_v = min(block_v, V)
    if not all(is_pow2(n) for n in (K, block_v, chunk)) or V % block_v:
        raise ValueError(f"the chunked delta-rule kernel needs a power-of-two key dim ({K}), chunk ({chunk}) and "
                         f"value columns in power-of-two blocks ({V} by {block_v}); use chunked_delta_rule_reference.")
    interpret = runs_interpreted(interpret)
    if not interpret and min(K, block_v, chunk) < MIN_DOT:
        return chunked_delta_rule_reference(q_THK, k_THK, v_THV, g_TH, beta_TH, state_RHKV, starts_R, ends_R,
                                            outputs=outputs, commits_R=commits_R, chunk=chunk, num_chunks=num_chunks)
    walk = functools.partial(_walk_pallas, outputs=outputs, block_v=block_v, num_warps=num_warps, interpret=interpret)
    return _chunked(walk, q_THK, k_THK, v_THV, g_TH, beta_TH, state_RHKV, starts_R, ends_R, outputs, commits_R, chunk,
                    num_chunks)
