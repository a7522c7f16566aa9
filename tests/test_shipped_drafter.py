"""The SmolLM2-135M drafter that ships in the package: complete, loadable, bf16, sized for git."""

import json

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

import dflash_jax
from dflash_jax.demo import DEFAULT_DRAFTER


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
