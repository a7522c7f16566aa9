"""The training forward against the inference path, and its masks against the spec's rules."""

import numpy as np
import pytest
from flax import nnx

import dflash_jax
from conftest import randomize
from dflash_jax.config import LayerAttention, parse_config
from dflash_jax.models import Drafter, Target
from dflash_jax.train.forward import block_logits
from dflash_jax.train.masks import block_mask, context_mask

TARGET = dict(
    architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
)
DRAFTER = dict(
    architectures=["DFlashDraftModel"], vocab_size=64, hidden_size=32, intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    num_target_layers=4, dflash_config={"mask_token_id": 63, "target_layer_ids": [1, 2], "block_size": 4},
)


def tiny_pair(**drafter_overrides):
    target = randomize(Target(parse_config(TARGET), rngs=nnx.Rngs(0)), 1)
    drafter = randomize(Drafter(parse_config({**DRAFTER, **drafter_overrides}), rngs=nnx.Rngs(1)), 2)
    return target, drafter


def spec_mask(anchors, num_ctx, block_size, rule):
    """Dense [A*B, L + A*B] mask written straight from spec sections 2 and 7, loop by loop."""
    num_anchors = len(anchors)
    mask = np.zeros((num_anchors * block_size, num_ctx + num_anchors * block_size), bool)
    for a, p in enumerate(anchors):
        for j in range(block_size):
            row, q = a * block_size + j, p + j
            for s in range(num_ctx):
                mask[row, s] = s < p and (rule.window is None or s >= q - (rule.window - 1))
            for c in range(block_size):
                in_window = rule.window is None or abs(j - c) < rule.window
                mask[row, num_ctx + a * block_size + c] = (c <= j or not rule.causal) and in_window
    return mask


@pytest.mark.parametrize(
    "rule",
    [LayerAttention(causal=False), LayerAttention(causal=True), LayerAttention(causal=True, window=5),
     LayerAttention(causal=False, window=3)],
    ids=["full", "causal", "sliding-5", "swa-noncausal-3"],
)
def test_masks_match_spec(rule):
    anchors, num_ctx, block_size = np.array([0, 3, 9, 17, 6]), 20, 4
    ctx = np.asarray(context_mask(anchors, num_ctx, block_size, rule))
    blk = np.asarray(block_mask(block_size, rule))
    dense = np.zeros((len(anchors) * block_size, num_ctx + len(anchors) * block_size), bool)
    dense[:, :num_ctx] = ctx.reshape(-1, num_ctx)
    for a in range(len(anchors)):
        rows = slice(a * block_size, (a + 1) * block_size)
        dense[rows, num_ctx + a * block_size : num_ctx + (a + 1) * block_size] = blk
    np.testing.assert_array_equal(dense, spec_mask(anchors, num_ctx, block_size, rule))


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5, use_sliding_window=True)],
    ids=["full", "mixed-sliding"],
)
def test_training_forward_equals_inference_path(overrides):
    target, drafter = tiny_pair(**overrides)
    ids = np.random.default_rng(0).integers(0, 63, size=24)
    _, features = dflash_jax.target_forward(target, ids, layer_ids=drafter.cfg.target_layer_ids)
    anchors = np.array([0, 9, 23, 2])
    ours = np.asarray(block_logits(target, drafter, ids, features, anchors))
    assert ours.shape == (4, 3, 64)
    for a, p in enumerate(anchors):
        ref = dflash_jax.draft_logits(target, drafter, features[:p], [int(ids[p])] + [63] * 3)
        np.testing.assert_allclose(ours[a], ref, rtol=1e-5, atol=1e-5)
