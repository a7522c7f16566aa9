"""Pallas kernels (Triton lowering on GPU, interpret mode on CPU) and their jnp references."""

from pallas_kernels.dflash_layout import DFlashLayout, prepare_dflash_inputs

__all__ = ["DFlashLayout", "prepare_dflash_inputs"]
