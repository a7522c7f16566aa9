"""The target and drafter models (Flax NNX) and how they are built from parameters."""

from dflash_jax.models.build import abstract_model, model_from_params, model_in_dtype, quantize_model
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target

__all__ = ["Drafter", "Target", "abstract_model", "model_from_params", "model_in_dtype", "quantize_model"]
