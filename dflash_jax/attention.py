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


def dense_attention(q_TUH, k_LKH, v_LKH, mask_TL):
    """Softmax attention with grouped KV heads, softmax in float32; output [T, U, H]."""
    num_tokens, num_heads, head_dim = q_TUH.shape
    num_kv_heads = k_LKH.shape[1]
    q_TKGH = q_TUH.reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores_KGTL = jnp.einsum(
        "tkgh,lkh->kgtl", q_TKGH, k_LKH, preferred_element_type=jnp.float32
    ) * (head_dim**-0.5)
    scores_KGTL = jnp.where(mask_TL[None, None], scores_KGTL, -jnp.inf)
    probs_KGTL = jax.nn.softmax(scores_KGTL, axis=-1)
    out_TKGH = jnp.einsum("kgtl,lkh->tkgh", probs_KGTL.astype(v_LKH.dtype), v_LKH)
    return out_TKGH.reshape(num_tokens, num_heads, head_dim).astype(q_TUH.dtype)
