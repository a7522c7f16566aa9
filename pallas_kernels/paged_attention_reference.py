"""Ragged queries over paged K/V in plain jnp: the reference `paged_attention.py`'s Pallas
kernel is checked against, and the paged attention off a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention_mask import LayerAttention, position_mask


def paged_attention_reference(
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
    keys, gathered once per chunk as `[key_chunk, K, H]`: per-token gathers made every verified
    row cost extra on a CPU.
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
