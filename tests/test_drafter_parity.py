"""draft_logits against the z-lab reference DFlashDraftModel (dflash 0.1.0), float32."""

import numpy as np
import pytest
import torch

import dflash_jax
from conftest import drafter_config_dict, make_hf_target, make_zlab_drafter, rel_err, save_hf

CASES = {
    "full-noncausal": {},
    "explicit-ids-3-layers": dict(num_hidden_layers=3, dflash_config={"mask_token_id": 95, "block_size": 8, "target_layer_ids": [4, 1, 2]}),
    "mixed-sliding-window-shorter-than-context": dict(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=7,
        use_sliding_window=True,
    ),
    "attention-bias-mha": dict(attention_bias=True, num_key_value_heads=4, head_dim=24),
    "is-causal-override": dict(is_causal=True),
    # as z-lab publishes its gpt-oss drafters: model_type gpt_oss, q/k/v/o biases (no sinks),
    # head_dim unlike hidden / heads, YaRN RoPE at gpt-oss's theta
    "gpt-oss-published": dict(model_type="gpt_oss", attention_bias=True, head_dim=24, rope_theta=150000.0,
                              rope_scaling={"rope_type": "yarn", "factor": 32.0,
                                            "original_max_position_embeddings": 8}),
    "gemma-scalars": dict(
        dflash_config={
            "mask_token_id": 95,
            "block_size": 8,
            "input_embedding_scale": 8.0,
            "output_multiplier": 0.5,
            "final_logit_softcapping": 3.0,
        }
    ),
}


def reference_draft_logits(hf_target, zlab, features, block):
    """The z-lab model's own forward and compute_logits, no cache: positions 0..S+B-1."""
    from dflash.model import _draft_value

    num_ctx = features.shape[0]
    scale = float(_draft_value(zlab.config, "input_embedding_scale", 1.0))
    with torch.no_grad():
        noise = hf_target.model.embed_tokens(torch.tensor(block))[None] * scale
        hidden = zlab(
            target_hidden=torch.tensor(np.asarray(features))[None],
            noise_embedding=noise,
            position_ids=torch.arange(num_ctx + len(block))[None],
        )
        return zlab.compute_logits(hidden[:, 1:], hf_target.lm_head)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_draft_logits_match_zlab_reference(tmp_path, case):
    hf_target = make_hf_target("qwen3", num_hidden_layers=6)
    config = drafter_config_dict(hf_target.config.to_dict(), **CASES[case])
    zlab = make_zlab_drafter(config, seed=1)
    target = dflash_jax.load_target(save_hf(hf_target, tmp_path / "target"))
    drafter = dflash_jax.load_drafter(save_hf(zlab, tmp_path / "drafter", config))
    assert list(drafter.cfg.target_layer_ids) == list(zlab.target_layer_ids)

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 95, size=21)
    _, features = dflash_jax.target_forward(target, prompt, layer_ids=drafter.cfg.target_layer_ids)
    block = [int(prompt[-1])] + [drafter.cfg.mask_token_id] * 7
    ours = dflash_jax.draft_logits(target, drafter, features, block)
    ref = reference_draft_logits(hf_target, zlab, features, block)
    assert ours.dtype == np.float32 and ours.shape == (7, 96)
    assert rel_err(ours, ref) <= 1e-4


def test_draft_logits_rejects_mismatched_features(tmp_path):
    hf_target = make_hf_target("qwen3", num_hidden_layers=6)
    config = drafter_config_dict(hf_target.config.to_dict())
    target = dflash_jax.load_target(save_hf(hf_target, tmp_path / "target"))
    drafter = dflash_jax.load_drafter(save_hf(make_zlab_drafter(config), tmp_path / "drafter", config))
    with pytest.raises(ValueError, match="features must be"):
        dflash_jax.draft_logits(target, drafter, np.zeros((5, 64), np.float32), [1, 95])
    with pytest.raises(ValueError, match="at least 2 slots"):
        dflash_jax.draft_logits(target, drafter, np.zeros((5, 128), np.float32), [1])


def test_drafter_for_another_target_is_refused(tmp_path):
    small_target = make_hf_target("qwen3", num_hidden_layers=2)
    config = drafter_config_dict(make_hf_target("qwen3", num_hidden_layers=6).config.to_dict())
    target = dflash_jax.load_target(save_hf(small_target, tmp_path / "target"))
    drafter = dflash_jax.load_drafter(save_hf(make_zlab_drafter(config), tmp_path / "drafter", config))
    with pytest.raises(ValueError, match="target has 2 layers"):
        dflash_jax.draft_logits(target, drafter, np.zeros((5, 128), np.float32), [1, 95])
