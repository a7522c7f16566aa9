"""Attention as a function of (queries, keys, values, mask): the interface the models call.

Models project Q/K/V and hand them to an `attend` callable, so the dense path here and a paged
runtime (K/V read from cache pages, a Pallas kernel) plug into the same layers. Masks are built
from absolute positions, which is what both the target's causal rule and the drafter's
per-layer rules (spec section 2) are stated in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.config import LayerAttention
from dflash_jax.kv_cache import slots_of


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
):
    """Ragged queries over paged K/V: the jnp reference a Pallas kernel can replace.

    Query t belongs to batch row `q_req_T[t]`, whose keys are positions 0..seq_len-1 read
    through its block table; `rule` adds the causal / window conditions on positions. Rows
    with nothing visible (padding) return zeros. Tokens are processed in tiles so the
    gathered keys stay `[tile, max_blocks * page_size, K, H]`.
    """
    num_tokens, num_heads, head_dim = q_TNH.shape
    num_kv_heads = k_slots_XKH.shape[1]
    key_positions_C = jnp.arange(block_table_RM.shape[1] * page_size, dtype=jnp.int32)

    def attend_tile(args):
        q_tNH, pos_t, req_t = args
        key_positions_tC = jnp.broadcast_to(key_positions_C, (req_t.shape[0], key_positions_C.shape[0]))
        slots_tC = slots_of(block_table_RM[req_t], key_positions_tC, page_size)
        k_tCKH, v_tCKH = k_slots_XKH[slots_tC], v_slots_XKH[slots_tC]
        mask_tC = position_mask(pos_t, key_positions_C, rule) & (key_positions_C[None] < seq_lens_R[req_t][:, None])
        q_tKGH = q_tNH.reshape(q_tNH.shape[0], num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = jnp.einsum("tkgh,tckh->tkgc", q_tKGH, k_tCKH, preferred_element_type=jnp.float32)
        scores = jnp.where(mask_tC[:, None, None], scores * head_dim**-0.5, -jnp.inf)
        probs = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True, initial=-1e30))
        probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), 1e-30)
        out_tKGH = jnp.einsum("tkgc,tckh->tkgh", probs.astype(v_tCKH.dtype), v_tCKH)
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
