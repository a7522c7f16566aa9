"""Decayed, masked cross-entropy over block slots, and per-slot accuracy (spec section 7).

Slot k (1..B-1) of the block anchored at p predicts x_{p+k}; it counts only where the loss
mask is on at p+k (a response token inside the sequence). Later slots weigh less,
w_k = exp(-(k-1)/gamma), because a draft is only as useful as its accepted prefix.

Soft labels (optional): the target's own distribution for x_{p+k}, its softmax at row p+k-1,
computed in the same step. Mixed into the hard labels with weight `soft_weight`, they tell the
drafter how the target ranks every token, not only which one it emitted (distillation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def default_gamma(block_size: int) -> float:
    """gamma 7 for B=16 and 4 for B=8 (the published recipes); B/2 otherwise, at least 1."""
    return {16: 7.0, 8: 4.0}.get(block_size, max(block_size / 2, 1.0))


def slot_weights(block_size: int, gamma: float):
    """float32 [B-1]: w_k = exp(-(k-1)/gamma) for k = 1..B-1."""
    return jnp.exp(-jnp.arange(block_size - 1, dtype=jnp.float32) / gamma)


def block_targets(token_ids_L, loss_mask_L, anchors_A, valid_A, block_size: int):
    """(labels int32 [A, B-1], counted bool [A, B-1]): x_{p+k} and whether slot k counts."""
    num_ctx = token_ids_L.shape[0]
    positions_AN = anchors_A[:, None] + jnp.arange(1, block_size, dtype=jnp.int32)
    inside_AN = positions_AN < num_ctx
    positions_AN = jnp.minimum(positions_AN, num_ctx - 1)
    counted_AN = valid_A[:, None] & inside_AN & loss_mask_L[positions_AN]
    return token_ids_L[positions_AN], counted_AN


def block_soft_labels(target_logits_LV, anchors_A, block_size: int):
    """float32 [A, B-1, V]: the target's next-token distribution for x_{p+k} (its row p+k-1)."""
    rows_AN = anchors_A[:, None] + jnp.arange(block_size - 1, dtype=jnp.int32)
    rows_AN = jnp.minimum(rows_AN, target_logits_LV.shape[0] - 1)  # past the end: not counted
    return jax.nn.softmax(target_logits_LV[rows_AN].astype(jnp.float32), axis=-1)


def block_loss_terms(logits_ANV, labels_AN, counted_AN, weights_N, soft_labels_ANV=None, soft_weight: float = 0.0):
    """Per-sequence sums: (weighted CE, weight, correct per slot [N], counted per slot [N]).

    Sums, not means, so a batch normalises once by its total weight. With soft labels the CE
    per slot is (1 - soft_weight) * CE(hard label) + soft_weight * CE(soft labels).
    """
    log_probs_ANV = jax.nn.log_softmax(logits_ANV, axis=-1)
    ce_AN = -jnp.take_along_axis(log_probs_ANV, labels_AN[..., None], -1)[..., 0]
    if soft_labels_ANV is not None:
        soft_ce_AN = -jnp.sum(soft_labels_ANV * log_probs_ANV, axis=-1)
        ce_AN = (1.0 - soft_weight) * ce_AN + soft_weight * soft_ce_AN
    w_AN = jnp.where(counted_AN, weights_N[None, :], 0.0)
    correct_AN = (jnp.argmax(logits_ANV, axis=-1) == labels_AN) & counted_AN
    return (
        jnp.sum(w_AN * ce_AN),
        jnp.sum(w_AN),
        jnp.sum(correct_AN, axis=0).astype(jnp.float32),
        jnp.sum(counted_AN, axis=0).astype(jnp.float32),
    )


def selector_loss_terms(selector, hidden_AND, logits_ANV, labels_AN, counted_AN, anchor_tokens_A, weights_N):
    """DFlash 2's candidate selector, teacher-forced: per-sequence sums (weighted CE, weight,
    correct per slot [N], counted per slot [N]).

    At slot k the selector scores the drafter's top-K candidates with the true previous token
    (the anchor's for slot 1) as predecessor; the CE is over those K scores with the true
    token as label, so a slot counts only where the true token is among the candidates. The
    candidates' choice carries no gradient; their scores (logit + pairing) do.
    """
    unary_ANK, candidates_ANK = selector.candidates(logits_ANV)
    candidates_ANK = jax.lax.stop_gradient(candidates_ANK)
    previous_AN = jnp.concatenate([anchor_tokens_A[:, None], labels_AN[:, :-1]], axis=1)
    scores_ANK = selector.scores(selector.hidden_projection(hidden_AND), previous_AN, unary_ANK, candidates_ANK)
    hit_ANK = candidates_ANK == labels_AN[..., None]
    counted_AN = counted_AN & jnp.any(hit_ANK, axis=-1)
    label_AN = jnp.argmax(hit_ANK, axis=-1)
    return block_loss_terms(scores_ANK, label_AN, counted_AN, weights_N)
