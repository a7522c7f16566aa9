"""8-bit weights: what a quantized checkpoint says (`WeightQuantization`), quantizing float
weights, and the linear layer that keeps its weights 8-bit on the device.

Only the weights are quantized: a product converts its 8-bit values to the activations' dtype
(exactly), multiplies, and scales the float32 result (`pallas_kernels.quantized_matmul`: a
Pallas kernel, or XLA's product with the conversion fused, as `Kernels.quantized` chooses).
The kernel and the CPU's product each compute a row alike whatever the rows beside it, so a
verify block computes exactly what single steps compute. The GPU's default sends per-column
weights through XLA in one-token steps and through the kernel in verify blocks, whose last
bits may then differ (as bf16 cuBLAS products' do; `quantized="pallas"` keeps them alike).
Activations are never quantized (per block they would not be).

A weight `[in, out]` holds 8-bit values with one float32 scale per output column and block of
`block_in` input rows (`block_in` None: one block, a scale per output column). Published block
layouts (Qwen's FP8: 128 x 128 blocks) are read into it with each output block's scale
repeated over its columns, so the fused matrices (`qkv_proj`, `gate_up_proj`) and their
per-shard column orders treat scales as columns too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.flat_models import has_run
from dflash_jax.kernels import REFERENCE, Kernels

# name -> (stored dtype, its largest magnitude)
WEIGHT_DTYPES = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}
QUANTIZE_CHOICES = tuple(WEIGHT_DTYPES)
# `convert --quantize`'s input rows per scale: SmolLM2's top-1 agreement with its float
# original was 98.3% with int8 per 128 rows, 97.8% with one scale per output channel
# (bench/results/2026-12-03-s21-quantized-agreement-cpu.md).
DEFAULT_QUANTIZE_BLOCK = 128
OWN_METHOD = "dflash_jax"  # quantization_config["quant_method"] of `convert --quantize` output
GGUF_Q8_0_METHOD = "gguf_q8_0"  # quantization_config["quant_method"] of GGUF files whose projections are Q8_0


class QuantizationError(ValueError):
    """A quantization_config this project cannot read, or a bad --quantize request."""


@dataclasses.dataclass(frozen=True)
class WeightQuantization:
    weights: str  # a WEIGHT_DTYPES key
    block_in: int | None = None  # input rows per scale; None: all of them
    # How a HF checkpoint stores the scales: the tensor beside each `weight` (None: this
    # project's own, orbax only) and the output columns that share one stored scale.
    hf_scale: str | None = None
    block_out: int = 1

    @property
    def dtype(self):
        return WEIGHT_DTYPES[self.weights][0]

    def scale_rows(self, in_features: int) -> int:
        return 1 if self.block_in is None else math.ceil(in_features / self.block_in)

    def to_config(self) -> dict[str, Any]:
        """The quantization_config that `parse_quantization` reads back as this."""
        if self.hf_scale == "weight_scale_inv":
            return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [self.block_out, self.block_in]}
        if self.hf_scale == "weight_scale":
            weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
            return {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": weights}}}
        if self.hf_scale == "q8_0_scale":
            return {"quant_method": GGUF_Q8_0_METHOD}
        return {"quant_method": OWN_METHOD, "weights": self.weights, "block_in": self.block_in}


# llama.cpp's Q8_0: int8 values, a scale per block of 32 input columns (the reader names it).
GGUF_Q8_0 = WeightQuantization("int8", 32, "q8_0_scale", 1)


def parse_quantization(raw: dict[str, Any] | None) -> WeightQuantization | None:
    """The weights' quantization from a config.json's `quantization_config` (None: float
    weights): Qwen-style block FP8 (`quant_method: fp8`), compressed-tensors FP8 with per-channel
    or per-tensor weight scales, and this project's own."""
    if raw is None:
        return None
    method = raw.get("quant_method")
    if method == OWN_METHOD:
        weights, block = raw.get("weights"), raw.get("block_in")
        if weights not in WEIGHT_DTYPES or not (block is None or (isinstance(block, int) and block > 0)):
            raise QuantizationError(f"quantization_config {raw} is malformed; convert the float checkpoint again.")
        return WeightQuantization(weights, block)
    if method == "fp8":
        if raw.get("fmt", "e4m3") != "e4m3":
            raise QuantizationError(f"fp8 format {raw.get('fmt')!r} is not supported; only e4m3 is.")
        block = raw.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise QuantizationError("an fp8 quantization_config without a [out, in] weight_block_size is not "
                                    "supported; use a block-quantized (Qwen-style) FP8 checkpoint.")
        return WeightQuantization("fp8", block[1], "weight_scale_inv", block[0])
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == GGUF_Q8_0_METHOD:
        return GGUF_Q8_0
    if method == "mxfp4":  # gpt-oss's experts: dequantized at conversion (`hf_reader.mxfp4_dequantized`)
        return None
    raise QuantizationError(f"quantization method {method!r} is not supported; supported are Qwen-style fp8, "
                            "compressed-tensors fp8, and float checkpoints (convert --quantize int8|fp8).")


def left_in_float(raw: dict[str, Any] | None, module: str) -> bool:
    """Whether a published `quantization_config` keeps `module` (a HF module name) in float:
    transformers' `modules_to_not_convert` (names contained in the module's), compressed-tensors'
    `ignore` (names, or `re:` patterns the whole name matches)."""
    if not raw:
        return False
    if any(name in module for name in raw.get("modules_to_not_convert") or ()):
        return True
    return any(re.fullmatch(entry[3:], module) if entry.startswith("re:") else entry == module
               for entry in raw.get("ignore") or ())


def _compressed_tensors(raw: dict[str, Any]) -> WeightQuantization:
    groups = list((raw.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    if len(weights) != 1 or weights[0].get("num_bits") != 8 or weights[0].get("type") != "float":
        raise QuantizationError("only compressed-tensors checkpoints with one group of 8-bit float weights "
                                "(FP8) are supported.")
    if weights[0].get("strategy") not in ("channel", "tensor"):
        raise QuantizationError(f"compressed-tensors weight strategy {weights[0].get('strategy')!r} is not "
                                "supported; per-channel and per-tensor FP8 are.")
    return WeightQuantization("fp8", hf_scale="weight_scale")


def hf_scales(stored, quantization: WeightQuantization, out_features: int) -> np.ndarray:
    """A HF scale tensor ([ceil(out / block_out), rows], [out, 1], or one per-tensor value) as
    float32 scales [rows, out]: each stored scale repeated over its block's output columns."""
    stored = np.asarray(stored, np.float32)
    if stored.size == 1:
        return np.full((1, out_features), stored.reshape(()), np.float32)
    return np.repeat(stored.reshape(stored.shape[0], -1), quantization.block_out, axis=0)[:out_features].T.copy()


def hf_dequantized(values_OI, stored_scale, quantization: WeightQuantization) -> np.ndarray:
    """A published 8-bit weight [out, in] and the scale tensor beside it as the float32 weight
    they stand for."""
    out_features = values_OI.shape[0]
    scales = hf_scales(stored_scale, quantization, out_features)
    return np.asarray(dequantize(np.asarray(values_OI).T, scales, quantization.block_in, jnp.float32)).T


def dequantized_on_read(raw: dict[str, Any], cfg) -> WeightQuantization | None:
    """The quantization of a published 8-bit checkpoint whose parsed config (`cfg`) dropped it
    to describe a float model (`config.parse_target_config`: layers with no 8-bit form; or
    `hf_to_nnx`: a hybrid checkpoint leaving products in float), so its weights are
    dequantized as they are read; None for every other checkpoint."""
    if cfg.quantization is not None:
        return None
    published = parse_quantization(published_quantization_config(raw))
    return published if published is not None and published.hf_scale is not None else None


def published_quantization_config(raw: dict[str, Any]) -> dict[str, Any] | None:
    """A config.json's `quantization_config`, or its text config's (vision-language checkpoints)."""
    return raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")


def without_quantization(raw: dict[str, Any]) -> dict[str, Any]:
    """A config.json's dict without its quantization_config (nor its text config's)."""
    raw = {key: value for key, value in raw.items() if key != "quantization_config"}
    if isinstance(raw.get("text_config"), dict):
        raw["text_config"] = without_quantization(raw["text_config"])
    return raw


def hf_scale_shape(quantization: WeightQuantization, in_features: int, out_features: int) -> tuple[int, int]:
    """The shape of a HF scale tensor beside a weight [out, in] (a per-tensor scale aside)."""
    return math.ceil(out_features / quantization.block_out), quantization.scale_rows(in_features)


def quantize(w_IO, quantization: WeightQuantization) -> tuple[jax.Array, jax.Array]:
    """(8-bit values [I, O], float32 scales [rows, O]) of a float weight, each block of input
    rows scaled so its largest magnitude per column is the 8-bit type's largest (round to
    nearest); on the array's device."""
    w = jnp.asarray(w_IO, jnp.float32)
    rows, block = quantization.scale_rows(w.shape[0]), quantization.block_in or w.shape[0]
    blocks = jnp.pad(w, ((0, rows * block - w.shape[0]), (0, 0))).reshape(rows, block, w.shape[1])
    dtype, largest = WEIGHT_DTYPES[quantization.weights]
    scale = jnp.abs(blocks).max(axis=1) / largest
    scale = jnp.where(scale > 0, scale, 1.0)
    values = blocks / scale[:, None, :]
    values = jnp.clip(jnp.round(values), -largest, largest) if quantization.weights == "int8" else values
    return values.reshape(-1, w.shape[1])[: w.shape[0]].astype(dtype), scale


def dequantize(values_IO, block_scales, block_in: int | None, dtype):
    """The float weight [I, O] in `dtype` that the 8-bit values and scales stand for (what
    the products are tested against)."""
    scale_IO = block_scales if block_in is None else jnp.repeat(block_scales, block_in, axis=0)[: values_IO.shape[0]]
    return (values_IO.astype(jnp.float32) * scale_IO).astype(dtype)


class QuantizedLinear(nnx.Module):
    """`nnx.Linear`'s product over an 8-bit kernel [in, out] and float32 scales [rows, out].

    Checkpoints, converters and meshes see the kernel [in, out]; a model loaded for one GPU
    holds it [out, in] instead (`to_output_major`), the layout the Pallas kernel reads fastest
    at decode and verify shapes (bench/LESSONS.md)."""

    def __init__(self, in_features: int, out_features: int, quantization: WeightQuantization, *,
                 axes: tuple[str | None, str | None], use_bias: bool, dtype, dot_general):
        def param(shape, param_dtype, param_axes):
            return nnx.Param(jnp.zeros(shape, param_dtype), out_sharding=param_axes, eager_sharding=False)

        self.dot_general, self.block_in = dot_general, quantization.block_in
        self.kernel = param((in_features, out_features), quantization.dtype, axes)
        self.scale = param((quantization.scale_rows(in_features), out_features), jnp.float32, (None, axes[1]))
        self.bias = param((out_features,), dtype, (axes[1],)) if use_bias else None
        self.output_major = False  # the kernel held [out, in]

    def _to_output_major(self) -> None:
        """Hold the kernel [out, in] from now on (`params_of` gives it back [in, out]); only
        through the model's `to_output_major`, which knows whether a program has read the model."""
        if not self.output_major:
            self.kernel.value = jnp.transpose(self.kernel[...])
            self.output_major = True

    def __call__(self, x, kernels: Kernels = REFERENCE):
        """x @ the weight; `kernels.quantized` (resolved) picks the product's implementation."""
        product = kernels.quantized_matmul(self.dot_general)
        y = product(x, self.kernel[...], self.scale[...], self.block_in, transposed=self.output_major)
        return y if self.bias is None else y + self.bias[...]


def to_output_major(target: nnx.Module) -> None:
    """Every 8-bit layer of a target with its kernel held [out, in], before the model's first
    use (programs read a model's structure once: `flat_models`). Targets only: a drafter's
    context K/V product stacks its kernels' [in, out] columns."""
    if target.cfg.kind != "target":
        raise ValueError("only a target's 8-bit kernels can be held [out, in]; a drafter keeps [in, out].")
    if has_run(target):
        raise ValueError("this model has run already, and its programs would not see its weights' new layout; "
                         "load it again and lay out its weights before using it.")
    for _, module in nnx.iter_graph(target):
        if isinstance(module, QuantizedLinear):
            module._to_output_major()


def params_of(model: nnx.Module) -> dict:
    """The parameters of `model` as a nested dict (`nnx.to_pure_dict` layout) as checkpoints,
    converters and meshes take them: 8-bit kernels [in, out] whatever layout the model holds
    (those held [out, in] come back as host arrays: no second copy on the device)."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for path, module in nnx.iter_graph(model):
        if isinstance(module, QuantizedLinear) and module.output_major:
            node = functools.reduce(operator.getitem, path, params)
            node["kernel"] = np.asarray(jax.device_get(node["kernel"])).T
    return params
