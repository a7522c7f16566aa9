"""Random anchor positions per sequence (spec section 7), drawn inside the jitted step."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_anchors(key, loss_mask_L, max_anchors: int):
    """(anchors int32 [A], valid bool [A]): up to A distinct positions p, uniformly at random,
    among those where the loss mask is on at p and p+1 (a block needs a token to predict).

    Static shape: when fewer positions qualify, the extra anchors are invalid and sit at 0.
    """
    eligible_L = loss_mask_L & jnp.concatenate([loss_mask_L[1:], jnp.zeros((1,), bool)])
    scores_L = jnp.where(eligible_L, jax.random.uniform(key, loss_mask_L.shape), -1.0)
    num_anchors = min(max_anchors, loss_mask_L.shape[0])
    top_scores_A, anchors_A = jax.lax.top_k(scores_L, num_anchors)
    valid_A = top_scores_A >= 0
    return jnp.where(valid_A, anchors_A, 0).astype(jnp.int32), valid_A
