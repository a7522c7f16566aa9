"""The gated delta rule's inputs as one Pallas kernel (Triton lowering on a GPU, interpret mode
on CPU): Qwen3.5's short causal convolution over a ragged batch, SiLU, the cast to the
channels' dtype and back to float32, the queries' and keys' L2 norms and the queries' key
dim^-1/2 scale, for every token of a step at once.

Between a gated-delta-net layer's input product and its rule, a verify or prefill step
otherwise runs these as about ten small XLA kernels a layer (gathers of each tap's input from
the batch or the row's history, the products and sum, SiLU and casts, the norms' sums and
scalings, the slices into q, k and v), each costing more in launch and latency than in bytes
(bench/results). Here a program per (block of tokens, channel block of one key dim) loads
its tokens' taps, from the batch or, for a row's first taps - 1 tokens, from the row's
history, and writes its block of q, k or v, in the order `gated_delta_rule.causal_conv_taps`
and `prepared_queries_keys` compute them. A channel block is one query head, one key head or
key dim value channels: channels are one device's [q | k | v] (key heads x key dim twice,
then value heads x value dim).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import is_pow2, runs_interpreted

L2_EPS = 1e-6  # the queries' and keys' L2 norm (as the jnp path's)
MAX_BLOCK_T = 16  # tokens a program at most: a verify block's


def _kernel(mixed_ref, history_ref, weight_ref, rows_ref, places_ref, q_ref, k_ref, v_ref, *, block_t: int,
            width: int, num_key_heads: int, taps: int):
    token_block, channel_block = pl.program_id(0), pl.program_id(1)
    t = token_block * block_t + jnp.arange(block_t)
    rows, places = rows_ref[t], places_ref[t]
    cols = pl.ds(channel_block * width, width)
    total = None
    for j in range(taps):
        back = taps - 1 - j  # tap j multiplies the input `back` tokens before each token
        from_batch = mixed_ref[jnp.maximum(t - back, 0), cols]
        from_history = history_ref[rows, jnp.clip(taps - 1 + places - back, 0, taps - 2), cols]
        term = jnp.where((places >= back)[:, None], from_batch, from_history).astype(jnp.float32)
        term = term * weight_ref[cols, j].astype(jnp.float32)[None, :]
        total = term if total is None else total + term
    x = jax.nn.silu(total).astype(mixed_ref.dtype).astype(jnp.float32)

    def normed(x):
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS)

    @pl.when(channel_block < num_key_heads)
    def _():
        q_ref[t, pl.ds(channel_block * width, width)] = normed(x) * width ** -0.5

    @pl.when((channel_block >= num_key_heads) & (channel_block < 2 * num_key_heads))
    def _():
        k_ref[t, pl.ds((channel_block - num_key_heads) * width, width)] = normed(x)

    @pl.when(channel_block >= 2 * num_key_heads)
    def _():
        v_ref[t, pl.ds((channel_block - 2 * num_key_heads) * width, width)] = x


def rule_inputs_pallas(mixed_TC, history_RKC, conv_weight_C1K, rows_T, places_T, *, num_key_heads: int,
                       key_dim: int, num_warps: int = 4, interpret: bool | None = None):
    """(q [T, key heads, key dim], k [T, key heads, key dim], v [T, value heads x value dim
    as C - 2 x key heads x key dim flat columns]) float32: each token's convolution over its
    row's last taps inputs (`mixed_TC` [T, C], or for a token `places_T[t]` < taps - 1 into its
    row `rows_T[t]`, that row's `history_RKC` [R, taps - 1, C]; weights `conv_weight_C1K` [C,
    1, taps]), SiLU, cast to `mixed_TC`'s dtype and back, q and k L2-normed, q scaled by key
    dim^-1/2. Tokens in no row may carry any row in range and any place; their values are
    not read."""
    T, C = mixed_TC.shape
    taps = conv_weight_C1K.shape[-1]
    key_width = num_key_heads * key_dim
    value_width = C - 2 * key_width
    if not is_pow2(key_dim) or value_width <= 0 or value_width % key_dim:
        raise ValueError(f"the rule-inputs kernel needs a power-of-two key dim ({key_dim}) and value channels "
                         f"({value_width} of {C}) in blocks of it; use Kernels(rule_inputs=\"reference\").")
    if taps < 2 or history_RKC.shape[1:] != (taps - 1, C) or conv_weight_C1K.shape != (C, 1, taps):
        raise ValueError(f"history {history_RKC.shape} and weights {conv_weight_C1K.shape} do not fit {C} channels "
                         f"and a convolution of at least 2 taps.")
    block_t = min(MAX_BLOCK_T, T & -T)  # the largest power of two dividing T: no token past the end
    q, k, v = pl.pallas_call(
        functools.partial(_kernel, block_t=block_t, width=key_dim, num_key_heads=num_key_heads, taps=taps),
        out_shape=(jax.ShapeDtypeStruct((T, key_width), jnp.float32),
                   jax.ShapeDtypeStruct((T, key_width), jnp.float32),
                   jax.ShapeDtypeStruct((T, value_width), jnp.float32)),
        grid=(T // block_t, C // key_dim),
        interpret=runs_interpreted(interpret),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="gated_delta_rule_inputs",
    )(mixed_TC, history_RKC, conv_weight_C1K.reshape(C, taps), rows_T.astype(jnp.int32), places_T.astype(jnp.int32))
    return q.reshape(T, num_key_heads, key_dim), k.reshape(T, num_key_heads, key_dim), v
