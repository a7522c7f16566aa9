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
