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
