"""Flax NNX models: the target (Qwen3 / Llama) and the DFlash drafter."""

from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target

__all__ = ["Drafter", "Target"]
