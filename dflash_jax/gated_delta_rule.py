"""Qwen3.5's linear attention as plain jnp: the short causal convolution over the projected
[q | k | v] channels and the gated delta rule, each from a given state (zero at a sequence's
start) to the state after its last token.

Per token, per value head, with S a [key dim, value dim] state in float32:
S <- exp(g) S; S <- S + k (x) beta (v - S^T k); out = S^T q (q and k L2-normed, q scaled by
key dim^-1/2): the reference the dense forward runs, one `lax.scan` over tokens
(`pallas_kernels.delta_rule` holds it and the runtime's kernel).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from dflash_jax.config_types import GatedDeltaNetConfig
from pallas_kernels.delta_rule import delta_rule_reference


@dataclasses.dataclass(frozen=True)
class RecurrentInputs:
    """One gated-delta-net layer's projections, handed to the caller that owns its state
    (as `ProjectedHeads` are for attention): the convolution's input channels [T, C], the
    decay g and write strength beta per value head [T, Hv] (float32), and the layer's
    convolution weights [C, 1, taps] (HF's `conv1d.weight`); `shards` column groups of
    [q | k | v] (one per tensor-parallel shard of `mesh`, `shard_layout`; 1: heads whole)."""

    mixed_TC: jax.Array
    g_TV: jax.Array
    beta_TV: jax.Array
    conv_weight_C1K: jax.Array
    cfg: GatedDeltaNetConfig
    shards: int = 1
    mesh: Mesh | None = None


def causal_conv_taps(taps_TC, weight_C1K):
    """SiLU of a depthwise convolution given, per tap j, the input it multiplies [T, C]
    (`taps_TC[j]` is the input taps - 1 - j rows back), in the input's dtype."""
    weight_KC = jnp.transpose(weight_C1K[:, 0, :]).astype(jnp.float32)
    out = sum(tap.astype(jnp.float32) * weight_KC[j] for j, tap in enumerate(taps_TC))
    return jax.nn.silu(out).astype(taps_TC[0].dtype)


def causal_conv(mixed_TC, weight_C1K, history_KC):
    """The causal convolution of `mixed_TC` [T, C] (its last tap on the row itself),
    `history_KC` [taps - 1, C] the inputs before the first row: (out [T, C], the last
    taps - 1 inputs, the next call's history)."""
    taps, num_tokens = weight_C1K.shape[-1], mixed_TC.shape[0]
    padded = jnp.concatenate([history_KC.astype(mixed_TC.dtype), mixed_TC], axis=0)
    return causal_conv_taps([padded[j: j + num_tokens] for j in range(taps)], weight_C1K), padded[num_tokens:]


def l2_normed(x, eps: float = 1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def prepared_queries_keys(q_THK, k_THK):
    """float32 queries and keys as the rule reads them: L2-normed, q scaled by key dim^-1/2
    (each key head serves value heads / key heads consecutive value heads)."""
    q_THK, k_THK = (x.astype(jnp.float32) for x in (q_THK, k_THK))
    return l2_normed(q_THK) * q_THK.shape[-1] ** -0.5, l2_normed(k_THK)


def gated_delta_rule(q_THK, k_THK, v_THV, g_TH, beta_TH, state_HKV):
    """(out [T, Hv, value dim] float32, the state after the last token [Hv, key dim, value
    dim]). q and k have `num_key_heads` heads, each shared by Hv / that many value heads."""
    q_THK, k_THK = prepared_queries_keys(q_THK, k_THK)
    whole = jnp.zeros((1,), jnp.int32), jnp.full((1,), q_THK.shape[0], jnp.int32)  # one row: every token
    out_THV, state_1HKV = delta_rule_reference(q_THK, k_THK, *(x.astype(jnp.float32) for x in (v_THV, g_TH, beta_TH)),
                                               state_HKV.astype(jnp.float32)[None], *whole)
    return out_THV, state_1HKV[0]


def split_heads(conv_out_TC, cfg: GatedDeltaNetConfig, shards: int = 1):
    """(q [T, Hk, dk], k [T, Hk, dk], v [T, Hv, dv]) of the convolution's output channels,
    laid out as `shards` groups of [q | k | v] of consecutive heads."""
    num_tokens = conv_out_TC.shape[0]
    key_width = cfg.num_key_heads * cfg.key_head_dim // shards
    grouped = conv_out_TC.reshape(num_tokens, shards, -1)
    q, k, v = jnp.split(grouped, [key_width, 2 * key_width], axis=-1)
    return (q.reshape(num_tokens, cfg.num_key_heads, cfg.key_head_dim),
            k.reshape(num_tokens, cfg.num_key_heads, cfg.key_head_dim),
            v.reshape(num_tokens, cfg.num_value_heads, cfg.value_head_dim))


def recur_from_zero(inputs: RecurrentInputs):
    """The layer's output [T, Hv, value dim] (float32) for a whole sequence from its start:
    zero history and zero state (the dense forward)."""
    cfg = inputs.cfg
    history = jnp.zeros((cfg.conv_kernel_size - 1, cfg.conv_dim), inputs.mixed_TC.dtype)
    conv_out_TC, _ = causal_conv(inputs.mixed_TC, inputs.conv_weight_C1K, history)
    state = jnp.zeros((cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim), jnp.float32)
    out, _ = gated_delta_rule(*split_heads(conv_out_TC, cfg, inputs.shards), inputs.g_TV, inputs.beta_TV, state)
    return out
