"""The SmolLM2-135M drafters that ship in the package: complete, loadable, bf16, sized for git;
the DFlash 2 one is the DFlash-1 one's backbone (linked, not copied) plus its own parts."""

import json

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

import dflash_jax
from dflash_jax.config import DFlash2Config
from dflash_jax.demo import DEFAULT_DRAFTER, SHIPPED_DRAFTERS, drafter_argument

DFLASH2_DRAFTER = SHIPPED_DRAFTERS["dflash2"]


def test_shipped_drafter_loads_with_smollm2_shapes():
    drafter = dflash_jax.load_drafter(DEFAULT_DRAFTER, dtype="float32")
    cfg = drafter.cfg
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (49152, 576, 9, 3)
    assert cfg.trained_block_size == 16 and cfg.mask_token_id == 16 and cfg.num_target_layers == 30
    leaves = jax.tree.leaves(nnx.state(drafter, nnx.Param))
    assert all(bool(np.isfinite(np.asarray(x)).all()) for x in leaves)


def test_shipped_drafter_files_are_bf16_shards_under_15mb():
    index = json.loads((DEFAULT_DRAFTER / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    for name in shards:
        path = DEFAULT_DRAFTER / name
        assert path.stat().st_size <= 15 << 20, f"{name} is {path.stat().st_size} bytes"
        assert {t.dtype.name for t in load_file(path).values()} == {"bfloat16"}
    assert "Held-out acceptance" in (DEFAULT_DRAFTER / "README.md").read_text()


def test_drafters_are_named_on_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert drafter_argument("dflash1") == DEFAULT_DRAFTER
    assert drafter_argument("dflash2") == DFLASH2_DRAFTER
    assert str(drafter_argument("some/folder")) == "some/folder"
    (tmp_path / "dflash2").mkdir()  # a folder of that name is what the user means
    assert drafter_argument("dflash2") == tmp_path.joinpath("dflash2").relative_to(tmp_path)


def test_shipped_dflash2_drafter_is_the_dflash1_backbone_plus_its_own_parts():
    dflash1 = dflash_jax.load_drafter(DEFAULT_DRAFTER, dtype="float32")
    dflash2 = dflash_jax.load_drafter(DFLASH2_DRAFTER, dtype="float32")
    assert dflash2.cfg.dflash2 == DFlash2Config(conv_kernel_size=4, conv_group_size=64, selector_rank=32, selector_top_k=16)
    base = dict(nnx.to_flat_state(nnx.state(dflash1, nnx.Param)))
    grown = dict(nnx.to_flat_state(nnx.state(dflash2, nnx.Param)))
    assert set(base) < set(grown)
    for name, value in base.items():
        np.testing.assert_array_equal(np.asarray(grown[name][...]), np.asarray(value[...]), err_msg=str(name))
    own = [grown[name][...] for name in set(grown) - set(base)]
    assert all(bool(np.isfinite(np.asarray(x)).all()) and np.any(np.asarray(x) != 0) for x in own)


def test_shipped_dflash2_drafter_links_the_dflash1_shards_and_adds_one_small_bf16_shard():
    index = json.loads((DFLASH2_DRAFTER / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    links = [DFLASH2_DRAFTER / name for name in files if name.startswith("base-")]
    own = [DFLASH2_DRAFTER / name for name in files if not name.startswith("base-")]
    assert len(links) == 3 and len(own) == 1
    for link in links:  # a link in the repository; a copy in a wheel, which follows links
        base = DEFAULT_DRAFTER / link.name.removeprefix("base-")
        assert link.resolve().parent == DEFAULT_DRAFTER.resolve() if link.is_symlink() else (
            link.read_bytes() == base.read_bytes())
    assert own[0].stat().st_size <= 15 << 20
    assert {t.dtype.name for t in load_file(own[0]).values()} == {"bfloat16"}
    assert "Against the shipped DFlash-1 drafter" in (DFLASH2_DRAFTER / "README.md").read_text()
