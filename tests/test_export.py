"""export_hf: NNX models written as HF / z-lab folders load in transformers and dflash 0.1.0."""

import numpy as np
import pytest
import torch
from flax import nnx

import dflash_jax
from conftest import randomize, rel_err
from dflash_jax.config import parse_config
from dflash_jax.formats.export_hf import export_hf
from dflash_jax.formats.hf_config import to_hf_config
from dflash_jax.models import Drafter, Target
from test_drafter_parity import reference_draft_logits

TARGET = dict(
    architectures=["Qwen3ForCausalLM"], vocab_size=80, hidden_size=48, intermediate_size=64,
    num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)
DRAFTER = dict(
    architectures=["DFlashDraftModel"], vocab_size=80, hidden_size=48, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    layer_types=["sliding_attention", "full_attention"], sliding_window=6,
    num_target_layers=5, dflash_config={"mask_token_id": 79, "target_layer_ids": [1, 3], "block_size": 4},
)


@pytest.mark.parametrize("raw", [TARGET, DRAFTER], ids=["target", "drafter"])
def test_config_round_trips(raw):
    cfg = parse_config(raw)
    assert parse_config(to_hf_config(cfg)) == cfg


@pytest.mark.slow
def test_exported_pair_loads_in_transformers_and_zlab(tmp_path):
    import transformers
    from dflash.model import DFlashDraftModel

    target = randomize(Target(parse_config(TARGET), rngs=nnx.Rngs(0)), 1)
    drafter = randomize(Drafter(parse_config(DRAFTER), rngs=nnx.Rngs(1)), 2)
    export_hf(target, tmp_path / "target")
    export_hf(drafter, tmp_path / "drafter", dtype="bfloat16")
    with pytest.raises(FileExistsError, match="already exists"):
        export_hf(drafter, tmp_path / "drafter")

    hf_target = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "target").float().eval()
    zlab = DFlashDraftModel.from_pretrained(tmp_path / "drafter", torch_dtype=torch.float32).eval()
    ids = np.arange(2, 19)
    logits, features = dflash_jax.target_forward(target, ids, layer_ids=drafter.cfg.target_layer_ids)
    with torch.no_grad():
        assert rel_err(logits, hf_target(torch.tensor(ids)[None]).logits[0]) <= 1e-4

    bf16_drafter = dflash_jax.load_drafter(tmp_path / "drafter", dtype="float32")
    block = [5, 79, 79, 79]
    ours = dflash_jax.draft_logits(target, bf16_drafter, features, block)
    assert rel_err(ours, reference_draft_logits(hf_target, zlab, features, block)) <= 1e-4


def test_sharded_export_round_trips(tmp_path):
    target = randomize(Target(parse_config(TARGET), rngs=nnx.Rngs(0)), 3)
    export_hf(target, tmp_path / "hf", max_shard_bytes=40_000)
    shards = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    config_mode = (tmp_path / "hf" / "config.json").stat().st_mode
    assert all((tmp_path / "hf" / name).stat().st_mode == config_mode for name in shards)  # as readable as the rest
    ids = np.arange(1, 12)
    np.testing.assert_array_equal(
        np.asarray(dflash_jax.target_forward(target, ids)[0]),
        np.asarray(dflash_jax.target_forward(dflash_jax.load_target(tmp_path / "hf"), ids)[0]),
    )


def test_a_sharded_folder_reads_each_tensor_from_the_file_its_index_names(tmp_path):
    """Two shards holding one name: the index decides which is read, whatever the file order."""
    import json

    from safetensors.numpy import save_file

    from dflash_jax.formats.hf_reader import open_checkpoint

    save_file({"w": np.zeros(3, np.float32), "a": np.ones(2, np.float32)}, tmp_path / "a.safetensors")
    save_file({"w": np.full(3, 7, np.float32)}, tmp_path / "b.safetensors")
    for chosen in ("a.safetensors", "b.safetensors"):
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"w": chosen, "a": "a.safetensors"}}))
        source = open_checkpoint(tmp_path)
        want = 0 if chosen == "a.safetensors" else 7
        np.testing.assert_array_equal(np.asarray(source.get("w")), np.full(3, want, np.float32))
        np.testing.assert_array_equal(np.asarray(source.get("a")), np.ones(2, np.float32))
