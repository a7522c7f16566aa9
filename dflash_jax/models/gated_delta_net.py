"""Qwen3.5's gated-delta-net decoder layer in Flax NNX: the linear-attention mixer's
projections and output, with its recurrence delegated to the caller's `attend` (as attention
layers delegate theirs), which receives `gated_delta_rule.RecurrentInputs` and returns the
rule's output; the layer never sees a state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.config_types import TargetConfig
from dflash_jax.gated_delta_rule import RecurrentInputs
from dflash_jax.kernels import REFERENCE, Kernels
from dflash_jax.layers import MLP, RMSNorm, apply_linear, linear


class GatedDeltaNet(nnx.Module):
    """The mixer: [q | k | v] for the convolution, the output gate z, the write strength
    beta = sigmoid(b) and the decay g = -exp(A_log) softplus(a + dt_bias) per value head; after
    the rule, an RMSNorm per value head times silu(z), then `out_proj`. On a mesh its heads
    split like attention heads: the convolution's channels in `shards` groups of
    [q | k | v] of a shard's heads (`shard_layout`), the value heads' columns in order."""

    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs):
        la = self.cfg = cfg.linear_attention
        d, value_width = cfg.hidden_size, la.num_value_heads * la.value_head_dim
        quantization = cfg.quantization  # the three wide products; b and a (a column a head) stay float
        self.in_proj_qkv = linear(d, la.conv_dim, ("embed", "qkv_heads"), use_bias=False, dtype=dtype, rngs=rngs,
                                  quantization=quantization)
        self.in_proj_z = linear(d, value_width, ("embed", "q_heads"), use_bias=False, dtype=dtype, rngs=rngs,
                                quantization=quantization)
        heads = la.num_value_heads
        self.in_proj_b = linear(d, heads, ("embed", "q_heads"), use_bias=False, dtype=dtype, rngs=rngs)
        self.in_proj_a = linear(d, heads, ("embed", "q_heads"), use_bias=False, dtype=dtype, rngs=rngs)
        conv_init = nnx.initializers.normal(0.2)(rngs.params(), (la.conv_dim, 1, la.conv_kernel_size), dtype)
        self.conv1d_weight = nnx.Param(conv_init, out_sharding=("qkv_heads", None, None), eager_sharding=False)
        self.dt_bias = nnx.Param(jnp.ones((heads,), dtype), out_sharding=("q_heads",), eager_sharding=False)
        self.A_log = nnx.Param(jnp.zeros((heads,), dtype), out_sharding=("q_heads",), eager_sharding=False)
        self.norm = RMSNorm(la.value_head_dim, cfg.rms_norm_eps, axis_name="head_dim", dtype=dtype)
        self.out_proj = linear(value_width, d, ("q_heads", "embed"), use_bias=False, dtype=dtype, rngs=rngs,
                               quantization=quantization)
        self.shards = 1  # column groups of in_proj_qkv and conv1d_weight: [q_g | k_g | v_g] per shard g
        self.mesh = None  # the mesh the model is placed on (its heads split when shards > 1)

    def project(self, h_TD, kernels: Kernels = REFERENCE) -> tuple[RecurrentInputs, jax.Array]:
        """(the recurrence's inputs, the output gate z [T, Hv, value dim])."""
        la = self.cfg
        a_TV = apply_linear(self.in_proj_a, h_TD, kernels).astype(jnp.float32)
        g_TV = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a_TV + self.dt_bias[...].astype(jnp.float32))
        beta_TV = jax.nn.sigmoid(apply_linear(self.in_proj_b, h_TD, kernels).astype(jnp.float32))
        inputs = RecurrentInputs(apply_linear(self.in_proj_qkv, h_TD, kernels), g_TV, beta_TV, self.conv1d_weight[...], la,
                                 self.shards, self.mesh)
        z = apply_linear(self.in_proj_z, h_TD, kernels).reshape(h_TD.shape[0], la.num_value_heads, la.value_head_dim)
        return inputs, z

    def finish(self, out_THV, z_THV, dtype, kernels: Kernels = REFERENCE):
        """`out_proj` of the rule's output normed per head and gated by silu(z), in `dtype`."""
        normed = self.norm(out_THV.astype(jnp.float32)).astype(dtype)
        gated = (normed.astype(jnp.float32) * jax.nn.silu(z_THV.astype(jnp.float32))).astype(dtype)
        return apply_linear(self.out_proj, gated.reshape(gated.shape[0], -1), kernels)


class GatedDeltaNetLayer(nnx.Module):
    """Pre-norm gated delta net + SwiGLU MLP, called like `layers.DecoderLayer`: `attend`
    receives `RecurrentInputs` instead of attention heads. The config's `quantization` makes
    the mixer's q/k/v, z and out products and the MLP's 8-bit (`QuantizedLinear`)."""

    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs, mlp: nnx.Module | None = None):
        """`mlp`: the layer's feed-forward when it is not the dense SwiGLU (routed experts)."""
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, axis_name="embed", dtype=dtype)
        self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, axis_name="embed", dtype=dtype)
        self.mlp = mlp or MLP(cfg.hidden_size, cfg.intermediate_size, use_bias=False, dtype=dtype, rngs=rngs,
                              quantization=cfg.quantization)

    def __call__(self, x_TD, delta_TD, positions_T, attend, kernels: Kernels = REFERENCE):
        x_TD, h_TD = self.input_layernorm.add_norm(x_TD, delta_TD, kernels)
        inputs, z = self.linear_attn.project(h_TD, kernels)
        mixed_TD = self.linear_attn.finish(attend(inputs), z, x_TD.dtype, kernels)
        x_TD, h_TD = self.post_attention_layernorm.add_norm(x_TD, mixed_TD, kernels)
        return x_TD, self.mlp(h_TD, kernels)
