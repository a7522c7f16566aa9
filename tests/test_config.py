"""Config parsing: every drafter field of spec section 3, and one-sentence refusals."""

import pytest

from dflash_jax.config import (
    ConfigError,
    LayerAttention,
    check_drafter_fits_target,
    default_target_layer_ids,
    parse_config,
    parse_target_config,
)

QWEN3_8B_DRAFTER = dict(
    architectures=["DFlashDraftModel"],
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    num_target_layers=36,
    block_size=16,
    dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
)
TARGET = dict(
    architectures=["Qwen3ForCausalLM"],
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)


def drafter(**changes):
    raw = {**QWEN3_8B_DRAFTER, "dflash_config": dict(QWEN3_8B_DRAFTER["dflash_config"])}
    for key, value in changes.items():
        if key.startswith("dflash_"):
            raw["dflash_config"][key.removeprefix("dflash_")] = value
        elif value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    return parse_config(raw)


def test_published_qwen3_8b_drafter():
    cfg = drafter()
    assert cfg.trained_block_size == 16 and cfg.mask_token_id == 151669
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.fc_in_features == 5 * 4096
    assert cfg.rope.theta == 1e6 and cfg.rope.rope_type == "default"
    assert cfg.layers == (LayerAttention(causal=False),) * 5
    check_drafter_fits_target(parse_target_config(TARGET), cfg)


def test_default_layer_ids_follow_the_spec():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(36, 1) == (18,)
    raw = dict(QWEN3_8B_DRAFTER, dflash_config={"mask_token_id": 151669})
    assert parse_config(raw).target_layer_ids == (1, 9, 17, 25, 33)


def test_block_size_nested_wins_and_mask_token_at_top_level():
    assert drafter(dflash_block_size=8).trained_block_size == 8
    raw = dict(QWEN3_8B_DRAFTER, mask_token_id=7, dflash_config={"target_layer_ids": [1]})
    assert parse_config(raw).mask_token_id == 7
    assert parse_config(raw).target_layer_ids == (1,)


def test_rope_parameters_or_rope_theta():
    cfg = drafter(rope_theta=None, rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0})
    assert cfg.rope.theta == 5e5 and cfg.rope.rope_type == "yarn" and cfg.rope.get("factor") == 4.0
    assert cfg.rope.get("original_max_position_embeddings") == 40960


def test_layer_types_and_causality_overrides():
    mixed = dict(layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048)
    cfg = drafter(**mixed)
    assert cfg.layers[0] == LayerAttention(causal=True, window=2048)
    assert cfg.layers[4] == LayerAttention(causal=False)
    assert all(layer.causal for layer in drafter(**mixed, is_causal=True).layers)
    assert not any(layer.causal for layer in drafter(**mixed, dflash_causal=False).layers)
    assert all(layer.causal for layer in drafter(**mixed, is_causal=True, dflash_causal=False).layers)
    swa = drafter(dflash_use_swa=True, dflash_swa_window_size=512).layers
    assert swa == (LayerAttention(causal=False, window=512),) * 5


def test_attention_bias_and_gemma_scalars():
    cfg = drafter(attention_bias=True, dflash_output_multiplier=0.5, dflash_final_logit_softcapping=30.0)
    assert cfg.attention_bias and cfg.output_multiplier == 0.5 and cfg.final_logit_softcapping == 30.0


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(architectures=["DFlash2DraftModel"]), "a DFlash2DraftModel needs dflash_config.conv_kernel_size"),
        (dict(architectures=["GPT2LMHeadModel"]), "unsupported target architecture 'GPT2LMHeadModel'"),
        (dict(dflash_sample_from_anchor=True), "sample_from_anchor=true is the DSpark variant"),
        (dict(dflash_attention_sink_bias=True), "this drafter has attention sinks"),
        (dict(add_swa_attention_sink_bias=True), "this drafter has attention sinks"),
        (dict(dflash_mask_token_id=None), "no mask_token_id"),
        (dict(dflash_mask_token_id=200000), "mask_token_id 200000 is outside the vocabulary"),
        (dict(layer_types=["sliding_attention"] * 5), "sliding_window must be a positive integer"),
        (dict(layer_types=["full_attention"]), "layer_types has 1 entries for 5 layers"),
        (dict(rope_theta=None, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "RoPE type 'longrope'"),
        (dict(num_hidden_layers=None), "no 'num_hidden_layers'"),
    ],
)
def test_refusals(changes, message):
    with pytest.raises(ConfigError, match=message):
        drafter(**changes)


def test_drafter_target_mismatch_is_refused():
    small = parse_target_config({**TARGET, "num_hidden_layers": 28})
    with pytest.raises(ConfigError, match=r"reads target layers \[33\], but the target has 28"):
        check_drafter_fits_target(small, drafter())
    narrow = parse_target_config({**TARGET, "hidden_size": 2560})
    with pytest.raises(ConfigError, match="fc takes 20480 inputs = 5 layers x 4096"):
        check_drafter_fits_target(narrow, drafter())


def test_qwen3_sliding_window_target_is_refused():
    with pytest.raises(ConfigError, match="use_sliding_window=true"):
        parse_target_config({**TARGET, "use_sliding_window": True})
