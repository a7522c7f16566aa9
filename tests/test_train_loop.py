"""Training a tiny drafter on a tiny random target: loss falls, acceptance rises, resume is exact."""

import types

import jax
import numpy as np
import pytest
from flax import nnx

from dflash_jax.train.data import DrafterDataset, save_dataset
from dflash_jax.train.evaluate import mean_accepted_length, speculative_greedy
from dflash_jax.train.forward import target_logits_and_features
from dflash_jax.train.step import Hyperparams, drafter_params
from dflash_jax.train.trainer import train_drafter
from test_train_forward import tiny_pair


def dense_greedy(target, prompts, *, max_new_tokens, temperature=0.0, seed=0, **_):
    """Batched greedy (or sampled) decoding without a cache: a stand-in for the runtime's
    generate_autoregressive, returning an object with `token_ids` like its GenerateResult."""
    graphdef, state = nnx.split(target)
    forward = jax.jit(jax.vmap(lambda ids: target_logits_and_features(nnx.merge(graphdef, state), ids, ())[0]))
    lengths = np.array([len(p) for p in prompts])
    buffer = np.zeros((len(prompts), lengths.max() + max_new_tokens), np.int32)
    for row, prompt in enumerate(prompts):
        buffer[row, : len(prompt)] = prompt
    rng = np.random.default_rng(seed)
    rows = np.arange(len(prompts))
    for step in range(max_new_tokens):
        logits = np.asarray(forward(buffer))[rows, lengths + step - 1]
        if temperature > 0:
            gumbel = rng.gumbel(size=logits.shape)
            buffer[rows, lengths + step] = np.argmax(logits / temperature + gumbel, axis=-1)
        else:
            buffer[rows, lengths + step] = np.argmax(logits, axis=-1)
    return types.SimpleNamespace(token_ids=[buffer[r, lengths[r] :].tolist() for r in rows])


def greedy_dataset(path, target, num_prompts=48, prompt_len=6, new_tokens=40, seed=0):
    prompts = np.random.default_rng(seed).integers(0, 63, (num_prompts, prompt_len)).tolist()
    responses = dense_greedy(target, prompts, max_new_tokens=new_tokens).token_ids
    sequences = [(p + r, [False] * len(p) + [True] * len(r)) for p, r in zip(prompts, responses)]
    return DrafterDataset(save_dataset(path, sequences, {"source": "test greedy"}))


@pytest.mark.slow
def test_training_lowers_loss_and_raises_acceptance(tmp_path):
    target, drafter = tiny_pair()
    dataset = greedy_dataset(tmp_path / "data.npz", target, num_prompts=128)
    hp = Hyperparams(total_steps=300, learning_rate=3e-3, warmup_ratio=0.05, max_anchors=16)
    result = train_drafter(target, drafter, dataset, hp, tmp_path / "run", batch_size=8, max_length=48, progress=False)

    first, last = np.mean(result.losses[:20]), np.mean(result.losses[-20:])
    prompts = np.random.default_rng(1).integers(0, 63, (4, 6)).tolist()
    untrained = mean_accepted_length(target, drafter, prompts, 32)
    trained = mean_accepted_length(target, result.drafter, prompts, 32)
    print(f"loss {first:.3f} -> {last:.3f}; slot accuracy {result.accuracy}; tau {untrained:.3f} -> {trained:.3f}")
    assert last < 0.6 * first
    assert trained > untrained + 0.2
    # the evaluation loop is lossless: its output is the target's own greedy continuation
    tokens, _ = speculative_greedy(target, result.drafter, prompts[0], 32)
    assert tokens == dense_greedy(target, prompts[:1], max_new_tokens=32).token_ids[0]


class Interrupting:
    """A dataset that fails at one step, as a killed run would."""

    def __init__(self, dataset, fail_at):
        self.dataset, self.fail_at = dataset, fail_at

    def batch(self, step, *args):
        if step == self.fail_at:
            raise KeyboardInterrupt
        return self.dataset.batch(step, *args)


@pytest.mark.slow
def test_resume_matches_unbroken_run(tmp_path):
    target, drafter = tiny_pair()
    dataset = greedy_dataset(tmp_path / "data.npz", target, num_prompts=8, new_tokens=12)
    hp = Hyperparams(total_steps=6, max_anchors=8, compute_dtype="float32")
    run = dict(batch_size=4, max_length=16, checkpoint_every=2, progress=False)
    unbroken = train_drafter(target, drafter, dataset, hp, tmp_path / "a", **run)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(target, drafter, Interrupting(dataset, fail_at=3), hp, tmp_path / "b", **run)
    resumed = train_drafter(target, drafter, dataset, hp, tmp_path / "b", **run)
    assert len(resumed.losses) == 4  # steps 2..5 after the checkpoint at 2
    np.testing.assert_allclose(resumed.losses, unbroken.losses[2:], rtol=1e-5)
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7),
        drafter_params(resumed.drafter), drafter_params(unbroken.drafter),
    )


@pytest.mark.slow
def test_time_budget_checkpoints_and_stops(tmp_path):
    target, drafter = tiny_pair()
    dataset = greedy_dataset(tmp_path / "data.npz", target, num_prompts=8, new_tokens=12)
    hp = Hyperparams(total_steps=5, max_anchors=8, compute_dtype="float32")
    run = dict(batch_size=4, max_length=16, checkpoint_every=100, progress=False)
    cut = train_drafter(target, drafter, dataset, hp, tmp_path / "run", time_budget_s=0.0, **run)
    assert cut.steps_done == 1 and len(cut.losses) == 1  # one step, then out of time
    rest = train_drafter(target, drafter, dataset, hp, tmp_path / "run", **run)
    assert rest.steps_done == 5 and len(rest.losses) == 4  # resumed from the step-1 checkpoint
