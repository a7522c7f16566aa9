"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, linear layers, MLP,
attention projections and the decoder layer (both models use the same Qwen3/Llama layer).

Parameters carry logical sharding axes (`nnx.with_partitioning`) so a tensor-parallel mesh can
be attached later without touching the modules: "vocab", "embed" (model dim), "q_heads"
(flattened heads x head_dim), "qkv_heads" (query, key and value heads, flattened), "mlp"
(intermediate), "head_dim"; `sharding.param_spec` maps them onto a mesh.

The fused matrices (`qkv_proj`, `gate_up_proj`) hold their columns in `shards` groups, one per
tensor-parallel shard, each in the one-device layout of its own heads or columns: shard g's
slice is [its q | its k | its v], so every shard projects and finishes its heads with no
communication. `shards` is 1 unless `sharding` placed the model on a mesh
(`shard_layout` reorders the columns).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from dflash_jax.config import RopeConfig
from dflash_jax.kernels import REFERENCE, Kernels
from dflash_jax.quantization import QuantizedLinear, WeightQuantization
from pallas_kernels.finish_heads import finish_qkv_reference, rotate
from pallas_kernels.rms_norm import add_rms_norm_reference

_default_kernel_init = nnx.initializers.normal(stddev=0.02)


def logical(initializer, axes: tuple[str | None, ...]):
    """Annotate a parameter with logical axes; sharding is applied later, when a mesh is set."""
    return nnx.with_partitioning(initializer, axes, eager_sharding=False)


# XLA GPU turns a vector x matrix product whose operands hold fewer elements than this into an
# elementwise multiply and a reduce (its dot strength reduction), far below the matrix rate.
XLA_GPU_VECTOR_PRODUCT_LIMIT = 10_000_000
# Narrower one-row products are left to that reduce: as two rows they go to a slower cuBLAS call.
MIN_TWO_ROW_COLUMNS = 64


def runs_as_two_rows(lhs, rhs, dimension_numbers, backend: str, *, converted: bool = False) -> bool:
    """Whether `dot_general` runs this one-row product as two rows on `backend` (its docstring);
    `converted`: `rhs` is converted from 8 bits inside the product."""
    (lhs_contract, _), (lhs_batch, _) = dimension_numbers
    if not (lhs.ndim == 2 and not lhs_batch and lhs.shape[1 - lhs_contract[0]] == 1):
        return False
    if backend == "cpu":
        return lhs.dtype == jnp.bfloat16
    return backend == "gpu" and (converted or (lhs.size + rhs.size < XLA_GPU_VECTOR_PRODUCT_LIMIT
                                               and rhs.size // lhs.size >= MIN_TWO_ROW_COLUMNS))


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, converted=False,
                **kwargs):
    """`lax.dot_general` for the models' products (layers, LM head, drafter context).

    A single row runs as two (the result's first row kept) where the backend would otherwise
    leave its matrix kernels (`runs_as_two_rows`): on a GPU, a one-row product that XLA
    strength-reduces (`XLA_GPU_VECTOR_PRODUCT_LIMIT`: a decode step's o_proj and router on
    Qwen3-30B-A3B) unless it is narrow, and any whose weight is `converted` from 8 bits inside
    the product (XLA's fused conversion takes a faster kernel for two rows: `bench/results`);
    on a CPU every bfloat16 one, which there also asks for
    a float32 result (cast back): XLA CPU's fast bfloat16 kernels need a float32 result and
    more than one row, and its other bfloat16 paths are an order of magnitude slower (`python
    -m bench.kernels.cpu_products`), so bfloat16 decodes faster than float32 there and a
    few-row verify block costs about what one row does. `python -m
    bench.kernels.one_row_products` times the GPU case.
    """
    backend = jax.default_backend()
    as_two = runs_as_two_rows(lhs, rhs, dimension_numbers, backend, converted=converted)
    if as_two:  # [1, K] (or [K, 1]) -> two rows, then the first row of the result
        (lhs_contract, _), _ = dimension_numbers
        lhs = jnp.concatenate([lhs, jnp.zeros_like(lhs)], axis=1 - lhs_contract[0])
    f32_result = backend == "cpu" and lhs.dtype == jnp.bfloat16
    out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
    out = lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                          preferred_element_type=jnp.float32 if f32_result else preferred_element_type, **kwargs)
    return (out[:1] if as_two else out).astype(out_dtype)


# The 8-bit layers' product without the Pallas kernel (`quantized_matmul_reference`'s dot_general).
converted_dot_general = functools.partial(dot_general, converted=True)


def linear(
    in_features: int,
    out_features: int,
    axes: tuple[str | None, str | None],
    *,
    use_bias: bool,
    dtype,
    rngs: nnx.Rngs,
    quantization: WeightQuantization | None = None,
) -> nnx.Linear | QuantizedLinear:
    """An `nnx.Linear` (kernel `[in, out]`) with logical axes on kernel and bias; with
    `quantization`, a `QuantizedLinear` of the same shape and axes."""
    if quantization is not None:
        return QuantizedLinear(in_features, out_features, quantization, axes=axes, use_bias=use_bias, dtype=dtype,
                               dot_general=converted_dot_general)
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=dtype,
        kernel_init=logical(_default_kernel_init, axes),
        dot_general=dot_general,
        bias_init=logical(nnx.initializers.zeros_init(), (axes[1],)),
        rngs=rngs,
    )


def apply_linear(module: nnx.Linear | QuantizedLinear, x, kernels: Kernels):
    """`module(x)`, an 8-bit one's product as `kernels` (resolved) computes it."""
    return module(x, kernels) if isinstance(module, QuantizedLinear) else module(x)


class RMSNorm(nnx.Module):
    """HF-style RMSNorm: normalise in float32, cast back, then scale by the weight."""

    def __init__(self, dim: int, eps: float, *, axis_name: str, dtype):
        self.eps = eps
        self.weight = nnx.Param(
            jnp.ones((dim,), dtype), out_sharding=(axis_name,), eager_sharding=False
        )

    def __call__(self, x):
        return add_rms_norm_reference(x, None, self.weight[...], self.eps)[1]

    def add_norm(self, x_TD, delta_TD, kernels: Kernels = REFERENCE):
        """(x + delta, this norm of it): a residual-stream update fused with the pre-norm that
        reads it (with `delta_TD` None, (x, norm(x))); `kernels.norm` makes it one Pallas
        kernel (XLA makes three)."""
        return kernels.add_rms_norm(x_TD, delta_TD, self.weight[...], self.eps)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up as one matrix
    [Wgate | Wup] (one product streams both; the converter fills the two column blocks)."""

    def __init__(self, hidden: int, intermediate: int, *, use_bias: bool, dtype, rngs,
                 quantization: WeightQuantization | None = None):
        self.intermediate = intermediate
        self.shards = 1  # column groups of gate_up_proj: [gate_g | up_g] per shard g
        self.gate_up_proj = linear(hidden, 2 * intermediate, ("embed", "mlp"), use_bias=use_bias, dtype=dtype,
                                   rngs=rngs, quantization=quantization)
        self.down_proj = linear(intermediate, hidden, ("mlp", "embed"), use_bias=use_bias, dtype=dtype, rngs=rngs,
                                quantization=quantization)

    def __call__(self, x, kernels: Kernels = REFERENCE):
        gate_up = apply_linear(self.gate_up_proj, x, kernels)
        gate_up = gate_up.reshape(*x.shape[:-1], self.shards, 2, self.intermediate // self.shards)
        gate, up = (gate_up[..., i, :].reshape(*x.shape[:-1], self.intermediate) for i in (0, 1))
        return apply_linear(self.down_proj, jax.nn.silu(gate) * up, kernels)


@functools.lru_cache(maxsize=None)
def rope_frequencies(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [rotary dims // 2] and the cos/sin scale, for every supported type.

    Computed once on the host in float32, the way HF does, so the table is bit-identical
    across backends; the scale is 1 except for YaRN's attention factor. With a
    `partial_rotary_factor` (Qwen3.5) only that share of each head's dimensions rotates: the
    table is that much narrower (`rotate` passes the other dimensions through).
    """
    head_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / np.power(np.float32(rope.theta), exponents)).astype(np.float32)
    if rope.rope_type == "linear":
        return inv_freq / np.float32(rope.get("factor")), 1.0
    if rope.rope_type == "llama3":
        return _llama3_frequencies(rope, inv_freq), 1.0
    if rope.rope_type == "yarn":
        return _yarn_frequencies(rope, head_dim, inv_freq)
    return inv_freq, 1.0


def _llama3_frequencies(rope: RopeConfig, inv_freq: np.ndarray) -> np.ndarray:
    """Llama 3.1: long wavelengths divided by `factor`, a smooth ramp in between."""
    factor = rope.get("factor")
    low_freq_factor, high_freq_factor = rope.get("low_freq_factor"), rope.get("high_freq_factor")
    old_len = rope.get("original_max_position_embeddings")
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high_freq_factor) & (wavelen <= old_len / low_freq_factor)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_frequencies(rope: RopeConfig, head_dim: int, inv_freq: np.ndarray):
    """YaRN: interpolate low frequencies, keep high ones, ramp between; scale cos/sin."""
    factor = rope.get("factor")
    old_len = rope.get("original_max_position_embeddings")

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations):
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = correction_dim(rope.get("beta_fast") or 32)
    high = correction_dim(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    blended = (inv_freq / factor) * (1 - keep) + inv_freq * keep
    return blended.astype(np.float32), float(attention_factor)


class Attention(nnx.Module):
    """Q/K/V/O projections with optional per-head q/k RMSNorm (Qwen3) and RoPE.

    It computes no attention itself: `project` hands the caller's `attend` the heads as
    `ProjectedHeads`, which that caller finishes (norm, RoPE) with or without a cache write,
    and `o_proj` takes the result back to the model dimension.
    """

    def __init__(self, cfg, *, qk_norm: bool, dtype, rngs: nnx.Rngs, quantization: WeightQuantization | None = None,
                 sinks: bool = False):
        self.cfg = cfg
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        # Queries, keys and values in one matrix [Wq | Wk | Wv]: on a GPU XLA turns narrow
        # separate k and v products of a decode step into slow multiply + reduce kernels; one
        # product reads them at the matrix rate. The converter fills the columns from HF's
        # q_proj/k_proj/v_proj.
        self.qkv_proj = linear(d, (n + 2 * k) * h, ("embed", "qkv_heads"), use_bias=bias, dtype=dtype, rngs=rngs,
                               quantization=quantization)
        self.o_proj = linear(n * h, d, ("q_heads", "embed"), use_bias=bias, dtype=dtype, rngs=rngs,
                             quantization=quantization)
        self.qk_norm = qk_norm
        self.shards = 1  # column groups of qkv_proj: [q_g | k_g | v_g] per shard g
        if qk_norm:
            self.q_norm = RMSNorm(h, cfg.rms_norm_eps, axis_name="head_dim", dtype=dtype)
            self.k_norm = RMSNorm(h, cfg.rms_norm_eps, axis_name="head_dim", dtype=dtype)
        if sinks:  # gpt-oss: a learned logit per query head in each softmax's denominator
            self.sinks = nnx.Param(jnp.zeros((n,), dtype), out_sharding=("q_heads",), eager_sharding=False)
        if getattr(cfg, "attention_output_gate", False):  # Qwen3.5: the output times sigmoid(gate), per channel
            self.gate_proj = linear(d, n * h, ("embed", "q_heads"), use_bias=bias, dtype=dtype, rngs=rngs,
                                    quantization=quantization)

    def output(self, a_TUH, h_TD, kernels: Kernels = REFERENCE):
        """`o_proj` of the attention output [T, U, H] (gated by sigmoid(gate_proj(h)) where the
        model has an output gate; `h_TD` the layer's normed input)."""
        out_TF = a_TUH.reshape(a_TUH.shape[0], -1)
        if hasattr(self, "gate_proj"):
            out_TF = out_TF * jax.nn.sigmoid(apply_linear(self.gate_proj, h_TD, kernels)).astype(out_TF.dtype)
        return apply_linear(self.o_proj, out_TF, kernels)

    def sinks_U(self):
        """The attention sinks [U] (this shard's heads' on a mesh), or None."""
        return self.sinks[...] if hasattr(self, "sinks") else None

    def finish_kv(self, k_TKH, v_TKH, positions_T):
        """k_norm + RoPE on projected keys; also the drafter's fused context path."""
        if self.qk_norm:
            k_TKH = self.k_norm(k_TKH)
        return apply_rope(k_TKH, positions_T, self.cfg.rope), v_TKH

    def kv_weights(self):
        """The key and value columns of `qkv_proj` per shard: (kernel [D, shards, 2K/shards, H],
        its scales [rows, shards, 2K/shards, H] if it is 8-bit else None, bias [shards,
        2K/shards, H] or None), each shard's keys before its values."""
        cfg, g = self.cfg, self.shards
        local_q = cfg.num_heads // g

        def kv_columns(param):  # [..., (U + 2K) * H] -> [..., shards, 2K/shards, H]
            return param[...].reshape(*param.shape[:-1], g, -1, cfg.head_dim)[..., local_q:, :]

        scale = kv_columns(self.qkv_proj.scale) if isinstance(self.qkv_proj, QuantizedLinear) else None
        bias = kv_columns(self.qkv_proj.bias) if cfg.attention_bias else None
        return kv_columns(self.qkv_proj.kernel), scale, bias

    def project(self, x_TD, positions_T, kernels: Kernels = REFERENCE) -> ProjectedHeads:
        """The q/k/v product of `x_TD`, heads not yet normed or rotated (`ProjectedHeads`)."""
        cfg = self.cfg
        qkv_TYH = apply_linear(self.qkv_proj, x_TD, kernels)
        qkv_TYH = qkv_TYH.reshape(-1, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        return ProjectedHeads(qkv_TYH, positions_T, self)

    def finish_args(self, positions_T) -> tuple:
        """(cos, sin, q-norm weight, k-norm weight, eps) for `pallas_kernels.finish_heads`."""
        weights = (self.q_norm.weight[...], self.k_norm.weight[...]) if self.qk_norm else (None, None)
        return (*rope_table(positions_T, self.cfg.rope, self.cfg.head_dim), *weights, self.cfg.rms_norm_eps)


@dataclasses.dataclass(frozen=True)
class ProjectedHeads:
    """One layer's query, key and value heads straight out of `qkv_proj` ([T, U + 2K, H]), not
    yet normed or rotated. The caller that owns the cache finishes them: `finish()` for dense
    attention; `steps.attend_paged` writes keys and values to a paged cache as well, through
    `kernels.finish_heads` (one Pallas kernel on a GPU instead of ~7 small XLA kernels)."""

    qkv_TYH: jax.Array
    positions_T: jax.Array
    attention: Attention

    def finish(self):
        """(queries [T, U, H], keys [T, K, H], values [T, K, H]), normed and rotated (each
        shard's heads finished on their own, then laid side by side)."""
        attention, shards = self.attention, self.attention.shards
        args = attention.finish_args(self.positions_T)
        num_tokens, _, head_dim = self.qkv_TYH.shape
        qkv_TsYH = self.qkv_TYH.reshape(num_tokens, shards, -1, head_dim)  # s: shards, Y: a shard's heads
        finish = functools.partial(finish_qkv_reference, num_heads=attention.cfg.num_heads // shards)
        heads = jax.vmap(lambda qkv_TYH: finish(qkv_TYH, *args), in_axes=1, out_axes=1)(qkv_TsYH)
        return tuple(x.reshape(num_tokens, -1, head_dim) for x in heads)


# attend(layer_idx, heads) -> attention output [T, U, H]
AttendFn = Callable[[int, ProjectedHeads], jax.Array]


def finishing(attend_qkv: Callable) -> AttendFn:
    """An `attend(layer_idx, heads)` from a dense `attend_qkv(layer_idx, q, k, v)` (no cache)."""
    return lambda layer_idx, heads: attend_qkv(layer_idx, *heads.finish())


class DecoderLayer(nnx.Module):
    """Pre-norm attention + SwiGLU MLP; attention itself goes through `attend(heads)`. The
    config's `quantization` makes its four products 8-bit (`QuantizedLinear`)."""

    def __init__(self, cfg, *, qk_norm: bool, mlp_bias: bool, dtype, rngs: nnx.Rngs, mlp: nnx.Module | None = None,
                 sinks: bool = False):
        """`mlp`: the layer's feed-forward when it is not the dense SwiGLU (routed experts), any
        module called as `mlp(x, kernels)`; `sinks`: attention sinks (gpt-oss)."""
        quantization = cfg.quantization
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, axis_name="embed", dtype=dtype)
        self.self_attn = Attention(cfg, qk_norm=qk_norm, dtype=dtype, rngs=rngs, quantization=quantization,
                                   sinks=sinks)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, axis_name="embed", dtype=dtype)
        self.mlp = mlp or MLP(cfg.hidden_size, cfg.intermediate_size, use_bias=mlp_bias, dtype=dtype, rngs=rngs,
                              quantization=quantization)

    def __call__(self, x_TD, delta_TD, positions_T, attend, kernels: Kernels = REFERENCE):
        """(x, delta) -> (x', delta'). The layer's input is x + delta (delta None: x), summed by
        its first norm; x' is the residual stream after attention and delta' the MLP's update.
        The layer's output x' + delta' is left for the norm that reads it next to sum (the
        next layer's first, or the model's final norm): one kernel with that norm on a GPU."""
        x_TD, h_TD = self.input_layernorm.add_norm(x_TD, delta_TD, kernels)
        a_TUH = attend(self.self_attn.project(h_TD, positions_T, kernels))
        x_TD, h_TD = self.post_attention_layernorm.add_norm(x_TD, self.self_attn.output(a_TUH, h_TD, kernels), kernels)
        return x_TD, self.mlp(h_TD, kernels)


def rope_table(positions_T, rope: RopeConfig, head_dim: int):
    """(cos, sin) [T, Z] (Z = head_dim / 2) float32 of `positions_T`'s angles, times the rope scale."""
    inv_freq, scale = rope_frequencies(rope, head_dim)
    angles_TZ = positions_T.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(angles_TZ) * scale, jnp.sin(angles_TZ) * scale


def apply_rope(x_TUH, positions_T, rope: RopeConfig):
    """Rotate `x_TUH` ([tokens, heads, head_dim]) by the angles of `positions_T` (neox style)."""
    return rotate(x_TUH, *rope_table(positions_T, rope, x_TUH.shape[-1]))
