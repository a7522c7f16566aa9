"""target_forward against transformers' Qwen3ForCausalLM / LlamaForCausalLM, float32."""

import numpy as np
import pytest
import torch

import dflash_jax
from conftest import make_hf_target, rel_err, save_hf

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES = {
    "qwen3-gqa2": ("qwen3", {}),
    "qwen3-mha-tied": ("qwen3", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen3-headdim-ne-hidden/heads-bias": ("qwen3", dict(head_dim=24, attention_bias=True)),
    "qwen3-mqa": ("qwen3", dict(num_attention_heads=8, num_key_value_heads=1, head_dim=8)),
    "llama-tied-llama3-rope": ("llama", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "llama-gqa4-bias": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, attention_bias=True, mlp_bias=True)),
    "llama-yarn": ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64})),
}


@pytest.mark.parametrize("case", list(CASES))
def test_target_forward_matches_transformers(tmp_path, case):
    kind, overrides = CASES[case]
    hf_model = make_hf_target(kind, seed=len(case), **overrides)
    path = save_hf(hf_model, tmp_path / "hf")
    target = dflash_jax.load_target(path)

    rng = np.random.default_rng(0)
    ids = rng.integers(0, hf_model.config.vocab_size, size=50)
    layer_ids = (2, 0, 3)  # HF's last entry (layer 3's) is final-normed: so is ours, as z-lab's drafters read it
    logits, features = dflash_jax.target_forward(target, ids, layer_ids=layer_ids)

    with torch.no_grad():
        out = hf_model(torch.tensor(ids)[None], output_hidden_states=True)
    ref_features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)[0]
    assert logits.dtype == np.float32 and logits.shape == (50, hf_model.config.vocab_size)
    assert features.shape == (50, len(layer_ids) * hf_model.config.hidden_size)
    assert rel_err(logits, out.logits[0]) <= 1e-4
    assert rel_err(features, ref_features) <= 1e-4


def test_no_layer_ids_gives_empty_features(tmp_path):
    target = dflash_jax.load_target(save_hf(make_hf_target("qwen3"), tmp_path / "hf"))
    logits, features = dflash_jax.target_forward(target, [1, 2, 3])
    assert logits.shape == (3, 96) and features.shape == (3, 0)


@pytest.mark.parametrize(
    "ids, layer_ids, message",
    [
        ([], (), "non-empty"),
        ([[1, 2]], (), "1-D"),
        ([1, 96], (), "outside the vocabulary"),
        ([1, 2], (4,), "layer_ids"),
    ],
)
def test_target_forward_rejects_bad_input(tmp_path, ids, layer_ids, message):
    target = dflash_jax.load_target(save_hf(make_hf_target("qwen3"), tmp_path / "hf"))
    with pytest.raises(ValueError, match=message):
        dflash_jax.target_forward(target, ids, layer_ids=layer_ids)
