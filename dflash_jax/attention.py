"""Attention as a function of (queries, keys, values, mask): the interface the models call.

Models project Q/K/V and hand them to an `attend` callable, so the dense path here and a paged
runtime (K/V read from cache pages, a Pallas kernel) plug into the same layers. Masks are built
from absolute positions, which is what both the target's causal rule and the drafter's
per-layer rules (spec section 2) are stated in. `paged_attention_for_step` picks the paged
implementation a step uses (`attention_impl`: the jnp reference here or the Pallas kernel in
`pallas_kernels/paged_attention.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dflash_jax.config import LayerAttention

ATTENTION_IMPLS = ("auto", "reference", "pallas")


def position_mask(q_positions_T, k_positions_S, rule: LayerAttention):
    """bool [T, S]: may the query at each position see the key at each position.

    causal: key position <= query position. window W: query - key < W, and for a non-causal
    windowed layer also key - query < W. E.g. queries at [5, 6], keys at [3, 4, 5, 6], causal
    with W = 2: row 5 sees [4, 5]; row 6 sees [5, 6].
    """
    q = q_positions_T[:, None]
    k = k_positions_S[None, :]
    visible = jnp.ones((q_positions_T.shape[0], k_positions_S.shape[0]), dtype=bool)
    if rule.causal:
        visible &= k <= q
    if rule.window is not None:
        visible &= q - k < rule.window
        if not rule.causal:
            visible &= k - q < rule.window
    return visible


def dense_attention(q_TNH, k_SKH, v_SKH, mask_TS):
    """Softmax attention with grouped KV heads, softmax in float32; output [T, N, H]."""
    num_tokens, num_heads, head_dim = q_TNH.shape
    num_kv_heads = k_SKH.shape[1]
    q_TKGH = q_TNH.reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores_KGTS = jnp.einsum(
        "tkgh,skh->kgts", q_TKGH, k_SKH, preferred_element_type=jnp.float32
    ) * (head_dim**-0.5)
    scores_KGTS = jnp.where(mask_TS[None, None], scores_KGTS, -jnp.inf)
    probs_KGTS = jax.nn.softmax(scores_KGTS, axis=-1)
    out_TKGH = jnp.einsum("kgts,skh->tkgh", probs_KGTS.astype(v_SKH.dtype), v_SKH)
    return out_TKGH.reshape(num_tokens, num_heads, head_dim).astype(q_TNH.dtype)


def paged_attention(
    q_TNH,
    q_positions_T,
    q_req_T,
    k_slots_XKH,
    v_slots_XKH,
    block_table_RM,
    seq_lens_R,
    *,
    page_size: int,
    rule: LayerAttention,
    token_tile: int = 64,
    key_chunk: int = 256,
):
    """Ragged queries over paged K/V: the jnp reference a Pallas kernel can replace.

    Query t belongs to batch row `q_req_T[t]`, whose keys are positions 0..seq_len-1 read
    through its block table; `rule` adds the causal / window conditions on positions. Rows
    with nothing visible (padding) return zeros.

    Work and memory follow the batch's real lengths, not the block table's width: tokens go
    in tiles, and each tile walks its keys in chunks (an online softmax) for as many chunks
    as its longest row needs, so gathered keys stay `[tile, key_chunk, K, H]`. With a single
    block-table row (batch 1: a verify or draft block, a prompt) every token reads the same
    keys, gathered once per chunk as `[key_chunk, K, H]`: on a CPU the per-token gathers made
    each verified row cost ~3 ms more per SmolLM2 step.
    """
    num_tokens, num_heads, head_dim = q_TNH.shape
    num_kv_heads = k_slots_XKH.shape[1]
    group = num_heads // num_kv_heads
    chunk = max(1, key_chunk // page_size) * page_size
    last_page = block_table_RM.shape[1] - 1
    one_row = block_table_RM.shape[0] == 1

    def attend_tile(args):
        q_tNH, pos_t, req_t = args
        tile = q_tNH.shape[0]
        q_tKGH = q_tNH.reshape(tile, num_kv_heads, group, head_dim)
        table_tM = block_table_RM[req_t]
        seq_len_t = seq_lens_R[req_t]

        def one_chunk(c, carry):
            max_tKG, sum_tKG, acc_tKGH = carry
            key_pos_C = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
            pages_C = jnp.minimum(key_pos_C // page_size, last_page)
            if one_row:  # keys shared by every token: [C, K, H]
                slots = block_table_RM[0, pages_C] * page_size + key_pos_C % page_size
                keys, key_dims = k_slots_XKH[slots], "ckh"
                values = v_slots_XKH[slots]
            else:  # keys of each token's own row: [t, C, K, H]
                slots = (jnp.take_along_axis(table_tM, jnp.broadcast_to(pages_C, (tile, chunk)), axis=-1) * page_size
                         + key_pos_C % page_size)
                keys, key_dims = k_slots_XKH[slots], "tckh"
                values = v_slots_XKH[slots]
            mask_tC = position_mask(pos_t, key_pos_C, rule) & (key_pos_C[None] < seq_len_t[:, None])
            scores = jnp.einsum(f"tkgh,{key_dims}->tkgc", q_tKGH, keys, preferred_element_type=jnp.float32)
            scores = jnp.where(mask_tC[:, None, None], scores * head_dim**-0.5, -jnp.inf)
            new_max = jnp.maximum(max_tKG, jnp.max(scores, axis=-1, initial=-1e30))
            probs = jnp.exp(scores - new_max[..., None])
            rescale = jnp.exp(max_tKG - new_max)
            acc_tKGH = acc_tKGH * rescale[..., None] + jnp.einsum(
                f"tkgc,{key_dims}->tkgh", probs.astype(values.dtype), values, preferred_element_type=jnp.float32
            )
            return new_max, sum_tKG * rescale + probs.sum(-1), acc_tKGH

        init = (
            jnp.full((tile, num_kv_heads, group), -1e30, jnp.float32),
            jnp.zeros((tile, num_kv_heads, group), jnp.float32),
            jnp.zeros((tile, num_kv_heads, group, head_dim), jnp.float32),
        )
        num_chunks = (jnp.max(seq_len_t) + chunk - 1) // chunk
        _, sum_tKG, acc_tKGH = jax.lax.fori_loop(0, num_chunks, one_chunk, init)
        out_tKGH = acc_tKGH / jnp.maximum(sum_tKG, 1e-30)[..., None]
        return out_tKGH.reshape(q_tNH.shape).astype(q_TNH.dtype)

    if num_tokens <= token_tile:
        return attend_tile((q_TNH, q_positions_T, q_req_T))
    num_tiles = -(-num_tokens // token_tile)
    pad = num_tiles * token_tile - num_tokens

    def tiles(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num_tiles, token_tile, *x.shape[1:])

    out = jax.lax.map(attend_tile, (tiles(q_TNH), tiles(q_positions_T), tiles(q_req_T)))
    return out.reshape(num_tiles * token_tile, num_heads, head_dim)[:num_tokens]


def resolve_attention_impl(impl: str) -> str:
    """"reference" or "pallas" for an `attention_impl` setting; ValueError for anything else.

    "auto" is the Pallas kernel on a GPU (checked against the reference there by the `gpu`
    tests; 1.7x faster per decode step at Qwen3-8B scale, bench/results/) and the jnp
    reference elsewhere, where the kernel could only run in the slow interpret mode.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {', '.join(ATTENTION_IMPLS)}, got {impl!r}.")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return impl


def paged_attention_for_step(impl: str, q_req_T, *, num_rows: int, group: int, dtype):
    """`paged_attention` (same arguments) as `impl` computes it, for the queries of one step.

    For the Pallas kernel the query blocks, which depend only on the step's `q_req_T`, are
    cut here once and shared by every layer of the step. `num_rows`: block-table rows;
    `group`: query heads per kv head; `dtype`: the queries' dtype.
    """
    if resolve_attention_impl(impl) == "reference":
        return paged_attention
    # Imported here: the kernel module imports dflash_jax.config, whose package imports this one.
    from pallas_kernels.paged_attention import (default_block_q, default_kv_splits, paged_attention_pallas,
                                                query_blocks)

    block_q = default_block_q(q_req_T.shape[0], num_rows, group, f32=jnp.dtype(dtype) == jnp.float32)
    kv_splits = default_kv_splits(q_req_T.shape[0], num_rows, block_q)
    return functools.partial(paged_attention_pallas, block_q=block_q, blocks=query_blocks(q_req_T, block_q),
                             kv_splits=kv_splits)
