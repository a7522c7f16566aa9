"""Dense attention as a function of (queries, keys, values, mask): the models' dense path.

Models project Q/K/V and hand them to an `attend` callable, so this dense path (`dense.py`,
training) and the paged runtime (`steps.py`: K/V read from cache pages, by the jnp reference
or the Pallas kernel `kernels.Kernels` names) plug into the same layers. Masks come from
absolute positions (`pallas_kernels.attention_mask.position_mask`), the terms in which both
the target's causal rule and the drafter's per-layer rules (spec section 2) are stated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.gated_delta_rule import RecurrentInputs, recur_from_zero
from pallas_kernels.attention_mask import position_mask


def dense_attention(q_TUH, k_LKH, v_LKH, mask_TL, sinks_U=None):
    """Softmax attention with grouped KV heads, softmax in float32; output [T, U, H]. `sinks_U`
    (gpt-oss): a logit per query head in each softmax's denominator, attending to nothing."""
    num_tokens, num_heads, head_dim = q_TUH.shape
    num_kv_heads = k_LKH.shape[1]
    group = num_heads // num_kv_heads
    q_TKGH = q_TUH.reshape(num_tokens, num_kv_heads, group, head_dim)
    scores_KGTL = jnp.einsum(
        "tkgh,lkh->kgtl", q_TKGH, k_LKH, preferred_element_type=jnp.float32
    ) * (head_dim**-0.5)
    scores_KGTL = jnp.where(mask_TL[None, None], scores_KGTL, -jnp.inf)
    if sinks_U is None:
        probs_KGTL = jax.nn.softmax(scores_KGTL, axis=-1)
    else:
        sinks_KGT = jnp.broadcast_to(sinks_U.astype(jnp.float32).reshape(num_kv_heads, group, 1),
                                     scores_KGTL.shape[:-1])
        probs_KGTL = jax.nn.softmax(jnp.concatenate([scores_KGTL, sinks_KGT[..., None]], axis=-1), axis=-1)[..., :-1]
    out_TKGH = jnp.einsum("kgtl,lkh->tkgh", probs_KGTL.astype(v_LKH.dtype), v_LKH)
    return out_TKGH.reshape(num_tokens, num_heads, head_dim).astype(q_TUH.dtype)


def target_attend(cfg, positions_T):
    """`attend(layer, heads)` for a target's dense forward over `positions_T` (queries and keys
    alike): each layer's rule (`cfg.layer_attention`: causal, windowed where it says) and its
    attention sinks, if any; a gated-delta-net layer's rule from a zero state."""
    masks = {}

    def attend(layer, heads):
        if isinstance(heads, RecurrentInputs):  # a gated-delta-net layer over the whole sequence
            return recur_from_zero(heads)
        rule = cfg.layer_attention(layer)
        if rule not in masks:
            masks[rule] = position_mask(positions_T, positions_T, rule)
        return dense_attention(*heads.finish(), masks[rule], heads.attention.sinks_U())

    return attend
