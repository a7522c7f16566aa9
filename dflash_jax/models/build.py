"""Models built from a config without allocating, and filled from a dict of arrays: how every
loader (orbax, HF, GGUF) and the trainer make a model from parameters read once."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target
from dflash_jax.quantization import WeightQuantization, params_of, quantize


def abstract_model(cfg: TargetConfig | DrafterConfig, dtype) -> Target | Drafter:
    model_class = Target if isinstance(cfg, TargetConfig) else Drafter
    return nnx.eval_shape(lambda: model_class(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


def model_from_params(cfg, dtype, params: dict[str, Any]) -> Target | Drafter:
    """Merge a nested dict of arrays (the `nnx.to_pure_dict` layout) into a fresh model."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def model_in_dtype(cfg, dtype, params: dict[str, Any]) -> Target | Drafter:
    """`model_from_params` with each float parameter cast to `dtype` first; 8-bit weights and
    their float32 scales stay as they are."""
    wanted = nnx.to_pure_dict(nnx.state(abstract_model(cfg, dtype), nnx.Param))
    return model_from_params(cfg, dtype, jax.tree.map(lambda x, want: x.astype(want.dtype), params, wanted))


def quantize_model(model: Target | Drafter, quantization: WeightQuantization) -> Target | Drafter:
    """`model` (float weights, one device) with its products in 8 bits (a target's decoder
    layers, routed experts included; a drafter's fc and layers): each layer the quantized config
    makes a `QuantizedLinear` gets its float kernel quantized, and routed experts each expert's
    matrices (`gate_up_scale` beside `gate_up`)."""
    if model.cfg.quantization is not None:
        raise ValueError("this model's weights are 8-bit already; quantize its float original instead.")
    if model.mesh is not None:
        raise ValueError("quantize a model loaded without a mesh, then place it on the mesh.")
    if isinstance(model.cfg, DrafterConfig) and model.cfg.dflash2 is not None:
        raise ValueError("8-bit DFlash 2 drafters are not supported yet; keep this drafter's float weights.")
    cfg = dataclasses.replace(model.cfg, quantization=quantization)
    params = params_of(model)

    def fill(tree: dict, wanted: dict) -> None:
        for key, want in wanted.items():
            if isinstance(want, dict) and "scale" in want:
                tree[key]["kernel"], tree[key]["scale"] = quantize(tree[key]["kernel"], quantization)
            elif isinstance(want, dict):
                fill(tree[key], want)
            elif key.endswith("_scale"):  # routed experts [E, in, out]: each expert alone
                name = key.removesuffix("_scale")
                tree[name], tree[key] = jax.vmap(lambda w: quantize(w, quantization))(tree[name])

    fill(params, nnx.to_pure_dict(nnx.state(abstract_model(cfg, model.dtype), nnx.Param)))
    return model_from_params(cfg, model.dtype, params)
