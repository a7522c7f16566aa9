"""Paged attention for ragged multi-token queries: a Pallas kernel (Triton on the GPU,
interpret mode on CPU) for `paged_attention_reference.paged_attention_reference`, same
arguments, same result.

Query token t belongs to batch row ``q_req_T[t]`` at absolute position ``q_positions_T[t]``;
its keys are that row's positions ``0 .. seq_lens_R[row] - 1``, read through the row's block
table (slot ``block_table[row, p // page] * page + p % page`` of ``k_slots_XKH``), and
``rule`` adds the causal / window conditions (`position_mask`). Softmax is in float32; a
token that sees nothing (padding) gets zeros.

How the work is cut
-------------------
**Query blocks.** Tokens are cut into blocks of at most ``block_q`` consecutive tokens of
one batch row: a block starts where the row changes from the previous token, and every
``block_q`` tokens inside a run of one row. The cut is computed from ``q_req_T`` alone
(`query_blocks`: a few elementwise ops, two scans and a scatter over T); a step computes it
once and passes ``blocks=`` to every layer. Example, ``block_q = 4``::

    q_req_T      = [0, 0, 0, 0, 0, 0, 1, 2, 2, 2, 0, 0]  # padding tokens at the end: row 0
    block starts =  ^           ^     ^  ^        ^      # a new row, or 4 tokens into a run
    block_first  = [0, 4, 6, 7, 10, 12, 12, ...]         # padded with T = 12; num_blocks = 5

The runtime's batches keep a row's tokens contiguous (a verify block of 1 + N rows or a
prefill chunk; padding tokens at the end point at row 0), so a verify block of 16 rows is one
query block and reads its keys once. Any ``q_req_T`` is correct: a row that appears in
several runs is just several blocks. (Fixed tiles of ``block_q`` tokens would need no cut,
but a tile straddling two requests walks the keys of both, and a 16-row verify block that
straddles two tiles is read twice; blocks cut at request starts avoid both.)

**Grid** ``(num_programs, K, kv_splits)``: program (g, k, s) handles query blocks g,
g + num_programs, ... (num_programs is ``min(T, cdiv(T, block_q) + R + 1)``, enough for one
block each when rows are contiguous; programs past the last block exit at once), kv head k,
key split s. GQA: the ``group`` query heads of kv head k are processed together, so the
block is a matrix of ``M = block_q * group_pad`` rows (row i = token i // group_pad, head
i % group_pad; the group padded to a power of two, extra rows masked) against
``[block_k, H]`` key tiles: one K/V load serves the whole group, and the dots have at least
16 rows (block_q is raised until M >= 16). Qwen3-8B (32 / 8 heads): a 16-row verify block
is M = 64; decode is block_q = 4, M = 16 with 4 live rows; prefill is block_q = 32, M = 128.

**Keys.** Each block walks its row's keys in chunks of ``block_k`` positions with an online
softmax (running max, sum and float32 accumulator), for only the chunks its rows can see:
from ``min position - W + 1`` (windowed rules) to ``max position + 1`` (causal), ``+ W``
(non-causal windowed) or ``seq_len`` (non-causal), so cost follows real lengths, not the
block table's width. A chunk's slots come from the block table per key (page ids loaded as
a gathered vector), K/V rows are gathered with computed row indices (``slot * K + k``
into the cache viewed as ``[X * K, H]``), masked past ``seq_len``. With ``kv_splits > 1``
split s takes chunks s, s + kv_splits, ... and writes unnormalised partial results (max,
sum, accumulator) that a jnp epilogue combines: a batch of one long request then fills the
GPU (flash-decoding).

Indexing conventions (Triton lowering and interpret mode alike): every load/store indexes
with integer arrays (rows ``[M, 1]``, columns ``[1, H]``), never a mix of arrays and
slices (interpret mode implements only one or the other); masked lanes of stores point one
row past the end, so the GPU touches nothing and interpret mode's scatter drops them; masks
have the rank of the block. Block shapes are powers of two: ``head_dim`` must be one (and
at least 16, for the dots).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention_mask import LayerAttention, position_mask
from pallas_kernels.common import is_pow2, next_pow2, runs_interpreted

_NEG_INIT = -1e30  # running max before any key (as the jnp reference)


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static sizes of one call (hashable, closed over by the kernel)."""

    num_tokens: int      # T
    num_heads: int       # U
    num_kv_heads: int    # K
    head_dim: int        # H
    num_rows: int        # R, the block table's rows
    table_width: int     # block table columns
    page_size: int
    causal: bool
    window: int | None
    block_q: int         # tokens per query block
    block_k: int         # key positions per chunk
    kv_splits: int
    num_programs: int
    f32: bool            # inputs are float32: IEEE dots
    sinks: bool = False  # a logit per query head in the softmax's denominator (gpt-oss)
    pages_ahead: bool = False  # load chunk j + 1's page ids while chunk j's K/V load

    @property
    def group(self):
        return self.num_heads // self.num_kv_heads

    @property
    def group_pad(self):
        return next_pow2(self.group)

    @property
    def block_rows(self):  # M
        return self.block_q * self.group_pad


def default_block_q(num_tokens: int, num_rows: int, group: int, f32: bool = False) -> int:
    """Tokens per query block: the mean tokens per batch row as a power of two (16 for a
    verify batch of 16-row blocks), at least enough for 16 matrix rows, at most 128 rows,
    or 32 rows for float32 inputs.

    float32 tiles take twice the registers: 64-row float32 blocks spill and run several times
    slower than two 32-row ones (bench/results), hence the lower cap."""
    group_pad = next_pow2(group)
    low, high = max(1, 16 // group_pad), max(1, (32 if f32 else 128) // group_pad)
    return min(max(next_pow2(-(-num_tokens // max(1, num_rows))), low), high)


def max_query_blocks(num_tokens: int, num_rows: int, block_q: int) -> int:
    """The most query blocks `num_tokens` tokens of `num_rows` requests cut into: one per
    block_q tokens, plus one per request start (see `query_blocks`)."""
    return min(num_tokens, -(-num_tokens // block_q) + num_rows)


def default_kv_splits(num_tokens: int, num_rows: int, block_q: int, num_kv_heads: int) -> int:
    """Key splits for a step of `num_tokens` queries over `num_rows` requests: enough that
    query blocks x splits reach ~256 programs over the kv heads (about two per H200 SM), at
    most 32; 1 once the blocks fill the GPU alone (prefill, big batches). The blocks are
    counted as the larger of `num_tokens / block_q` and the rows (a batch-1 verify block is
    one), not the bound `max_query_blocks` that sizes the grid.

    Each program walks its chunks one dependent load after another (page id, then K/V), so
    a few programs over long rows are latency-bound: a batch-1 step over long context with
    ~128 programs leaves half the GPU's load slots idle (bench/results). Splits past a row's
    real length exit at once."""
    blocks = next_pow2(min(num_tokens, max(-(-num_tokens // block_q), num_rows)))
    splits = 256 // num_kv_heads // blocks
    return min(32, 1 << max(0, splits.bit_length() - 1))  # a power of two at most `splits`


LATENCY_SPLITS = 16  # key splits from which a call's programs are few (a batch of one or two long rows)


def default_settings(kv_splits: int, block_rows: int, head_dim: int, f32: bool) -> dict:
    """Triton settings (block_k, num_stages, pages_ahead, num_warps) for a call.

    Calls split `LATENCY_SPLITS` ways or more have few programs, each walking a long row and
    waiting on every chunk's loads: 64-key chunks loaded three stages ahead, each chunk's page
    ids one chunk early, and 8 warps once the [M, H] float32 accumulator reaches 128 x 128 (4
    warps would hold it in too few registers). Other calls (more programs hide each other's
    waits, and three stages would fit fewer of them an SM), float32 inputs and accumulators
    past 64 x 256 (three stages of their tiles would not fit the shared memory) take two
    stages, `default_block_k` and 4 warps (8 for 128-row blocks)."""
    if kv_splits >= LATENCY_SPLITS and not f32 and block_rows * head_dim <= 64 * 256:
        return dict(block_k=64, num_stages=3, pages_ahead=True,
                    num_warps=8 if block_rows * head_dim >= 128 * 128 else 4)
    return dict(block_k=default_block_k(block_rows), num_stages=2, pages_ahead=False,
                num_warps=8 if block_rows >= 128 else 4)


def default_block_k(block_rows: int) -> int:
    """Keys per chunk: 128 for small query blocks (decode: more bytes in flight per step),
    64 otherwise (a [M, 64] float32 score tile beside the [M, H] accumulator)."""
    return 128 if block_rows <= 16 else 64


@functools.partial(jax.tree_util.register_dataclass, data_fields=["first", "num_blocks"],
                   meta_fields=["block_q"])
@dataclasses.dataclass(frozen=True)
class QueryBlocks:
    """Where each query block starts (`query_blocks`); depends on q_req_T and block_q only."""

    first: jax.Array       # [T + 1] first token of each block, then T
    num_blocks: jax.Array  # [1]
    block_q: int


def query_blocks(q_req_T, block_q: int) -> QueryBlocks:
    """Cuts the tokens into query blocks of at most ``block_q`` tokens of one batch row.

    A block starts at a token whose row differs from the previous token's, and every
    ``block_q`` tokens within a run of one row (see the module docstring's example).
    Depends only on ``q_req_T``: compute it once per step and pass it to every layer.
    """
    if not is_pow2(block_q):
        raise ValueError(f"block_q must be a power of two, got {block_q}.")
    q_req_T = jnp.asarray(q_req_T, jnp.int32)
    num_tokens = q_req_T.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    new_run = jnp.concatenate([jnp.ones((1,), bool), q_req_T[1:] != q_req_T[:-1]])
    run_start = lax.cummax(jnp.where(new_run, t, 0), axis=0)
    starts = new_run | (((t - run_start) & (block_q - 1)) == 0)
    index = jnp.cumsum(starts.astype(jnp.int32)) - 1
    first = jnp.full((num_tokens + 1,), num_tokens, jnp.int32)
    first = first.at[jnp.where(starts, index, num_tokens + 1)].set(t, mode="drop")
    return QueryBlocks(first=first, num_blocks=index[-1:] + 1, block_q=block_q)


def _kernel(cfg: _Config, first_ref, num_blocks_ref, req_ref, pos_ref, seq_lens_ref,
            table_ref, q_ref, k_ref, v_ref, sinks_ref, *out_refs):
    """Program (g, kv head, split): query blocks g, g + programs, ... against one kv head."""
    T, U, K, H = cfg.num_tokens, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    programs, splits, chunk, M = cfg.num_programs, cfg.kv_splits, cfg.block_k, cfg.block_rows
    group, group_pad, page = cfg.group, cfg.group_pad, cfg.page_size
    rule = LayerAttention(cfg.causal, cfg.window)
    precision = lax.Precision.HIGHEST if cfg.f32 else None
    g, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    cols = lax.iota(jnp.int32, H)[None, :]                     # [1, H]
    row = lax.iota(jnp.int32, M)
    token_in_block, head_in_group = row // group_pad, row % group_pad
    key_in_chunk = lax.iota(jnp.int32, chunk)

    def one_block(i, carry):
        block = g + i * programs
        first = first_ref[block]
        num_block_tokens = first_ref[block + 1] - first
        req = jnp.clip(req_ref[first], 0, cfg.num_rows - 1)
        seq_len = seq_lens_ref[req]

        valid = (token_in_block < num_block_tokens) & (head_in_group < group)   # [M]
        token = jnp.minimum(first + token_in_block, T - 1)
        q_pos = plgpu.load(pos_ref.at[token])                                    # [M]
        q_row = token * U + kv_head * group + jnp.minimum(head_in_group, group - 1)
        q = plgpu.load(q_ref.at[q_row[:, None], cols], mask=valid[:, None], other=0)

        # Chunks this block can see, then this split's share of them.
        hi = seq_len
        lo = jnp.int32(0)
        if rule.causal:
            hi = jnp.minimum(hi, jnp.max(jnp.where(valid, q_pos, -1)) + 1)
        elif rule.window is not None:
            hi = jnp.minimum(hi, jnp.max(jnp.where(valid, q_pos, -1)) + rule.window)
        if rule.window is not None:
            lo = jnp.maximum(jnp.min(jnp.where(valid, q_pos, 2**30)) - rule.window + 1, 0)
        first_chunk = lo // chunk
        num_chunks = jnp.maximum((hi + chunk - 1) // chunk - first_chunk, 0)
        trips = jnp.maximum(num_chunks - split + splits - 1, 0) // splits

        def chunk_keys(j):
            return (first_chunk + split + j * splits) * chunk + key_in_chunk          # [chunk]

        def page_ids(j):
            page_index = jnp.minimum(chunk_keys(j) // page, cfg.table_width - 1)
            return plgpu.load(table_ref.at[req * cfg.table_width + page_index])

        def one_chunk(j, state):
            max_M, sum_M, acc_MH = state[:3]
            key_pos = chunk_keys(j)
            if cfg.pages_ahead:
                page_id, next_page_id = state[3], page_ids(j + 1)
            else:
                page_id = page_ids(j)
            key_ok = key_pos < seq_len
            kv_row = jnp.where(key_ok, (page_id * page + key_pos % page) * K + kv_head, 0)
            k = plgpu.load(k_ref.at[kv_row[:, None], cols], mask=key_ok[:, None], other=0)
            v = plgpu.load(v_ref.at[kv_row[:, None], cols], mask=key_ok[:, None], other=0)
            scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32) * (H ** -0.5)
            visible = position_mask(q_pos, key_pos, rule) & (key_pos >= 0)[None, :] & key_ok[None, :] & valid[:, None]
            scores = jnp.where(visible, scores, -jnp.inf)
            new_max = jnp.maximum(max_M, jnp.max(scores, axis=1))
            probs = jnp.exp(scores - new_max[:, None])
            rescale = jnp.exp(max_M - new_max)
            acc_MH = acc_MH * rescale[:, None] + lax.dot_general(
                probs.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                preferred_element_type=jnp.float32)
            state = (new_max, sum_M * rescale + jnp.sum(probs, axis=1), acc_MH)
            return state + (next_page_id,) if cfg.pages_ahead else state

        init = (jnp.full((M,), _NEG_INIT, jnp.float32), jnp.zeros((M,), jnp.float32),
                jnp.zeros((M, H), jnp.float32))
        if cfg.pages_ahead:
            init = init + (page_ids(0),)
        max_M, sum_M, acc_MH = lax.fori_loop(0, trips, one_chunk, init)[:3]

        # Masked lanes point one row past the end: never touched on the GPU, dropped by
        # interpret mode's scatter (so duplicates never race a real row).
        if splits == 1:
            (o_ref,) = out_refs
            out_row = jnp.where(valid, q_row, T * U)
            if cfg.sinks:
                sum_M = sum_M + jnp.exp(plgpu.load(sinks_ref.at[q_row % U]) - max_M)
            out = acc_MH / jnp.maximum(sum_M, 1e-30)[:, None]
            plgpu.store(o_ref.at[out_row[:, None], cols], out.astype(o_ref.dtype),
                        mask=valid[:, None])
        else:
            acc_ref, max_ref, sum_ref = out_refs
            part_row = jnp.where(valid, split * (T * U) + q_row, splits * T * U)
            plgpu.store(acc_ref.at[part_row[:, None], cols], acc_MH, mask=valid[:, None])
            plgpu.store(max_ref.at[part_row], max_M, mask=valid)
            plgpu.store(sum_ref.at[part_row], sum_M, mask=valid)
        return carry

    num_blocks = num_blocks_ref[0]
    lax.fori_loop(0, jnp.maximum(num_blocks - g + programs - 1, 0) // programs, one_block, 0)


def _check(q_TUH, k_slots_XKH, v_slots_XKH, block_table_RP, seq_lens_R, q_positions_T,
           q_req_T, page_size, block_q, block_k, kv_splits):
    """ValueError with what is wrong for shapes and settings the kernel cannot take."""
    if q_TUH.ndim != 3 or k_slots_XKH.ndim != 3:
        raise ValueError(f"q must be [T, U, H] and k/v [slots, K, H]; got {q_TUH.shape} and "
                         f"{k_slots_XKH.shape}.")
    T, U, H = q_TUH.shape
    X, K, Hk = k_slots_XKH.shape
    if v_slots_XKH.shape != k_slots_XKH.shape:
        raise ValueError(f"k and v slots differ in shape: {k_slots_XKH.shape} vs "
                         f"{v_slots_XKH.shape}.")
    if Hk != H or K < 1 or U % K:
        raise ValueError(f"q heads {U} x {H} do not group over kv heads {K} x {Hk}: need the "
                         "same head_dim and num_heads a multiple of num_kv_heads.")
    if not is_pow2(H) or H < 16:
        raise ValueError(f"head_dim {H} must be a power of two >= 16 for the Pallas kernel; "
                         "use dflash_jax.attention.paged_attention for other sizes.")
    dtypes = {q_TUH.dtype, k_slots_XKH.dtype, v_slots_XKH.dtype}
    if len(dtypes) != 1 or q_TUH.dtype not in (jnp.bfloat16, jnp.float32, jnp.float16):
        raise ValueError(f"q, k and v must share one of bfloat16/float16/float32, got "
                         f"{q_TUH.dtype}, {k_slots_XKH.dtype}, {v_slots_XKH.dtype}.")
    if block_table_RP.ndim != 2 or block_table_RP.shape[1] < 1:
        raise ValueError(f"block_table must be [R, max_blocks >= 1], got {block_table_RP.shape}.")
    if seq_lens_R.shape != (block_table_RP.shape[0],):
        raise ValueError(f"seq_lens has shape {seq_lens_R.shape}; expected "
                         f"({block_table_RP.shape[0]},), one per block-table row.")
    if q_positions_T.shape != (T,) or q_req_T.shape != (T,):
        raise ValueError(f"q_positions and q_req must be [T={T}], got {q_positions_T.shape} "
                         f"and {q_req_T.shape}.")
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, got {page_size}.")
    for name, value in (("block_q", block_q), ("block_k", block_k), ("kv_splits", kv_splits)):
        if value is not None and not is_pow2(value):
            raise ValueError(f"{name} must be a power of two, got {value}.")
    if block_k is not None and block_k < 16:
        raise ValueError(f"block_k must be at least 16 (a Triton dot dimension), got {block_k}.")


@functools.partial(jax.jit, static_argnames=(
    "page_size", "rule", "token_tile", "key_chunk", "interpret", "block_q", "block_k",
    "kv_splits", "num_warps", "num_stages", "pages_ahead"))
def paged_attention_pallas(
    q_TUH,
    q_positions_T,
    q_req_T,
    k_slots_XKH,
    v_slots_XKH,
    block_table_RP,
    seq_lens_R,
    *,
    page_size: int,
    rule: LayerAttention,
    token_tile: int | None = None,
    key_chunk: int | None = None,
    interpret: bool | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    kv_splits: int = 1,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pages_ahead: bool | None = None,
    blocks=None,
    sinks_U=None,
):
    """`paged_attention_reference` as a Pallas kernel; output [T, U, H] in q's dtype.

    token_tile, key_chunk: the jnp reference's knobs, accepted so a call site can switch
        functions unchanged; unused here.
    interpret: None runs compiled on a GPU backend and in interpret mode elsewhere.
    block_q: tokens per query block (power of two); default `default_block_q` (16 for a
        batch of 16-row verify blocks, 4 for decode with 4 query heads per kv head).
    block_k: key positions per chunk (power of two >= 16).
    kv_splits: key splits per query block (power of two); > 1 for few long requests.
    num_warps, num_stages: Triton settings.
    pages_ahead: load each chunk's page ids one chunk early (carried in registers), so a
        chunk's K/V loads do not wait on its page-id load.
    (block_k, num_warps, num_stages, pages_ahead: None takes `default_settings`'.)
    blocks: `query_blocks(q_req_T, block_q)` computed once per step (its block_q at most
        this call's), or None to compute it here.
    sinks_U: as the reference's.
    """
    q_positions_T = jnp.asarray(q_positions_T, jnp.int32)
    q_req_T = jnp.asarray(q_req_T, jnp.int32)
    block_table_RP = jnp.asarray(block_table_RP, jnp.int32)
    seq_lens_R = jnp.asarray(seq_lens_R, jnp.int32)
    _check(q_TUH, k_slots_XKH, v_slots_XKH, block_table_RP, seq_lens_R, q_positions_T,
           q_req_T, page_size, block_q, block_k, kv_splits)
    T, U, H = q_TUH.shape
    X, K, _ = k_slots_XKH.shape
    R, width = block_table_RP.shape
    if T == 0:
        return jnp.zeros_like(q_TUH)
    group = U // K
    if block_q is None:
        block_q = default_block_q(T, R, group, f32=q_TUH.dtype == jnp.float32)
    block_q = max(block_q, 16 // next_pow2(group))   # at least 16 dot rows
    cfg = _Config(
        num_tokens=T, num_heads=U, num_kv_heads=K, head_dim=H, num_rows=R, table_width=width,
        page_size=page_size, causal=rule.causal, window=rule.window, block_q=block_q,
        block_k=0, kv_splits=kv_splits, num_programs=min(T, max_query_blocks(T, R, block_q) + 1),
        f32=q_TUH.dtype == jnp.float32, sinks=sinks_U is not None)
    given = dict(block_k=block_k, num_stages=num_stages, pages_ahead=pages_ahead, num_warps=num_warps)
    settings = default_settings(kv_splits, cfg.block_rows, H, cfg.f32) | {
        name: value for name, value in given.items() if value is not None}
    cfg = dataclasses.replace(cfg, block_k=settings["block_k"], pages_ahead=settings["pages_ahead"])
    sinks_U = jnp.zeros((U,), jnp.float32) if sinks_U is None else sinks_U.astype(jnp.float32)
    if blocks is None:
        blocks = query_blocks(q_req_T, block_q)
    elif blocks.block_q > block_q:
        raise ValueError(f"blocks were cut with block_q={blocks.block_q} but this call's block_q "
                         f"is {block_q}; pass query_blocks(q_req_T, {block_q}).")

    interpret = runs_interpreted(interpret)
    splits = kv_splits
    rows = T * U
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((rows, H), q_TUH.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((splits * rows, H), jnp.float32),
                     jax.ShapeDtypeStruct((splits * rows,), jnp.float32),
                     jax.ShapeDtypeStruct((splits * rows,), jnp.float32)]
    outs = pl.pallas_call(
        functools.partial(_kernel, cfg),
        out_shape=out_shape,
        grid=(cfg.num_programs, K, splits),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=settings["num_warps"], num_stages=settings["num_stages"]),
        name="paged_attention_ragged",
    )(blocks.first, blocks.num_blocks, q_req_T, q_positions_T, seq_lens_R,
      block_table_RP.reshape(-1), q_TUH.reshape(rows, H), k_slots_XKH.reshape(X * K, H),
      v_slots_XKH.reshape(X * K, H), sinks_U)
    if splits == 1:
        return outs[0].reshape(T, U, H)
    # The flash-decoding epilogue, left to XLA: as one Pallas kernel (a program per query row)
    # it was slower than XLA's fused kernels (bench/LESSONS.md). s: key splits.
    acc_sMH = outs[0].reshape(splits, rows, H)
    max_sM, sum_sM = outs[1].reshape(splits, rows), outs[2].reshape(splits, rows)
    top_M = jnp.max(max_sM, axis=0)
    weight_sM = jnp.exp(max_sM - top_M)
    total_M = jnp.sum(weight_sM * sum_sM, axis=0)
    if cfg.sinks:
        total_M = total_M + jnp.exp(jnp.tile(sinks_U, T) - top_M)
    out_MH = jnp.sum(weight_sM[..., None] * acc_sMH, axis=0) / jnp.maximum(total_M, 1e-30)[:, None]
    return out_MH.reshape(T, U, H).astype(q_TUH.dtype)
