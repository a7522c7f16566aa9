"""`load_target` / `load_drafter`: a model from wherever it is stored. A converted (orbax)
folder is read by `checkpoint`; a HF folder or a .gguf file is converted on the fly in memory
by `formats.hf_to_nnx`, without writing anything."""

from __future__ import annotations

from pathlib import Path

import jax
from jax.sharding import Mesh

from dflash_jax.checkpoint import is_orbax_checkpoint, load_checkpoint
from dflash_jax.config import ConfigError
from dflash_jax.formats.hf_to_nnx import model_from_hf
from dflash_jax.models import Drafter, Target
from dflash_jax.quantization import to_output_major


def load_model(path: str | Path, dtype=None, mesh: Mesh | None = None) -> Target | Drafter:
    """An orbax folder written by the converter, or a HF folder / .gguf file converted on the
    fly; with a `mesh`, its parameters placed straight into their shards (`placement`)."""
    path = Path(path)
    is_gguf = path.suffix.lower() == ".gguf" and path.is_file()
    if not (path.is_dir() or is_gguf):
        raise FileNotFoundError(f"{path} is neither a folder nor a .gguf file; give a converted or a HF model folder.")
    if is_orbax_checkpoint(path):
        return load_checkpoint(path, dtype, mesh)
    return model_from_hf(path, dtype, mesh=mesh)[1]


def load_target(path: str | Path, dtype=None, *, mesh: Mesh | None = None) -> Target:
    """The target model at `path` (orbax folder, HF folder or .gguf file); `dtype` None keeps the stored dtype;
    `mesh` (`sharding.make_mesh`) places it for tensor parallelism over the mesh's "model" axis.
    Its weights are laid out for the device it runs on (`lay_out_for_device`)."""
    model = load_model(path, dtype, mesh)
    if not isinstance(model, Target):
        raise ConfigError(f"{path} holds a drafter, not a target; use load_drafter for it.")
    lay_out_for_device(model)
    return model


def lay_out_for_device(target: Target) -> None:
    """The layouts a target's products run fastest with on this backend, which checkpoints never
    hold: on a CPU a tied float32 model's LM head gets a [D, V] copy (`Target.transpose_tied_head`);
    on one GPU its 8-bit kernels are held [out, in] (`quantization.to_output_major`)."""
    if jax.default_backend() == "cpu":
        target.transpose_tied_head()
    elif jax.default_backend() == "gpu" and target.mesh is None:
        to_output_major(target)


def load_drafter(path: str | Path, dtype=None, *, mesh: Mesh | None = None) -> Drafter:
    """The DFlash drafter at `path` (orbax or HF folder); `dtype` None keeps the stored dtype;
    `mesh` as for `load_target` (give both models the same one)."""
    model = load_model(path, dtype, mesh)
    if not isinstance(model, Drafter):
        raise ConfigError(f"{path} holds a target, not a drafter; use load_target for it.")
    return model
