"""Which keys a query may see: the rule every attention path here applies (dense, the paged
jnp reference, the paged Pallas kernel), stated in absolute positions."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """How one layer attends: causal or not, and an optional window (keys within W)."""

    causal: bool
    window: int | None = None


CAUSAL = LayerAttention(causal=True)


def position_mask(q_positions_T, k_positions_L, rule: LayerAttention):
    """bool [T, L]: may the query at each position see the key at each position.

    causal: key position <= query position. window W: query - key < W, and for a non-causal
    windowed layer also key - query < W. E.g. queries at [5, 6], keys at [3, 4, 5, 6], causal
    with W = 2: row 5 sees [4, 5]; row 6 sees [5, 6].
    """
    q = q_positions_T[:, None]
    k = k_positions_L[None, :]
    visible = jnp.ones((q_positions_T.shape[0], k_positions_L.shape[0]), dtype=bool)
    if rule.causal:
        visible &= k <= q
    if rule.window is not None:
        visible &= q - k < rule.window
        if not rule.causal:
            visible &= k - q < rule.window
    return visible

