"""The block loss: hard labels, soft labels (the target's distribution) and their mix."""

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.train.loss import block_loss_terms, block_soft_labels, slot_weights


def _case(seed=0, anchors=3, slots=4, vocab=11):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(anchors, slots, vocab)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, vocab, (anchors, slots)), jnp.int32)
    counted = jnp.asarray(rng.random((anchors, slots)) < 0.8)
    return logits, labels, counted, slot_weights(slots + 1, 2.0)


def test_one_hot_soft_labels_equal_hard_labels():
    logits, labels, counted, weights = _case()
    hard = block_loss_terms(logits, labels, counted, weights)
    soft = block_loss_terms(logits, labels, counted, weights, jax.nn.one_hot(labels, logits.shape[-1]), 1.0)
    for a, b in zip(hard, soft):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_mixed_loss_matches_numpy():
    logits, labels, counted, weights = _case(seed=1)
    soft = jax.nn.softmax(jnp.asarray(np.random.default_rng(2).normal(size=logits.shape), jnp.float32), -1)
    ce, weight, _, _ = block_loss_terms(logits, labels, counted, weights, soft, 0.25)
    log_p = np.asarray(jax.nn.log_softmax(logits, -1), np.float64)
    hard_ce = -np.take_along_axis(log_p, np.asarray(labels)[..., None], -1)[..., 0]
    soft_ce = -(np.asarray(soft, np.float64) * log_p).sum(-1)
    w = np.where(np.asarray(counted), np.asarray(weights)[None], 0.0)
    np.testing.assert_allclose(ce, (w * (0.75 * hard_ce + 0.25 * soft_ce)).sum(), rtol=1e-5)
    np.testing.assert_allclose(weight, w.sum(), rtol=1e-6)


def test_soft_labels_are_the_targets_row_before_each_slot():
    target_logits = jnp.asarray(np.random.default_rng(3).normal(size=(10, 7)), jnp.float32)
    soft = block_soft_labels(target_logits, jnp.array([2, 8], jnp.int32), block_size=4)
    assert soft.shape == (2, 3, 7)
    # slot k of the block at p predicts x_{p+k}: the target's row p+k-1 (clamped past the end)
    np.testing.assert_allclose(soft[0, 0], jax.nn.softmax(target_logits[2]), rtol=1e-6)
    np.testing.assert_allclose(soft[0, 2], jax.nn.softmax(target_logits[4]), rtol=1e-6)
    np.testing.assert_allclose(soft[1, 2], jax.nn.softmax(target_logits[9]), rtol=1e-6)
