"""Convert HF / z-lab checkpoints (safetensors, or PyTorch with the torch extra) and llama.cpp
GGUF files to orbax, and models back to HF folders: the public names for scripts and benchmarks.

The code lives in the library (`dflash_jax.formats`), which also loads such checkpoints on the
fly and runs `dflash-jax convert`; imports run from `convert` to `dflash_jax`, never back.
"""

from dflash_jax.formats.export_hf import export_hf
from dflash_jax.formats.hf_reader import ConversionError
from dflash_jax.formats.hf_to_nnx import convert_checkpoint, model_from_hf

__all__ = ["ConversionError", "convert_checkpoint", "export_hf", "model_from_hf"]
