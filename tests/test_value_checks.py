"""Values the library refuses with a sentence (types and ranges), and sampling at any
temperature > 0."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import requests, sampling


def check(**overrides):
    kwargs = dict(prompt_len=3, max_new_tokens=4, max_model_len=64, temperature=0.0, top_k=0, top_p=1.0, seed=0)
    kwargs.update(overrides)
    requests.check_request(**kwargs)


@pytest.mark.parametrize("field, value, message", [
    ("max_new_tokens", 3.5, "max_new_tokens must be an integer"),
    ("max_new_tokens", True, "max_new_tokens must be an integer"),
    ("max_new_tokens", 0, "max_new_tokens must be at least 1"),
    ("temperature", float("inf"), "temperature must be >= 0 and finite"),
    ("temperature", float("nan"), "temperature must be >= 0 and finite"),
    ("temperature", True, "temperature must be a number"),
    ("temperature", "0.5", "temperature must be a number"),
    ("top_k", True, "top_k must be a number"),
    ("top_k", 2.0, "top_k must be a non-negative integer"),
    ("top_p", float("nan"), "top_p must lie in (0, 1]"),
    ("seed", 1.5, "seed must be an integer"),
    ("seed", True, "seed must be an integer"),
    ("seed", [1, True], "seed must be an integer"),
])
def test_check_request_refuses(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check(**{field: value})


def test_check_request_accepts_numpy_and_per_request_values():
    check(max_new_tokens=np.int64(4), temperature=np.array([0.0, 0.7]), top_k=np.array([0, 5]),
          top_p=np.array([1.0, 0.9]), seed=np.array([1, 2]))


@pytest.mark.parametrize("prompt, message", [
    ([1.0, 2.0], "holds 1.0, not an integer; token ids must be integers"),
    ([1, True], "holds True, not an integer"),
    (np.array([True, False]), "not an integer"),
    (np.array([1.5]), "holds 1.5, not an integer"),
    ("hello", "is text"),
    ([[1, 2], [3]], "not a flat list"),
    ([], "is empty"),
    ([1, 96], "outside the vocabulary"),
])
def test_check_prompt_refuses(prompt, message):
    with pytest.raises(ValueError, match=message):
        requests.check_prompt(prompt, 96)


def test_check_prompt_accepts_integers():
    assert requests.check_prompt([1, np.int64(2)], 96).dtype == np.int32
    assert requests.check_prompt(jnp.array([3, 4]), 96).tolist() == [3, 4]


@pytest.mark.parametrize("value, message", [
    (5, "must be a list of token ids"), ([1.0], "not an integer"), ([96], "outside the vocabulary"),
    ([False], "not an integer"),
])
def test_check_stop_token_ids(value, message):
    with pytest.raises(ValueError, match=message):
        requests.check_stop_token_ids(value, 96)
    assert requests.check_stop_token_ids((1, np.int32(2)), 96) == [1, 2]


def test_check_count():
    assert requests.check_count("page_size", 16) == 16
    for value, message in ((0, "must be at least 1"), (2.0, "must be an integer"), (True, "must be an integer")):
        with pytest.raises(ValueError, match=f"page_size {message}"):
            requests.check_count("page_size", value)


# --- tiny temperatures ----------------------------------------------------------------------

TINY = [1e-8, 1e-12, 1e-30, 1e-45]


def logits_and_argmax(rows=4, vocab=8, seed=0):
    logits = np.random.default_rng(seed).standard_normal((rows, vocab)).astype(np.float32) * 5
    return jnp.asarray(logits), np.argmax(logits, -1)


@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperature_is_the_argmax(temperature):
    """Dividing the logits by 1e-12 before the softmax overflowed to NaN (and token 0)."""
    logits_RV, argmax_R = logits_and_argmax()
    rows = logits_RV.shape[0]
    t_R, k_R, p_R = jnp.full((rows,), temperature), jnp.zeros((rows,), jnp.int32), jnp.ones((rows,))
    seeds_R, pos_R = jnp.arange(rows), jnp.zeros((rows,), jnp.int32)
    probs = jax.jit(sampling.processed_probs)(logits_RV, t_R, k_R, p_R)
    assert not np.isnan(np.asarray(probs)).any()
    np.testing.assert_array_equal(np.asarray(jax.jit(sampling.sample_target)(logits_RV, t_R, k_R, p_R, seeds_R, pos_R)),
                                  argmax_R)
    top_k_R = jnp.full((rows,), 3, jnp.int32)  # the truncating paths too
    np.testing.assert_array_equal(
        np.asarray(jax.jit(sampling.sample_target)(logits_RV, t_R, top_k_R, p_R * 0.9, seeds_R, pos_R)), argmax_R)

    drafts_RNV = jnp.stack([logits_RV, jnp.roll(logits_RV, 1, axis=-1)], axis=1)  # N = 2
    tokens_RN, q_RNV = jax.jit(sampling.sample_drafts)(drafts_RNV, t_R, k_R, p_R, seeds_R, pos_R)
    np.testing.assert_array_equal(np.asarray(tokens_RN), np.argmax(np.asarray(drafts_RNV), -1))
    assert not np.isnan(np.asarray(q_RNV)).any()

    # the target agrees with draft 0 and not draft 1: one accepted, then the target's argmax
    target_RSV = jnp.stack([logits_RV, logits_RV, logits_RV], axis=1)
    tokens_RS, accepted_R = jax.jit(sampling.rejection_sample)(
        target_RSV, tokens_RN, q_RNV, jnp.full((rows,), 2), t_R, k_R, p_R, seeds_R, pos_R)
    expect_accepted = 1 + (np.asarray(tokens_RN[:, 1]) == argmax_R)
    np.testing.assert_array_equal(np.asarray(accepted_R), expect_accepted)
    np.testing.assert_array_equal(np.asarray(tokens_RS)[np.arange(rows), expect_accepted], argmax_R)


# --- training that diverges ----------------------------------------------------------------


@pytest.mark.slow
def test_training_stops_on_a_non_finite_loss_and_keeps_only_finite_checkpoints(tmp_path):
    from test_train_forward import tiny_pair
    from test_train_loop import greedy_dataset

    from dflash_jax.train.step import Hyperparams
    from dflash_jax.train.trainer import NonFiniteLossError, train_drafter

    target, drafter = tiny_pair()
    dataset = greedy_dataset(tmp_path / "data.npz", target, num_prompts=4, new_tokens=8)
    with pytest.raises(ValueError, match="learning_rate is nan"):
        Hyperparams(total_steps=3, learning_rate=float("nan"))
    hp = Hyperparams(total_steps=4, max_anchors=4, learning_rate=1e38, grad_clip=1e38, warmup_ratio=0.0)
    with pytest.raises(NonFiniteLossError, match="training stopped and nothing was exported") as failure:
        train_drafter(target, drafter, dataset, hp, tmp_path / "run", batch_size=2, max_length=12,
                      checkpoint_every=1, progress=False)
    failed_at = int(re.search(r"(?:at|after) step (\d+)", str(failure.value)).group(1))
    saved = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert all(step < failed_at for step in saved)  # nothing from the diverged step on was saved
