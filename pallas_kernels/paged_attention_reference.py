"""Ragged queries over paged K/V in plain jnp: the reference `paged_attention.py`'s Pallas
kernel is checked against, and the paged attention off a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention_mask import LayerAttention, position_mask
from pallas_kernels.common import as_values


def paged_attention_reference(
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
    sinks_U=None,
    token_tile: int = 64,
    key_chunk: int = 256,
):
    """Ragged queries over paged K/V: the jnp reference a Pallas kernel can replace.

    Query t belongs to batch row `q_req_T[t]`, whose keys are positions 0..seq_len-1 read
    through its block table; `rule` adds the causal / window conditions on positions. Rows
    with nothing visible (padding) return zeros. `sinks_U` (gpt-oss): a logit per query head
    added to each softmax's denominator.

    Work and memory follow the batch's real lengths, not the block table's width: tokens go
    in query blocks of consecutive tokens of one row, and each query block walks its row's
    keys in chunks (an online softmax), only the chunks its tokens can see
    (`_visible_chunks`), so gathered keys stay `[key_chunk, K, H]`. A query block's tokens
    share that gather: its scores are one matrix product per kv head, `[t * G, H] x [H, L]`.
    Gathering keys per token instead (`[t, L, K, H]`, as this function once did for several
    rows) made each token a matrix-vector product against its own copy of the keys, which
    XLA CPU runs poorly: a few requests' verify blocks in one batch cost several times those
    blocks run one request at a time.

    With a single block-table row (batch 1: a verify or draft block, a prompt) the query
    blocks are tiles of `token_tile` tokens. With several rows a query block starts at a
    token and takes the tokens after it while they stay in its row, up to t of them: t is
    the tokens per row were they even (`T / R`: a verify block's 1 + N rows, 1 when
    decoding), at most `token_tile`. The runtime's batches keep a request's tokens
    contiguous (padding tokens at the end, in row 0), so a request's verify block is one
    query block; any `q_req_T` is correct, a row that comes back later is just another
    query block. The blocks are a while loop over the tokens, each writing its outputs in
    place: unlike cutting them up front (a sort, a scan, a scatter) this adds few kernels for
    XLA to compile, which matters as the tests compile this function in every layer of every
    program. For the same reason a block table no wider than one chunk (the tests', a small
    `generate` call's) is one plain softmax with no loop over chunks.

    Below, t (a local letter) is the tokens of one query block, L the key positions of one
    chunk and P its pages; the other letters as in docs/ARCHITECTURE.md.
    """
    num_tokens, num_heads, head_dim = q_TUH.shape
    num_rows, pages_per_row = block_table_RP.shape
    num_kv_heads = k_slots_XKH.shape[1]
    group = num_heads // num_kv_heads
    # A chunk is whole pages, and no wider than a block-table row: a short table gathers no
    # keys past its end.
    pages_per_chunk = min(max(1, key_chunk // page_size), pages_per_row)
    chunk = pages_per_chunk * page_size
    def gather(slots_XKH, pages_P):
        """The chunk's keys or values `[K, L, H]`, gathered a page at a time (one index per
        page_size slots) from the cache viewed as [pages, page_size, K, H], in q's dtype (a
        cache stored as bits is read as values). The view is taken here, on what the loop
        over chunks receives: the caches themselves, which the step also returns. Viewed
        outside, one written row makes XLA write it twice, into the returned cache and into
        a copy of the viewed one (each a copy of the whole cache)."""
        pages = slots_XKH.reshape(-1, page_size, num_kv_heads, head_dim)
        chunk_LKH = as_values(pages[pages_P], q_TUH.dtype).reshape(chunk, num_kv_heads, head_dim)
        return chunk_LKH.transpose(1, 0, 2)

    def attend(q_tUH, pos_t, valid_t, table_P, seq_len):
        """One query block, tokens of one row (where `valid_t`), against that row's keys."""
        tile = q_tUH.shape[0]
        q_KtGH = q_tUH.reshape(tile, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)

        def one_chunk(c, carry):
            max_KtG, sum_KtG, acc_KtGH = carry
            key_pos_L = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
            pages_P = table_P[jnp.minimum(c * pages_per_chunk + jnp.arange(pages_per_chunk), pages_per_row - 1)]
            keys_KLH, values_KLH = gather(k_slots_XKH, pages_P), gather(v_slots_XKH, pages_P)
            mask_tL = position_mask(pos_t, key_pos_L, rule) & (key_pos_L < seq_len)[None]
            scores = jnp.einsum("ktgh,klh->ktgl", q_KtGH, keys_KLH, preferred_element_type=jnp.float32)
            scores = jnp.where(mask_tL[None, :, None], scores * head_dim**-0.5, -jnp.inf)
            new_max = jnp.maximum(max_KtG, jnp.max(scores, axis=-1, initial=-1e30))
            probs = jnp.exp(scores - new_max[..., None])
            rescale = jnp.exp(max_KtG - new_max)
            acc_KtGH = acc_KtGH * rescale[..., None] + jnp.einsum(
                "ktgl,klh->ktgh", probs.astype(values_KLH.dtype), values_KLH, preferred_element_type=jnp.float32
            )
            return new_max, sum_KtG * rescale + probs.sum(-1), acc_KtGH

        init = (
            jnp.full((num_kv_heads, tile, group), -1e30, jnp.float32),
            jnp.zeros((num_kv_heads, tile, group), jnp.float32),
            jnp.zeros((num_kv_heads, tile, group, head_dim), jnp.float32),
        )
        if pages_per_chunk == pages_per_row:  # the whole row is one chunk: no loop to compile
            max_KtG, sum_KtG, acc_KtGH = one_chunk(0, init)
        else:
            first_chunk, end_chunk = _visible_chunks(pos_t, valid_t, seq_len, rule, chunk)
            max_KtG, sum_KtG, acc_KtGH = jax.lax.fori_loop(first_chunk, end_chunk, one_chunk, init)
        if sinks_U is not None:
            sinks_KG = sinks_U.astype(jnp.float32).reshape(num_kv_heads, 1, group)
            sum_KtG = sum_KtG + jnp.exp(sinks_KG - max_KtG)
        out_KtGH = acc_KtGH / jnp.maximum(sum_KtG, 1e-30)[..., None]
        return out_KtGH.transpose(1, 0, 2, 3).reshape(q_tUH.shape).astype(q_TUH.dtype)

    if num_rows == 1:  # every token reads the same keys: tiles of consecutive tokens
        table_P, seq_len = block_table_RP[0], seq_lens_R[0]
        if num_tokens <= token_tile:
            return attend(q_TUH, q_positions_T, jnp.ones((num_tokens,), bool), table_P, seq_len)
        num_tiles = -(-num_tokens // token_tile)
        pad = num_tiles * token_tile - num_tokens

        def tiles(x):
            x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
            return x.reshape(num_tiles, token_tile, *x.shape[1:])

        valid = tiles(jnp.ones((num_tokens,), bool))
        out = jax.lax.map(lambda a: attend(*a, table_P, seq_len), (tiles(q_TUH), tiles(q_positions_T), valid))
        return out.reshape(num_tiles * token_tile, num_heads, head_dim)[:num_tokens]

    tile = max(1, min(token_tile, -(-num_tokens // num_rows)))  # <= num_tokens
    i_t = jnp.arange(tile, dtype=jnp.int32)

    def one_block(carry):
        """The query block starting at token `start`: tokens from it on while in its row."""
        start, out_TUH = carry
        at = jnp.minimum(start, num_tokens - tile)  # the window [at, at + tile) holds start
        row = q_req_T[start]
        ahead_t = i_t >= start - at
        other_t = ahead_t & (jax.lax.dynamic_slice_in_dim(q_req_T, at, tile) != row)
        valid_t = ahead_t & (i_t < jnp.min(jnp.where(other_t, i_t, tile)))
        out_tUH = attend(jax.lax.dynamic_slice_in_dim(q_TUH, at, tile),
                         jax.lax.dynamic_slice_in_dim(q_positions_T, at, tile), valid_t,
                         block_table_RP[row], seq_lens_R[row])
        out_tUH = jnp.where(valid_t[:, None, None], out_tUH, jax.lax.dynamic_slice_in_dim(out_TUH, at, tile))
        return start + jnp.sum(valid_t), jax.lax.dynamic_update_slice_in_dim(out_TUH, out_tUH, at, 0)

    init = (jnp.int32(0), jnp.zeros_like(q_TUH))
    return jax.lax.while_loop(lambda carry: carry[0] < num_tokens, one_block, init)[1]


def _visible_chunks(pos_t, valid_t, seq_len, rule: LayerAttention, chunk: int):
    """(first, end) key chunks that the valid tokens of a query block may see: keys from
    `min position - W + 1` (windowed rules) to `max position` (causal), `max position + W - 1`
    (non-causal windowed) or `seq_len - 1`. The chunks outside are fully masked, so skipping
    them changes no output; it keeps a long prompt's early tiles, and a windowed layer's
    tokens, from walking every chunk of their row."""
    end = jnp.where(jnp.any(valid_t), seq_len, 0)
    if rule.causal:
        end = jnp.minimum(end, jnp.max(jnp.where(valid_t, pos_t, -1)) + 1)
    elif rule.window is not None:
        end = jnp.minimum(end, jnp.max(jnp.where(valid_t, pos_t, -rule.window)) + rule.window)
    end_chunk = (jnp.maximum(end, 0) + chunk - 1) // chunk
    if rule.window is None:
        return 0, end_chunk
    lowest = jnp.min(jnp.where(valid_t, pos_t, jnp.iinfo(jnp.int32).max))
    return jnp.minimum(jnp.maximum(lowest - rule.window + 1, 0) // chunk, end_chunk), end_chunk
