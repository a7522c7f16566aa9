"""HF folder -> `dflash-jax convert` -> orbax -> load_*: equal outputs; bad input refused cleanly."""

import json
import re
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import dflash_jax
from conftest import drafter_config_dict, make_hf_target, make_zlab_drafter, save_hf
from dflash_jax.cli import main

IDS = np.arange(1, 30) % 95


def run_cli(*args):
    return main(["convert", *map(str, args)])


def convert_ok(hf_dir, out_dir, *extra):
    assert run_cli(hf_dir, out_dir, *extra) == 0
    return out_dir


def leftovers(parent: Path, keep: set[str]) -> list[str]:
    return sorted(set(os.listdir(parent)) - keep)


@pytest.mark.parametrize(
    "save_kwargs",
    [{}, {"max_shard_size": "40KB"}, {"safe_serialization": False}],
    ids=["safetensors", "sharded", "pytorch-bin"],
)
def test_target_round_trip(tmp_path, save_kwargs):
    hf_dir = save_hf(make_hf_target("llama", tie_word_embeddings=True), tmp_path / "hf", **save_kwargs)
    if "max_shard_size" in save_kwargs:
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    convert_ok(hf_dir, tmp_path / "out")
    direct = dflash_jax.target_forward(dflash_jax.load_target(hf_dir), IDS, layer_ids=(1,))
    converted = dflash_jax.target_forward(dflash_jax.load_target(tmp_path / "out"), IDS, layer_ids=(1,))
    for a, b in zip(direct, converted):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert leftovers(tmp_path, {"hf", "out"}) == []


def test_tied_head_reads_a_derived_copy_that_is_never_saved(tmp_path):
    """On CPU a tied target's LM head multiplies by a [D, V] copy of the embedding table
    (`Target.transpose_tied_head`); the Params a checkpoint saves do not include it."""
    from flax import nnx

    target = dflash_jax.load_target(save_hf(make_hf_target("llama", tie_word_embeddings=True), tmp_path / "hf"))
    table = np.asarray(target.embed_tokens.embedding[...])
    np.testing.assert_array_equal(np.asarray(target.head_DV[...]), table.T)
    h = np.random.default_rng(0).standard_normal((3, table.shape[1])).astype(np.float32)
    np.testing.assert_allclose(np.asarray(target.unembed(h)), h @ table.T, rtol=1e-5, atol=1e-5)
    assert "head_DV" not in nnx.to_pure_dict(nnx.state(target, nnx.Param))


@pytest.mark.slow
def test_bf16_checkpoint_round_trip_and_dtype_choice(tmp_path):
    hf_dir = save_hf(make_hf_target("qwen3").to(torch.bfloat16), tmp_path / "hf")
    convert_ok(hf_dir, tmp_path / "out")
    meta = json.loads((tmp_path / "out" / "dflash_jax.json").read_text())
    assert meta["dtype"] == "bfloat16"
    from_orbax = dflash_jax.load_target(tmp_path / "out")
    from_hf = dflash_jax.load_target(hf_dir)
    assert from_orbax.dtype == np.dtype("bfloat16")
    for a, b in zip(dflash_jax.target_forward(from_hf, IDS), dflash_jax.target_forward(from_orbax, IDS)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    as_f32 = dflash_jax.load_target(tmp_path / "out", dtype="float32")
    assert as_f32.dtype == np.float32
    assert dflash_jax.target_forward(as_f32, IDS)[0].dtype == np.float32

    convert_ok(hf_dir, tmp_path / "out32", "--dtype", "float32")
    assert json.loads((tmp_path / "out32" / "dflash_jax.json").read_text())["dtype"] == "float32"


def test_drafter_round_trip_with_model_prefix(tmp_path):
    target_hf = make_hf_target("qwen3", num_hidden_layers=6)
    config = drafter_config_dict(target_hf.config.to_dict())
    zlab = make_zlab_drafter(config)
    from safetensors.torch import save_file

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    save_file({f"model.{k}": v.contiguous() for k, v in zlab.state_dict().items()}, hf_dir / "model.safetensors")
    (hf_dir / "config.json").write_text(json.dumps(config))
    convert_ok(hf_dir, tmp_path / "out", "--dtype", "bfloat16")
    target = dflash_jax.load_target(save_hf(target_hf, tmp_path / "target"))
    _, features = dflash_jax.target_forward(target, IDS, layer_ids=dflash_jax.load_drafter(hf_dir).cfg.target_layer_ids)
    block = [3] + [95] * 7
    direct = dflash_jax.draft_logits(target, dflash_jax.load_drafter(hf_dir, dtype="bfloat16"), features, block)
    converted = dflash_jax.draft_logits(target, dflash_jax.load_drafter(tmp_path / "out"), features, block)
    np.testing.assert_array_equal(np.asarray(direct), np.asarray(converted))


def test_load_target_refuses_a_drafter(tmp_path):
    config = drafter_config_dict(make_hf_target("qwen3", num_hidden_layers=6).config.to_dict())
    hf_dir = save_hf(make_zlab_drafter(config), tmp_path / "drafter", config)
    with pytest.raises(ValueError, match="holds a drafter"):
        dflash_jax.load_target(hf_dir)


# --- bad input: exit code 2, one line naming the problem, nothing written -----------------------


def tamper_safetensors(hf_dir: Path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(hf_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, hf_dir / "model.safetensors")


def break_missing(hf_dir):
    tamper_safetensors(hf_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))


def break_unexpected(hf_dir):
    tamper_safetensors(hf_dir, lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(3)))


def break_shape(hf_dir):
    tamper_safetensors(hf_dir, lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(16, 64)))


def break_truncate(hf_dir):
    path = hf_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def break_architecture(hf_dir):
    config = json.loads((hf_dir / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (hf_dir / "config.json").write_text(json.dumps(config))


BAD_CASES = {
    "missing": (break_missing, "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    "unexpected": (break_unexpected, "unexpected tensor 'model.layers.0.extra.weight'"),
    "shape": (break_shape, r"shape mismatch for 'model.layers.0.self_attn.k_proj.weight': expected \[256, 64\], got \[16, 64\]"),
    "truncated": (break_truncate, "model.safetensors is truncated or corrupt"),
    "architecture": (break_architecture, "unsupported target architecture 'MistralForCausalLM'"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_checkpoint_exits_2_and_writes_nothing(tmp_path, capsys, case):
    breaker, message = BAD_CASES[case]
    hf_dir = Path(save_hf(make_hf_target("qwen3"), tmp_path / "hf"))
    breaker(hf_dir)
    capsys.readouterr()
    assert run_cli(hf_dir, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dflash-jax convert: error: ")
    assert re.search(message, err), err
    assert leftovers(tmp_path, {"hf"}) == []


def test_existing_out_dir_needs_force(tmp_path, capsys):
    hf_dir = save_hf(make_hf_target("qwen3"), tmp_path / "hf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert run_cli(hf_dir, out) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert os.listdir(out) == ["keep.txt"]
    assert run_cli(hf_dir, out, "--force") == 0
    assert not (out / "keep.txt").exists() and (out / "dflash_jax.json").is_file()
    assert leftovers(tmp_path, {"hf", "out"}) == []


def test_forced_conversion_replaces_a_link_not_its_target(tmp_path):
    hf_dir = save_hf(make_hf_target("qwen3"), tmp_path / "hf")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("precious")
    out = tmp_path / "out"
    out.symlink_to(elsewhere)
    assert run_cli(hf_dir, out, "--force") == 0
    assert not out.is_symlink() and (out / "dflash_jax.json").is_file()
    assert os.listdir(elsewhere) == ["keep.txt"]


def test_failed_forced_conversion_keeps_the_old_output(tmp_path):
    hf_dir = Path(save_hf(make_hf_target("qwen3"), tmp_path / "hf"))
    out = tmp_path / "out"
    assert run_cli(hf_dir, out) == 0
    break_missing(hf_dir)
    assert run_cli(hf_dir, out, "--force") == 2
    assert dflash_jax.load_target(out).cfg.num_layers == 4
    assert leftovers(tmp_path, {"hf", "out"}) == []


def test_drafter_fc_width_mismatch_is_refused(tmp_path, capsys):
    config = drafter_config_dict(make_hf_target("qwen3", num_hidden_layers=6).config.to_dict())
    hf_dir = save_hf(make_zlab_drafter(config), tmp_path / "hf", config)
    config["dflash_config"]["target_layer_ids"] = [1, 2, 3]  # fc was built for 2 layers: 128 inputs
    (Path(hf_dir) / "config.json").write_text(json.dumps(config))
    assert run_cli(hf_dir, tmp_path / "out") == 2
    assert "fc.weight takes 128 inputs, not a multiple of len(target_layer_ids) = 3" in capsys.readouterr().err
    assert leftovers(tmp_path, {"hf"}) == []
