"""Attention masks of the training forward: many anchor blocks of one sequence at once.

In training, a sequence of L tokens carries A anchor blocks; block a holds the tokens at
positions p_a .. p_a+B-1. Each block must see exactly what it would see at inference with the
sequence committed up to p_a (spec sections 2 and 7): context keys at positions < p_a, and its
own block's keys, each filtered by the layer's rule (`attention.position_mask`). Blocks never see
each other, so the block part is stored per block ([B, B], the same for every block) instead of
as a dense [A*B, A*B] matrix, which would dominate memory at 512 anchors.

Example, L = 6, anchors [2, 4], B = 2, full (non-causal) layer: the context mask is
block 0: [[1 1 0 0 0 0], [1 1 0 0 0 0]]; block 1: [[1 1 1 1 0 0], [1 1 1 1 0 0]]; the block
mask is all ones. A causal sliding layer with window 2 instead gives block 1 rows
[0 0 1 1 0 0] (query at 4 sees 3, 2) and [0 0 0 1 0 0] (query at 5 sees 4 only), and a lower
triangular block mask.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.attention_mask import position_mask
from dflash_jax.config import LayerAttention


def block_positions(anchors_A, block_size: int):
    """int32 [A, B]: absolute positions p_a + j of every block slot."""
    return anchors_A[:, None].astype(jnp.int32) + jnp.arange(block_size, dtype=jnp.int32)


def context_mask(anchors_A, num_ctx: int, block_size: int, rule: LayerAttention):
    """bool [A, B, L]: block a's slot j may see context position s (s < p_a, and the rule)."""
    q_positions_AB = block_positions(anchors_A, block_size)
    k_positions_L = jnp.arange(num_ctx, dtype=jnp.int32)
    visible_TL = position_mask(q_positions_AB.reshape(-1), k_positions_L, rule)
    before_anchor_AL = k_positions_L[None, :] < anchors_A[:, None]
    return visible_TL.reshape(*q_positions_AB.shape, num_ctx) & before_anchor_AL[:, None, :]


def block_mask(block_size: int, rule: LayerAttention):
    """bool [B, B]: which slots of its own block a slot sees (rules only look at offsets)."""
    offsets_B = jnp.arange(block_size, dtype=jnp.int32)
    return position_mask(offsets_B, offsets_B, rule)
