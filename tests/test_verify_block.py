"""The verify block chosen by cost (dflash_jax/verify_block.py): the expected experts a step
touches, the tokens a cycle returns, and the default block: on a Qwen3-30B-A3B-shaped target
at batch 1 (a block of 16 touches ~10x the experts of one token) smaller than the trained one
where acceptance is low or the fixed costs small, the trained one at batch 32, with a drafter
that accepts nearly everything and on dense targets; `generate` and the Engine use it, and an
explicit block size overrides it."""

import numpy as np
import pytest

import dflash_jax
from bench.random_models import random_model
from bench.shapes import MODELS, SMALL_DRAFTER, SMALL_MOE
from dflash_jax.config import parse_config
from dflash_jax.requests import resolve_block_size
from dflash_jax.verify_block import (
    DEFAULT_ACCEPTANCE, Roofline, candidate_block_sizes, default_block_size, experts_touched, pass_cost,
    projected_speedup, tokens_per_cycle,
)

QWEN3_30B_A3B = parse_config(MODELS["qwen3-30b-a3b"].target)
QWEN3_8B = parse_config(MODELS["qwen3-8b"].target)


def test_experts_touched_grow_from_top_k_to_all():
    assert experts_touched(128, 8, 1) == pytest.approx(8)
    assert 70 < experts_touched(128, 8, 16) < 90  # a verify block of 16: most experts
    assert experts_touched(128, 8, 4096) == pytest.approx(128)
    rng = np.random.default_rng(0)  # against routing drawn at random
    drawn = np.mean([len({e for _ in range(16) for e in rng.permutation(128)[:8]}) for _ in range(200)])
    assert drawn == pytest.approx(experts_touched(128, 8, 16), rel=0.02)


def test_tokens_per_cycle():
    assert tokens_per_cycle(16, 1.0) == 16 and tokens_per_cycle(16, 0.0) == 1
    assert tokens_per_cycle(16, DEFAULT_ACCEPTANCE) == pytest.approx(6.5, abs=0.05)


def test_a_moe_pass_reads_more_experts_as_tokens_grow_a_dense_one_does_not():
    moe = [pass_cost(QWEN3_30B_A3B, n)["bytes"] for n in (1, 4, 16, 64)]
    assert moe == sorted(moe) and moe[2] > 4 * moe[0]
    dense = [pass_cost(QWEN3_8B, n)["bytes"] for n in (1, 16)]
    assert dense[0] == dense[1]
    assert pass_cost(QWEN3_8B, 512)["seconds"] > pass_cost(QWEN3_8B, 16)["seconds"]  # compute-bound at last


@pytest.mark.parametrize("shape", ["small-qwen3_5", "small-qwen3_5-moe", "small-moe"])
def test_a_pass_reads_the_weights_the_model_holds(shape):
    """At one token a pass reads every dense weight and top_k experts of each sparse layer:
    against the model's own parameters (embedding, norms, convolutions and decays aside)."""
    from flax import nnx

    from dflash_jax.models import abstract_model

    raw = MODELS["small-qwen3_5"].target if shape != "small-moe" else SMALL_MOE
    if shape == "small-qwen3_5-moe":
        raw = dict(raw, architectures=["Qwen3_5MoeForCausalLM"], num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=64, shared_expert_intermediate_size=96)
    cfg = parse_config(raw)
    _, state = nnx.split(abstract_model(cfg, np.float32))
    held = routed = 0
    for path, variable in nnx.to_flat_state(state):
        name = "/".join(map(str, path))
        if "embed_tokens" in name or "norm" in name or name.endswith(("conv1d_weight", "dt_bias", "A_log")):
            continue
        size = int(np.prod(variable.shape))
        routed += size if path[-1] in ("gate_up", "down") else 0  # the routed experts' stacked matrices
        held += size
    experts = cfg.experts
    if experts is not None:  # the pass reads top_k of every sparse layer's experts at one token
        held += routed * (experts_touched(experts.num_experts, experts.top_k, 1) / experts.num_experts - 1)
    assert pass_cost(cfg, 1, itemsize=1)["bytes"] == pytest.approx(held, rel=1e-3)


def test_an_8_bit_target_reads_its_decoder_weights_in_one_byte():
    import dataclasses

    from dflash_jax.quantization import WeightQuantization

    eight_bit = dataclasses.replace(QWEN3_30B_A3B, quantization=WeightQuantization("fp8", 128))
    head = QWEN3_30B_A3B.vocab_size * QWEN3_30B_A3B.hidden_size * 2
    for tokens in (1, 16):
        floats = pass_cost(QWEN3_30B_A3B, tokens)
        assert pass_cost(eight_bit, tokens)["bytes"] == pytest.approx(head + (floats["bytes"] - head) / 2)
        assert pass_cost(eight_bit, tokens)["flops"] == floats["flops"]


def test_default_block_follows_cost_acceptance_and_batch():
    assert candidate_block_sizes(16) == [4, 8, 16] and candidate_block_sizes(6) == [4, 6]
    low = default_block_size(QWEN3_30B_A3B, 16, batch=1, acceptance=0.73)
    assert low < 16
    assert projected_speedup(QWEN3_30B_A3B, low, 1, 0.73) > projected_speedup(QWEN3_30B_A3B, 16, 1, 0.73)
    # bandwidth alone (no fixed cost per sparse layer): the experts a block touches dominate
    assert default_block_size(QWEN3_30B_A3B, 16, batch=1, roofline=Roofline(sparse_layer_seconds=0)) < 16
    assert default_block_size(QWEN3_30B_A3B, 16, batch=32) == 16
    assert default_block_size(QWEN3_30B_A3B, 16, batch=1, acceptance=0.99) == 16
    assert default_block_size(QWEN3_8B, 16, batch=1, acceptance=0.5) == 16  # dense: the trained block


def test_resolve_block_size_defaults_by_cost_and_keeps_an_explicit_one():
    drafter = parse_config(MODELS["qwen3-30b-a3b"].drafter)
    trained, pallas = drafter.trained_block_size, dflash_jax.Kernels(experts="pallas")
    assert resolve_block_size(drafter, None) == trained
    assert resolve_block_size(drafter, None, QWEN3_30B_A3B, batch=1, kernels=pallas) == default_block_size(
        QWEN3_30B_A3B, trained, 1)
    # ragged_dot reads every expert whatever the block: the trained block
    reference = dflash_jax.Kernels(experts="reference")
    assert resolve_block_size(drafter, None, QWEN3_30B_A3B, batch=1, kernels=reference) == trained
    assert resolve_block_size(drafter, 16, QWEN3_30B_A3B, batch=1, kernels=pallas) == 16


def test_the_engine_and_generate_take_the_cost_models_block(monkeypatch):
    """The wiring: with the Pallas experts' product (interpret mode here), a MoE target's
    Engine and `generate` take `default_block_size`'s block (here made 4) for their batch
    unless one is given; with the reference product, the trained block."""
    target = random_model(SMALL_MOE, 0, "float32")
    drafter = random_model(SMALL_DRAFTER, 1, "float32")
    batches, pallas = [], dflash_jax.Kernels(experts="pallas")

    def chosen(cfg, trained, batch, **_):
        batches.append(batch)
        return 4

    monkeypatch.setattr(dflash_jax.requests, "default_block_size", chosen)
    assert dflash_jax.Engine(target, drafter, max_num_reqs=2, max_num_tokens=64, kernels=pallas).num_drafts == 3
    assert dflash_jax.Engine(target, drafter, max_num_reqs=2, max_num_tokens=64, kernels=pallas,
                             block_size=2).num_drafts == 1
    assert dflash_jax.Engine(target, drafter, max_num_reqs=2, max_num_tokens=64).num_drafts + 1 == 16
    prompts = [[5, 6, 7], [8, 9], [10]]
    out = dflash_jax.generate(target, drafter, prompts, max_new_tokens=6, kernels=pallas)
    assert batches == [2, 3]
    assert all(n <= 4 for lengths in out.accepted_lengths for n in lengths)
    ar = dflash_jax.generate_autoregressive(target, prompts, max_new_tokens=6, kernels=pallas)
    assert out.token_ids == ar.token_ids
