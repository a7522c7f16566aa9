"""The training forward: all anchor blocks of one sequence through the drafter in one pass.

Keys are [context K/V of all L positions | the A blocks' own K/V]. Attention is computed in two
parts that share one softmax: block queries against the context ([A, B, L] mask from
`masks.context_mask`) and against their own block only ([A, B, B]). For one anchor this is
the inference path (`dense.draft_logits` with the sequence cut at the anchor), which the tests
check logit for logit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.attention import target_attend
from dflash_jax.layers import finishing
from dflash_jax.models import Drafter, Target
from dflash_jax.train.masks import block_mask, block_positions, context_mask


def target_logits_and_features(target: Target, token_ids_L, layer_ids):
    """(logits [L, V] float32, features [L, n*D]) of the frozen target, causal, positions 0..L-1.

    Padding at the end of a sequence cannot change earlier rows, so padded batches are safe.
    Under jit an unused `logits` output is dropped by XLA.
    """
    positions_L = jnp.arange(token_ids_L.shape[0], dtype=jnp.int32)
    hidden_LD, features_LF = target(token_ids_L, positions_L, target_attend(target.cfg, positions_L),
                                    layer_ids=layer_ids)
    return target.unembed(hidden_LD), features_LF


def block_attention(q_ABUH, ctx_k_LKH, ctx_v_LKH, blk_k_ABKH, blk_v_ABKH, ctx_mask_ABL, blk_mask_BB):
    """Softmax over [context | own block] keys, grouped KV heads, float32 scores; [A, B, U, H]."""
    num_anchors, block_size, num_heads, head_dim = q_ABUH.shape
    num_kv_heads = ctx_k_LKH.shape[1]
    q_ABKGH = q_ABUH.reshape(num_anchors, block_size, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scale = head_dim**-0.5
    ctx_scores = jnp.einsum("abkgh,lkh->abkgl", q_ABKGH, ctx_k_LKH, preferred_element_type=jnp.float32)
    blk_scores = jnp.einsum("abkgh,ackh->abkgc", q_ABKGH, blk_k_ABKH, preferred_element_type=jnp.float32)
    ctx_scores = jnp.where(ctx_mask_ABL[:, :, None, None, :], ctx_scores * scale, -jnp.inf)
    blk_scores = jnp.where(blk_mask_BB[None, :, None, None, :], blk_scores * scale, -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([ctx_scores, blk_scores], axis=-1), axis=-1)
    num_ctx = ctx_k_LKH.shape[0]
    ctx_probs, blk_probs = probs[..., :num_ctx], probs[..., num_ctx:]
    out_ABKGH = jnp.einsum("abkgl,lkh->abkgh", ctx_probs.astype(ctx_v_LKH.dtype), ctx_v_LKH)
    out_ABKGH += jnp.einsum("abkgc,ackh->abkgh", blk_probs.astype(blk_v_ABKH.dtype), blk_v_ABKH)
    return out_ABKGH.reshape(q_ABUH.shape).astype(q_ABUH.dtype)


def block_hidden(target: Target, drafter: Drafter, token_ids_L, features_LF, anchors_A):
    """Drafter hidden states [A, B, D] (after the final norm) of blocks [x_p, MASK x (B-1)]."""
    cfg = drafter.cfg
    num_ctx, block_size, num_anchors = token_ids_L.shape[0], cfg.trained_block_size, anchors_A.shape[0]
    positions_AB = block_positions(anchors_A, block_size)
    block_ids_AB = jnp.full((num_anchors, block_size), cfg.mask_token_id, jnp.int32)
    block_ids_AB = block_ids_AB.at[:, 0].set(token_ids_L[anchors_A])
    context_kv = drafter.context_kv(features_LF, jnp.arange(num_ctx, dtype=jnp.int32))

    def attend(layer_idx, q_TUH, k_TKH, v_TKH):
        rule = cfg.layers[layer_idx]
        ctx_k, ctx_v = context_kv[layer_idx]
        as_blocks = lambda x: x.reshape(num_anchors, block_size, *x.shape[1:])
        out_ABUH = block_attention(
            as_blocks(q_TUH), ctx_k, ctx_v, as_blocks(k_TKH), as_blocks(v_TKH),
            context_mask(anchors_A, num_ctx, block_size, rule), block_mask(block_size, rule),
        )
        return out_ABUH.reshape(q_TUH.shape)

    embeds_TD = target.embed(block_ids_AB.reshape(-1)).astype(drafter.dtype)
    hidden_TD = drafter(embeds_TD, positions_AB.reshape(-1), finishing(attend), block_size=block_size)
    return hidden_TD.reshape(num_anchors, block_size, -1)


def block_outputs(target: Target, drafter: Drafter, token_ids_L, features_LF, anchors_A):
    """(float32 logits [A, B-1, V] through the target's head, hidden states [A, B-1, D]) of
    block slots 1..B-1: what DFlash 2's candidate selector reads."""
    hidden_ABD = block_hidden(target, drafter, token_ids_L, features_LF, anchors_A)
    num_anchors, block_size, hidden = hidden_ABD.shape
    hidden_TD = hidden_ABD[:, 1:].reshape(-1, hidden).astype(target.dtype)
    logits = drafter.logits(target.unembed, hidden_TD).reshape(num_anchors, block_size - 1, -1)
    return logits, hidden_ABD[:, 1:]


def block_logits(target: Target, drafter: Drafter, token_ids_L, features_LF, anchors_A):
    """float32 logits [A, B-1, V] of block slots 1..B-1 (`block_outputs`' first)."""
    return block_outputs(target, drafter, token_ids_L, features_LF, anchors_A)[0]


def block_drafts(target: Target, drafter: Drafter, token_ids_L, features_LF, anchors_A):
    """Greedy drafts [A, B-1] of each anchor's block: the logits' argmax, or for a DFlash 2
    drafter its candidate selector's best path from the anchor's token."""
    logits_ANV, hidden_AND = block_outputs(target, drafter, token_ids_L, features_LF, anchors_A)
    if drafter.cfg.dflash2 is None:
        return jnp.argmax(logits_ANV, axis=-1).astype(jnp.int32)
    return drafter.candidate_selector.walk(hidden_AND, logits_ANV, token_ids_L[anchors_A])[0]
