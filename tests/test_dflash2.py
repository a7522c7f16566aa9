"""DFlash 2 drafters (z-lab's DFlash2DraftModel, dflash 0.1.0 as the oracle), float32 on CPU:
a checkpoint saved as z-lab publishes it (bare codebook tensors) loads, its draft logits (the
backbone with the convolutions) and its greedy candidate path match the oracle's; greedy
decoding matches z-lab's loop (tokens and accepted lengths) in `generate` and the Engine;
sampled decoding keeps the target's law; export gives the layout back; malformed configs and
8-bit conversion are refused with the reason."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import dflash_jax
from conftest import drafter_config_dict, make_hf_target, randomize_norms, rel_err, save_hf
from dflash_jax.config import ConfigError, parse_config

DFLASH2 = dict(conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=5)


def dflash2_config(target_config: dict, **dflash) -> dict:
    config = drafter_config_dict(target_config, architectures=["DFlash2DraftModel"])
    config["dflash_config"] = {**config["dflash_config"], **DFLASH2, **dflash}
    return config


def make_zlab_dflash2(config_dict: dict, seed: int = 0):
    """The oracle with random float32 weights (its convolution kernels start uninitialised)."""
    import transformers
    from dflash.model import DFlash2DraftModel

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**{k: v for k, v in config_dict.items() if k != "architectures"})
    config.architectures = config_dict["architectures"]
    model = DFlash2DraftModel(config)
    randomize_norms(model, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * (0.3 if "base_kernel" in name else 0.2))
    return model.float().eval()


def save_as_published(model, path, config_dict) -> str:
    """save_pretrained, then the codebooks renamed to the bare names z-lab's checkpoints use."""
    save_hf(model, path, config_dict)
    tensors = load_file(path / "model.safetensors")
    tensors = {name.removesuffix(".weight") if name.endswith("_codebook.weight") else name: t
               for name, t in tensors.items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dflash2")
    hf_target = make_hf_target("qwen3", num_hidden_layers=6)
    config = dflash2_config(hf_target.config.to_dict())
    zlab = make_zlab_dflash2(config, seed=1)
    target = dflash_jax.load_target(save_hf(hf_target, tmp / "target"))
    drafter = dflash_jax.load_drafter(save_as_published(zlab, tmp / "drafter", config))
    return hf_target, zlab, target, drafter


def oracle(hf_target, zlab, features, block):
    """The oracle's forward, logits and greedy `propose` on one block, no cache."""
    with torch.no_grad():
        hidden = zlab(target_hidden=torch.tensor(np.asarray(features))[None],
                      noise_embedding=hf_target.model.embed_tokens(torch.tensor(block))[None],
                      position_ids=torch.arange(features.shape[0] + len(block))[None])[:, 1:]
        logits = zlab.compute_logits(hidden, hf_target.lm_head)[0]
        drafts, candidates, _ = zlab.propose(hidden, torch.tensor(block[:1]), hf_target.lm_head, 0.0)
    return logits.numpy(), drafts[0].numpy(), candidates[0].numpy()


@pytest.mark.parametrize("anchor_seed", [0, 1, 2])
def test_draft_logits_and_greedy_path_match_the_oracle(pair, anchor_seed):
    hf_target, zlab, target, drafter = pair
    assert drafter.cfg.dflash2 is not None and drafter.cfg.dflash2.selector_top_k == 5
    prompt = np.random.default_rng(anchor_seed).integers(0, 95, size=19)
    _, features = dflash_jax.target_forward(target, prompt, layer_ids=drafter.cfg.target_layer_ids)
    block = [int(prompt[-1])] + [drafter.cfg.mask_token_id] * 7
    drafts, candidates, logits = dflash_jax.draft_path(target, drafter, features, block)
    want_logits, want_drafts, want_candidates = oracle(hf_target, zlab, np.asarray(features), block)
    assert rel_err(logits, want_logits) <= 1e-4
    assert np.asarray(drafts).tolist() == want_drafts.tolist()
    assert [sorted(row) for row in np.asarray(candidates).tolist()] == [sorted(row) for row in want_candidates.tolist()]
    # the selector's pairing term matters here: its path is not the logits' argmax everywhere
    if anchor_seed == 0:
        assert np.asarray(drafts).tolist() != np.argmax(np.asarray(logits), axis=-1).tolist()


def test_export_gives_the_z_lab_layout_back(pair, tmp_path):
    from safetensors import safe_open

    from dflash_jax.formats.export_hf import export_hf

    hf_target, zlab, target, drafter = pair
    export_hf(drafter, tmp_path / "exported")
    again = dflash_jax.load_drafter(tmp_path / "exported")
    assert again.cfg == drafter.cfg
    with safe_open(tmp_path / "exported" / "model.safetensors", "np") as f:
        assert "candidate_selector.predecessor_codebook" in set(f.keys())
    features = np.random.default_rng(5).normal(size=(6, drafter.cfg.fc_in_features)).astype(np.float32)
    block = [3] + [drafter.cfg.mask_token_id] * 5
    for ours, theirs in zip(dflash_jax.draft_path(target, again, features, block),
                            dflash_jax.draft_path(target, drafter, features, block)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.fixture(scope="module")
def biased_pair(tmp_path_factory):
    """A target whose greedy outputs repeat (so drafts are often right) and a DFlash 2 drafter
    for it, block 8."""
    from test_generate import biased_target

    tmp = tmp_path_factory.mktemp("dflash2-biased")
    hf = biased_target(seed=3)
    config = dflash2_config(hf.config.to_dict())
    zlab = make_zlab_dflash2(config, seed=4)
    target = dflash_jax.load_target(save_hf(hf, tmp / "target"))
    return hf, zlab, target, dflash_jax.load_drafter(save_as_published(zlab, tmp / "drafter", config))


@pytest.mark.slow
def test_greedy_decoding_matches_the_zlab_loop_and_autoregressive(biased_pair):
    """Tokens and per-cycle accepted lengths equal z-lab's `dflash_generate` with the same
    DFlash 2 drafter (its convolutions within each request's block, its selector's path), in
    `generate` and the Engine, and equal autoregressive decoding."""
    from test_generate import PROMPTS, zlab_generate

    hf, zlab, target, drafter = biased_pair
    for max_new_tokens in (32, 12):  # each row's last blocks shorter than 8: drafted across fewer positions
        ours = dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=max_new_tokens)
        ar = dflash_jax.generate_autoregressive(target, PROMPTS, max_new_tokens=max_new_tokens)
        assert ours.token_ids == ar.token_ids
        for prompt, tokens, lengths in zip(PROMPTS, ours.token_ids, ours.accepted_lengths):
            assert (tokens, lengths) == zlab_generate(zlab, hf, prompt, max_new_tokens)
        assert any(n > 1 for lengths in ours.accepted_lengths for n in lengths)
    engine = dflash_jax.Engine(target, drafter, max_num_reqs=2, max_num_tokens=32)
    ids = [engine.add_request(p, dflash_jax.SamplingParams(max_new_tokens=32)) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    assert [engine.output(i) for i in ids] == dflash_jax.generate(target, drafter, PROMPTS, max_new_tokens=32).token_ids


@pytest.mark.slow
def test_sampled_tokens_follow_the_targets_law(biased_pair):
    """Rejection sampling with the selector's q over its candidates keeps the target's law:
    the first two sampled tokens (the second one verified against the selector's draft) over
    800 seeds, against the target's own p(t1) p(t2 | t1) (chi-square)."""
    from conftest import two_token_law_pvalue

    _, _, target, drafter = biased_pair
    prompt, draws = [5, 17, 33, 2], 800
    out = dflash_jax.generate(target, drafter, [prompt] * draws, max_new_tokens=2, temperature=1.0,
                              seed=list(range(draws)))
    assert two_token_law_pvalue(target, prompt, out.token_ids) > 1e-3


def test_the_selectors_q_stays_a_distribution_at_any_temperature(pair):
    """Tiny temperatures tend to the greedy choice, never NaN; a zero temperature is one-hot."""
    import jax.numpy as jnp

    _, _, _, drafter = pair
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(4, 3, drafter.cfg.hidden_size)), jnp.float32)
    logits = jnp.asarray(rng.normal(size=(4, 3, drafter.cfg.vocab_size)) * 30, jnp.float32)
    anchors = jnp.asarray([1, 2, 3, 4])
    greedy, _, _ = drafter.candidate_selector.walk(hidden, logits, anchors)
    temperatures = jnp.asarray([1e-12, 1e-8, 0.0, 1.0])
    drafts, _, q = drafter.candidate_selector.walk(hidden, logits, anchors, temperatures, jnp.zeros(4, jnp.int32),
                                                   jnp.zeros(4, jnp.int32))
    q = np.asarray(q)
    assert np.isfinite(q).all() and np.allclose(q.sum(-1), 1, atol=1e-5)
    assert (np.asarray(drafts)[:3] == np.asarray(greedy)[:3]).all()
    assert np.isin(q[2].max(-1), [1.0]).all()


def test_draft_path_needs_a_dflash2_drafter(tmp_path):
    from conftest import make_zlab_drafter

    hf_target = make_hf_target("qwen3", num_hidden_layers=6)
    config = drafter_config_dict(hf_target.config.to_dict())
    target = dflash_jax.load_target(save_hf(hf_target, tmp_path / "target"))
    drafter = dflash_jax.load_drafter(save_hf(make_zlab_drafter(config), tmp_path / "drafter", config))
    with pytest.raises(ValueError, match="needs a DFlash 2 drafter"):
        dflash_jax.draft_path(target, drafter, np.zeros((3, drafter.cfg.fc_in_features), np.float32), [1, 95])


@pytest.mark.parametrize("change,message", [
    (dict(conv_group_size=7), "does not divide the hidden size"),
    (dict(selector_top_k=500), "exceeds the vocabulary"),
    (dict(selector_rank=None), "needs dflash_config.selector_rank"),
])
def test_malformed_dflash2_configs_are_refused(change, message):
    hf_target = make_hf_target("qwen3", num_hidden_layers=6)
    config = dflash2_config(hf_target.config.to_dict(), **change)
    with pytest.raises(ConfigError, match=message):
        parse_config(config)


def test_missing_selector_tensors_are_refused_and_nothing_is_written(pair, tmp_path, capsys):
    from dflash_jax.cli import main

    hf_target, zlab, _, _ = pair
    config = dflash2_config(hf_target.config.to_dict())
    folder = tmp_path / "drafter"
    save_as_published(zlab, folder, config)
    tensors = load_file(folder / "model.safetensors")
    del tensors["candidate_selector.successor_codebook"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", str(folder), str(tmp_path / "out")]) != 0
    assert "candidate_selector.successor_codebook" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_quantizing_a_dflash2_drafter_is_refused_and_writes_nothing(pair, tmp_path, capsys):
    from dflash_jax.cli import main

    hf_target, zlab, _, _ = pair
    folder = tmp_path / "drafter"
    save_as_published(zlab, folder, dflash2_config(hf_target.config.to_dict()))
    assert main(["convert", str(folder), str(tmp_path / "out"), "--quantize", "int8"]) != 0
    assert "8-bit DFlash 2 drafters are not supported" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
