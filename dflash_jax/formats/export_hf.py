"""NNX model -> HF folder (config.json + model.safetensors): the converter run backwards.

Drafters come out in the z-lab DFlash-1 format (spec section 3), so other runtimes load them.
No torch needed: safetensors writes the JAX arrays (bf16 included) directly.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
from safetensors.flax import save_file

from dflash_jax.config import VISION_LANGUAGE_ARCHITECTURES, DrafterConfig
from dflash_jax.formats.hf_config import to_hf_config
from dflash_jax.formats.hf_reader import safetensors_files
from dflash_jax.formats.weight_map import drafter_rules, get_path, target_rules
from dflash_jax.models import Drafter, Target
from dflash_jax.quantization import params_of
from dflash_jax.staging import StagedOutput, terminate_raises


def export_hf(model: Target | Drafter, out_dir: str | Path, *, dtype=None, max_shard_bytes: int | None = None,
              extra_files: dict[str, str] | None = None, base: str | Path | None = None) -> Path:
    """Write `model` as a HF folder at `out_dir` (must not exist); staged like the converter.

    With `max_shard_bytes`, weights are split into shards of at most that size (a tensor is
    never split) plus `model.safetensors.index.json`, as HF does for large checkpoints.
    `extra_files` (name -> text, e.g. a model card) are written into the folder before it is
    moved into place. With `base` (a HF folder that stays beside `out_dir`, e.g. the DFlash-1
    drafter a DFlash 2 drafter grew from with a frozen backbone), base's files whose every
    tensor this model holds bit for bit as written are linked, not written again (relative
    symbolic links, `base-` before their names, which the index maps those tensors to): the
    folder holds only what the model adds, and HF loaders, which refuse index paths outside
    the folder, read it as a sharded checkpoint.
    """
    out_dir = Path(out_dir)
    if model.cfg.quantization is not None:
        raise ValueError("this model's weights are 8-bit; export writes float HF checkpoints only: export the "
                         "float original (or keep the converted folder, which loads as it is).")
    if getattr(model.cfg, "draft_vocab_size", None) is not None:
        raise ValueError("this drafter drafts over a reduced vocabulary (the speculators format's d2t), which "
                         "z-lab's layout cannot hold; load its speculators checkpoint as it is.")
    cfg = model.cfg
    if getattr(cfg, "architecture", None) in VISION_LANGUAGE_ARCHITECTURES:  # its text model, as a text model
        cfg = dataclasses.replace(cfg, architecture=cfg.architecture.replace("ForConditionalGeneration", "ForCausalLM"))
    with terminate_raises(), StagedOutput(out_dir, what="export") as staged:
        rules = drafter_rules(cfg) if isinstance(cfg, DrafterConfig) else target_rules(cfg)
        params = params_of(model)
        tensors = {}
        for rule in rules:
            array = rule.part(get_path(params, rule.path))
            array = array.T if rule.transpose else array
            if rule.plus_one:
                array = (np.asarray(array, np.float32) - 1).astype(array.dtype)
            array = array if dtype is None else array.astype(dtype)
            if rule.head_part is not None:  # one part of a per-head interleaved HF tensor: fill its rows
                parts, index, head_dim = rule.head_part
                whole = tensors.get(rule.hf_name)
                if whole is None:
                    whole = np.zeros((array.shape[0] * parts, *array.shape[1:]), np.asarray(array).dtype)
                whole.reshape(-1, parts, head_dim, *array.shape[1:])[:, index] = np.asarray(array).reshape(
                    -1, head_dim, *array.shape[1:])
                array = whole
            tensors[rule.hf_name] = array
        folder = staged.path
        folder.mkdir()
        total_size = sum(v.nbytes for v in tensors.values())
        shared = {} if base is None else _shared_with(tensors, Path(base))
        for file in sorted(set(shared.values())):
            os.symlink(os.path.relpath(Path(base).absolute() / file, out_dir.absolute()), folder / f"base-{file}")
        tensors = {name: array for name, array in tensors.items() if name not in shared}
        shards = _shards(tensors, max_shard_bytes) if tensors else []
        names = ["model.safetensors"] if len(shards) == 1 and not shared else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
        ]
        for name, shard in zip(names, shards):
            save_file({k: tensors[k] for k in shard}, folder / name, metadata={"format": "pt"})
        if len(shards) > 1 or shared:
            own = {k: name for name, shard in zip(names, shards) for k in shard}
            index = {"metadata": {"total_size": total_size},
                     "weight_map": {**{k: f"base-{file}" for k, file in shared.items()}, **own}}
            (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (folder / "config.json").write_text(json.dumps(to_hf_config(cfg), indent=2))
        for name in names:  # safetensors writes owner-only files: give them the mode the umask gives config.json
            shutil.copymode(folder / "config.json", folder / name)
        for name, text in (extra_files or {}).items():
            (folder / name).write_text(text)
        staged.commit()
    return out_dir


def _shared_with(tensors: dict, base: Path) -> dict[str, str]:
    """The names of `tensors` that `base`'s safetensors hold bit for bit, each mapped to the
    name of its file there, counting only files all of whose tensors are such (a loader that
    reads a whole linked file then finds nothing stale or foreign in it)."""
    from safetensors import safe_open

    files, _ = safetensors_files(base)
    if not files:
        raise ValueError(f"{base} holds no safetensors to share tensors with; export without `base`.")
    shared = {}
    for path in files:
        with safe_open(path, framework="flax") as handle:
            names = list(handle.keys())
            if names and all(_equal(tensors.get(name), handle.get_tensor(name)) for name in names):
                shared.update((name, path.name) for name in names if name not in shared)
    return shared


def _equal(ours, theirs) -> bool:
    """Whether `ours` (None: no such tensor) is `theirs` bit for bit, dtype and shape included."""
    if ours is None:
        return False
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    return ours.dtype == theirs.dtype and ours.shape == theirs.shape and np.array_equal(ours, theirs)


def _shards(tensors: dict, max_shard_bytes: int | None) -> list[list[str]]:
    """Tensor names grouped in order into shards of at most `max_shard_bytes` each."""
    shards, size = [[]], 0
    for name, array in tensors.items():
        if max_shard_bytes and shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += array.nbytes
    return shards
