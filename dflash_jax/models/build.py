"""Models built from a config without allocating, and filled from a dict of arrays: how every
loader (orbax, HF, GGUF) and the trainer make a model from parameters read once."""

from __future__ import annotations

from typing import Any

from flax import nnx

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target


def abstract_model(cfg: TargetConfig | DrafterConfig, dtype) -> Target | Drafter:
    model_class = Target if isinstance(cfg, TargetConfig) else Drafter
    return nnx.eval_shape(lambda: model_class(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


def model_from_params(cfg, dtype, params: dict[str, Any]) -> Target | Drafter:
    """Merge a nested dict of arrays (the `nnx.to_pure_dict` layout) into a fresh model."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)
