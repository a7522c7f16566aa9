"""The verify block chosen by cost (dflash_jax/verify_block.py): the expected experts a step
touches, the tokens a cycle returns, and the default block: smaller than the trained one for a
Qwen3-30B-A3B-shaped target at batch 1 (a block of 16 touches ~10x the experts of one token),
the trained one at batch 32 and on dense targets; `generate`, the Engine and `--block-size`
use it, and an explicit block size overrides it."""

import numpy as np
import pytest

import dflash_jax
from bench.random_models import random_model
from bench.shapes import MODELS, SMALL_DRAFTER, SMALL_MOE
from dflash_jax.config import parse_config
from dflash_jax.requests import resolve_block_size
from dflash_jax.verify_block import (
    DEFAULT_ACCEPTANCE, candidate_block_sizes, default_block_size, experts_touched, pass_cost, projected_speedup, tokens_per_cycle,
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


def test_default_block_follows_cost_and_batch():
    assert candidate_block_sizes(16) == [4, 8, 16] and candidate_block_sizes(6) == [4, 6]
    at_one = default_block_size(QWEN3_30B_A3B, 16, batch=1)
    assert at_one < 16
    assert projected_speedup(QWEN3_30B_A3B, at_one, 1) > projected_speedup(QWEN3_30B_A3B, 16, 1)
    assert default_block_size(QWEN3_30B_A3B, 16, batch=32) == 16
    assert default_block_size(QWEN3_8B, 16, batch=1) == 16
    # a drafter that accepts nearly everything makes long blocks worth their experts
    assert default_block_size(QWEN3_30B_A3B, 16, batch=1, acceptance=0.99) == 16


def test_resolve_block_size_defaults_by_cost_and_keeps_an_explicit_one():
    drafter = parse_config(MODELS["qwen3-30b-a3b"].drafter)
    assert resolve_block_size(drafter, None) == drafter.trained_block_size
    assert resolve_block_size(drafter, None, QWEN3_30B_A3B, batch=1) == default_block_size(
        QWEN3_30B_A3B, drafter.trained_block_size, 1)
    assert resolve_block_size(drafter, 16, QWEN3_30B_A3B, batch=1) == 16


def test_the_engine_and_generate_take_the_cost_models_block():
    """A small target whose experts outweigh the rest (64 of them, top 2): at batch 2 a block
    of 16 would touch ~40 experts a layer where a decode step touches 4."""
    target = random_model(dict(SMALL_MOE, num_experts=64, num_experts_per_tok=2, moe_intermediate_size=256), 0,
                          "float32")
    drafter = random_model(SMALL_DRAFTER, 1, "float32")
    chosen = default_block_size(target.cfg, drafter.cfg.trained_block_size, batch=2)
    assert chosen < drafter.cfg.trained_block_size
    engine = dflash_jax.Engine(target, drafter, max_num_reqs=2, max_num_tokens=64)
    assert engine.num_drafts + 1 == chosen
    assert dflash_jax.Engine(target, drafter, max_num_reqs=2, max_num_tokens=64, block_size=2).num_drafts == 1
    prompts = [[5, 6, 7], [8, 9]]
    out = dflash_jax.generate(target, drafter, prompts, max_new_tokens=6)
    assert all(n <= chosen for lengths in out.accepted_lengths for n in lengths)
    assert out.token_ids == dflash_jax.generate_autoregressive(target, prompts, max_new_tokens=6).token_ids
