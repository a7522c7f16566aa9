"""Pallas kernels (Triton lowering on GPU, interpret mode on CPU) and their jnp references.

Array names end in shape letters (`q_TUH`, `k_slots_XKH`): the project's one legend is
docs/ARCHITECTURE.md, "Shape letters"."""

from pallas_kernels.dflash_layout import DFlashLayout, prepare_dflash_inputs

__all__ = ["DFlashLayout", "prepare_dflash_inputs"]
