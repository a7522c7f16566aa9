"""NNX model -> HF folder (config.json + model.safetensors): the converter run backwards.

Drafters come out in the z-lab DFlash-1 format (spec section 3), so other runtimes load them.
No torch needed: safetensors writes the JAX arrays (bf16 included) directly.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from flax import nnx
from safetensors.flax import save_file

from convert.weight_map import drafter_rules, get_path, target_rules
from dflash_jax.config import DrafterConfig, to_hf_config
from dflash_jax.models import Drafter, Target


def export_hf(model: Target | Drafter, out_dir: str | Path, *, dtype=None) -> Path:
    """Write `model` as a HF folder at `out_dir` (must not exist); atomic like the converter."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another folder.")
    rules = drafter_rules(model.cfg) if isinstance(model.cfg, DrafterConfig) else target_rules(model.cfg)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tensors = {}
    for rule in rules:
        array = get_path(params, rule.path)
        array = array.T if rule.transpose else array
        tensors[rule.hf_name] = (array if dtype is None else array.astype(dtype))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_file({k: v.copy() for k, v in tensors.items()}, staging / "model.safetensors", metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(to_hf_config(model.cfg), indent=2))
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir
