"""Convert HF / z-lab checkpoints (safetensors, or PyTorch with the torch extra) to orbax."""

from convert.checkpoint_reader import ConversionError
from convert.export_hf import export_hf
from convert.hf_to_nnx import convert_checkpoint, model_from_hf

__all__ = ["ConversionError", "convert_checkpoint", "export_hf", "model_from_hf"]
