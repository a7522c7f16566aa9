"""orbax checkpoints of the models: `save_checkpoint` and `load_checkpoint`.

A converted folder holds the HF `config.json` (verbatim, the source of truth for the
architecture), `dflash_jax.json` (kind, dtype, format version) and `params/` (an orbax
checkpoint of the parameters as a plain nested dict). Loading builds the model abstractly from
the config (no allocation), restores into it and merges: parameters are read exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from dflash_jax.config import ConfigError, parse_config, read_config_json
from dflash_jax.models import Drafter, Target, abstract_model, model_in_dtype
from dflash_jax.placement import place_model
from dflash_jax.quantization import params_of

FORMAT_FILE = "dflash_jax.json"
FORMAT_VERSION = 2  # 2: fused qkv_proj and gate_up_proj (1 had q/k/v_proj and gate/up_proj)
PARAMS_DIR = "params"


def save_checkpoint(model: Target | Drafter, raw_config: dict[str, Any], out_dir: str | Path) -> None:
    """Write `model` to `out_dir` (which must not exist: callers make it atomic)."""
    if model.mesh is not None:
        raise ValueError("this model is placed on a mesh, in its per-shard layout; save the model loaded "
                         "without a mesh.")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(json.dumps(raw_config, indent=2))
    meta = {"format": FORMAT_VERSION, "kind": model.cfg.kind, "dtype": jnp.dtype(model.dtype).name}
    (out_dir / FORMAT_FILE).write_text(json.dumps(meta, indent=2))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((out_dir / PARAMS_DIR).absolute(), params_of(model))
    checkpointer.wait_until_finished()


def checkpoint_format(path: str | Path) -> int | None:
    """The format version of the orbax folder at `path`; None where there is none."""
    try:
        return json.loads((Path(path) / FORMAT_FILE).read_text()).get("format")
    except (OSError, ValueError):
        return None


def is_orbax_checkpoint(path: str | Path) -> bool:
    return (Path(path) / FORMAT_FILE).is_file()


def check_checkpoint_folder(path: str | Path) -> None:
    """A converted (orbax) folder's dflash_jax.json is readable and names a kind, a format and a
    float dtype, or ValueError; a HF folder or .gguf file (no dflash_jax.json) passes. For
    `load_checkpoint` to call first: otherwise a damaged file fails deep inside the loader."""
    meta_path = Path(path) / FORMAT_FILE
    if not meta_path.is_file():
        return
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{meta_path} is not valid JSON ({err}); convert the checkpoint again.") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path} is not a JSON object; convert the checkpoint again.")
    dtype = meta.get("dtype")
    try:
        ok = isinstance(dtype, str) and jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{meta_path} names dtype {dtype!r}, not a float type; convert the checkpoint again.")
    if meta.get("kind") not in ("target", "drafter"):
        raise ValueError(f"{meta_path} names kind {meta.get('kind')!r}, not target or drafter; convert the checkpoint again.")
    if not (Path(path) / PARAMS_DIR).is_dir():
        raise ValueError(f"{path} has no params/ folder (an incomplete copy?); convert the checkpoint again.")


def load_checkpoint(path: str | Path, dtype=None, mesh: Mesh | None = None) -> Target | Drafter:
    """A model from an orbax folder written by `save_checkpoint`, cast to `dtype` if given.
    With a `mesh` each parameter is read to the host and sent to its shards
    (`placement.place_model`); without one it is restored onto the default device."""
    path = Path(path)
    check_checkpoint_folder(path)
    meta = json.loads((path / FORMAT_FILE).read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ConfigError(
            f"{path} has checkpoint format {meta.get('format')}, this version reads "
            f"{FORMAT_VERSION}; convert the HF checkpoint again."
        )
    cfg = parse_config(read_config_json(path))
    stored_dtype = jnp.dtype(meta["dtype"])
    target_dtype = stored_dtype if dtype is None else jnp.dtype(dtype)
    graphdef, abstract_state = nnx.split(abstract_model(cfg, stored_dtype), nnx.Param)
    abstract_params = nnx.to_pure_dict(abstract_state)
    if mesh is not None:
        # numpy targets restore to the host (np.empty reserves no memory until written)
        on_host = jax.tree.map(lambda x: np.empty(x.shape, x.dtype), abstract_params)
        return place_model(cfg, target_dtype, _restore(path, on_host), mesh)
    return model_in_dtype(cfg, target_dtype, _restore(path, abstract_params))


def _restore(path: Path, abstract_params: dict) -> dict:
    """The parameters of `path`, which must be those its config builds: a folder written by an
    earlier version may hold another set (a Qwen3.5 target quantized before its gated-delta-net
    layers had an 8-bit form)."""
    try:
        return ocp.StandardCheckpointer().restore((path / PARAMS_DIR).absolute(), abstract_params)
    except ValueError as err:
        if "structure" not in str(err).lower():
            raise
        raise ConfigError(f"{path} holds other parameters than its config.json describes to this version (written "
                          "by an earlier one?); convert the HF checkpoint again.") from err
