"""Drafters in the speculators format (what vLLM reads), float32 on CPU: a z-lab checkpoint
rewritten in that layout (nested `transformer_layer_config`, `aux_hidden_state_layer_ids` one
above z-lab's ids, its own copies of the target's tables, DFlash 2's fields at the top level)
drafts exactly as the z-lab original; a reduced draft vocabulary (d2t) drafts the original's
logits at its tokens and nothing else, decoding stays the target's; malformed checkpoints are
refused with the reason."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import dflash_jax
from conftest import drafter_config_dict, make_hf_target, make_zlab_drafter, save_hf
from dflash_jax.config import ConfigError, parse_config
from dflash_jax.formats.export_hf import export_hf
from dflash_jax.formats.hf_to_nnx import ConversionError
from test_dflash2 import dflash2_config, make_zlab_dflash2, save_as_published

ZLAB_ONLY = ("architectures", "dflash_config", "num_target_layers", "block_size", "auto_map")


def speculators_config(zlab_config: dict, *, draft_vocab_size=None) -> dict:
    """`zlab_config` as speculators writes it (DFlash or DFlash 2 by its architecture)."""
    dflash = zlab_config["dflash_config"]
    dflash2 = zlab_config["architectures"] == ["DFlash2DraftModel"]
    layers = {k: v for k, v in zlab_config.items() if k not in ZLAB_ONLY}
    config = {
        "speculators_model_type": "dflash2" if dflash2 else "dflash",
        "architectures": ["DFlash2DraftModel" if dflash2 else "DFlashSpeculator"],
        "transformer_layer_config": {**layers, "model_type": "qwen3"},
        "aux_hidden_state_layer_ids": [i + 1 for i in parse_config(zlab_config).target_layer_ids],
        "mask_token_id": dflash["mask_token_id"],
        "block_size": dflash["block_size"],
        "draft_vocab_size": draft_vocab_size or zlab_config["vocab_size"],
        "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy",
                                                     "speculative_tokens": dflash["block_size"] - 1}],
                               "verifier": {"name_or_path": "tiny", "architectures": ["Qwen3ForCausalLM"]}},
    }
    if dflash2:
        config.update({k: dflash[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                              "selector_top_k")})
    return config


def as_speculators(zlab_dir, out, hf_target, zlab_config: dict, draft_ids=None):
    """The z-lab checkpoint in `zlab_dir` rewritten to `out` in the speculators layout: the same
    body tensors plus the target's embedding and head (the head's rows at `draft_ids` and
    d2t/t2d when the draft vocabulary is reduced to those ids)."""
    out.mkdir()
    tensors = load_file(f"{zlab_dir}/model.safetensors")
    head = hf_target.lm_head.weight.detach()
    tensors["embed_tokens.weight"] = hf_target.model.embed_tokens.weight.detach().clone()
    tensors["lm_head.weight"] = head.clone() if draft_ids is None else head[draft_ids].clone()
    if draft_ids is not None:
        tensors["d2t"] = torch.tensor(draft_ids) - torch.arange(len(draft_ids))
        t2d = torch.zeros(head.shape[0], dtype=torch.bool)
        t2d[draft_ids] = True
        tensors["t2d"] = t2d
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = speculators_config(zlab_config, draft_vocab_size=None if draft_ids is None else len(draft_ids))
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def dflash1(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("speculators")
    hf = make_hf_target("qwen3", num_hidden_layers=6)
    config = drafter_config_dict(hf.config.to_dict(), dflash_config={"mask_token_id": 95, "block_size": 8,
                                                                    "target_layer_ids": [1, 3, 4]})
    zlab = make_zlab_drafter(config, seed=2)
    zlab_dir = save_hf(zlab, tmp / "zlab", config)
    return tmp, hf, config, zlab_dir, dflash_jax.load_target(save_hf(hf, tmp / "target"))


def test_dflash1_speculators_checkpoint_drafts_as_its_zlab_original(dflash1):
    tmp, hf, config, zlab_dir, target = dflash1
    ours = dflash_jax.load_drafter(as_speculators(zlab_dir, tmp / "full", hf, config))
    original = dflash_jax.load_drafter(zlab_dir)
    # target layers [1, 3, 4] read back from aux ids [2, 4, 5]; the target's depth is not in the format
    assert ours.cfg == dataclasses.replace(original.cfg, num_target_layers=None)
    prompt = np.random.default_rng(0).integers(0, 95, 12)
    _, features = dflash_jax.target_forward(target, prompt, layer_ids=ours.cfg.target_layer_ids)
    block = [int(prompt[-1])] + [95] * 7
    np.testing.assert_array_equal(dflash_jax.draft_logits(target, ours, features, block),
                                  dflash_jax.draft_logits(target, original, features, block))


def test_reduced_vocabulary_drafts_only_its_tokens_and_decodes_the_targets_tokens(dflash1, tmp_path, monkeypatch):
    tmp, hf, config, zlab_dir, target = dflash1
    draft_ids = sorted(np.random.default_rng(1).choice(95, 40, replace=False).tolist())
    reduced = dflash_jax.load_drafter(as_speculators(zlab_dir, tmp_path / "d2t", hf, config, draft_ids))
    original = dflash_jax.load_drafter(zlab_dir)
    assert reduced.cfg.draft_vocab_size == 40 and reduced.cfg.vocab_size == 96
    prompt = np.random.default_rng(2).integers(0, 95, 10)
    _, features = dflash_jax.target_forward(target, prompt, layer_ids=reduced.cfg.target_layer_ids)
    block = [int(prompt[-1])] + [95] * 7
    logits = np.asarray(dflash_jax.draft_logits(target, reduced, features, block))
    full = np.asarray(dflash_jax.draft_logits(target, original, features, block))
    outside = np.setdiff1d(np.arange(96), draft_ids)
    np.testing.assert_allclose(logits[:, draft_ids], full[:, draft_ids], rtol=1e-5, atol=1e-5)
    assert np.isneginf(logits[:, outside]).all()

    prompts = [[5, 17, 33, 2], [40, 41, 9]]
    ar = dflash_jax.generate_autoregressive(target, prompts, max_new_tokens=12)
    assert dflash_jax.generate(target, reduced, prompts, max_new_tokens=12).token_ids == ar.token_ids
    sampled = dflash_jax.generate(target, reduced, prompts, max_new_tokens=12, temperature=1.0, seed=[3, 4])
    assert all(0 <= t < 96 for tokens in sampled.token_ids for t in tokens)

    converted = tmp_path / "converted"
    assert dflash_jax.cli.main(["convert", str(tmp_path / "d2t"), str(converted)]) == 0
    again = dflash_jax.load_drafter(converted)
    assert again.cfg == reduced.cfg
    np.testing.assert_array_equal(np.asarray(again.draft_to_target[...]), draft_ids)
    with pytest.raises(ValueError, match="reduced vocabulary"):
        export_hf(reduced, tmp_path / "exported")
    # a soft cap bounds the draft vocabulary's logits and leaves the others at -inf (q zero there)
    monkeypatch.setattr(reduced, "cfg", dataclasses.replace(reduced.cfg, final_logit_softcapping=5.0))
    capped = np.asarray(dflash_jax.draft_logits(target, reduced, features, block))
    assert np.isneginf(capped[:, outside]).all() and np.isfinite(capped[:, draft_ids]).all()
    np.testing.assert_allclose(capped[:, draft_ids], 5.0 * np.tanh(logits[:, draft_ids] / 5.0), rtol=1e-5, atol=1e-5)


def test_dflash2_speculators_checkpoint_drafts_as_its_zlab_original(tmp_path):
    hf = make_hf_target("qwen3", num_hidden_layers=6)
    config = dflash2_config(hf.config.to_dict())
    zlab_dir = save_as_published(make_zlab_dflash2(config, seed=3), tmp_path / "zlab", config)
    target = dflash_jax.load_target(save_hf(hf, tmp_path / "target"))
    ours = dflash_jax.load_drafter(as_speculators(zlab_dir, tmp_path / "speculators", hf, config))
    original = dflash_jax.load_drafter(zlab_dir)
    assert ours.cfg == dataclasses.replace(original.cfg, num_target_layers=None) and ours.cfg.dflash2 is not None
    features = np.random.default_rng(4).normal(size=(7, ours.cfg.fc_in_features)).astype(np.float32)
    block = [3] + [ours.cfg.mask_token_id] * 7
    for mine, theirs in zip(dflash_jax.draft_path(target, ours, features, block),
                            dflash_jax.draft_path(target, original, features, block)):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))


def test_malformed_speculators_checkpoints_are_refused(dflash1, tmp_path):
    tmp, hf, config, zlab_dir, _ = dflash1
    spec = speculators_config(config)
    with pytest.raises(ConfigError, match="not a DFlash drafter"):
        parse_config({**spec, "speculators_model_type": "eagle3"})
    with pytest.raises(ConfigError, match="aux_hidden_state_layer_ids"):
        parse_config({**spec, "aux_hidden_state_layer_ids": [0, 2]})
    with pytest.raises(ConfigError, match="mask_token_id"):
        parse_config({k: v for k, v in spec.items() if k != "mask_token_id"})
    dflash2 = speculators_config(dflash2_config(hf.config.to_dict()))
    with pytest.raises(ConfigError, match="DFlash 2 keeps the full vocabulary"):
        parse_config({**dflash2, "draft_vocab_size": 32})
    folder = as_speculators(zlab_dir, tmp_path / "bad", hf, config, list(range(0, 80, 2)))
    tensors = load_file(folder / "model.safetensors")
    tensors["d2t"][-1] = 500  # maps a draft row past the target's vocabulary
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="d2t does not belong"):
        dflash_jax.load_drafter(folder)
    assert not (tmp_path / "out").exists()
    assert dflash_jax.cli.main(["convert", str(folder), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_reduced_vocabulary_keeps_the_targets_sampling_law(tmp_path):
    """Sampled pairs (t1, t2) from a drafter over 48 of 96 tokens, 800 seeds, against the
    target's own p(t1) p(t2 | t1) (chi-square): the rejection test with q zero off the draft
    vocabulary still gives the target's law."""
    from conftest import two_token_law_pvalue
    from test_generate import biased_target

    hf = biased_target(seed=5)
    config = drafter_config_dict(hf.config.to_dict(), dflash_config={"mask_token_id": 95, "block_size": 4})
    zlab_dir = save_hf(make_zlab_drafter(config, seed=6), tmp_path / "zlab", config)
    target = dflash_jax.load_target(save_hf(hf, tmp_path / "target"))
    draft_ids = sorted({10, 20, *range(0, 96, 2)})
    drafter = dflash_jax.load_drafter(as_speculators(zlab_dir, tmp_path / "d2t", hf, config, draft_ids))
    prompt, draws = [5, 17, 33, 2], 800
    out = dflash_jax.generate(target, drafter, [prompt] * draws, max_new_tokens=2, temperature=1.0,
                              seed=list(range(draws)))
    assert two_token_law_pvalue(target, prompt, out.token_ids) > 1e-3
