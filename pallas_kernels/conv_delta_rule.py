"""The gated delta rule with its inputs prepared inside the same kernel (Triton lowering on a
GPU, interpret mode on CPU): Qwen3.5's short causal convolution, SiLU and the queries' and
keys' L2 norms computed by the programs that walk the rule (`delta_rule`), from the
projected channels.

Between a gated-delta-net layer's input product and its rule, a decode or verify step
otherwise runs about six small XLA kernels a layer for these (the convolution over each
token's last `taps` inputs, the cast, the norms' sums and scalings, the slices): launches that cost more
than their bytes (bench/results). Here each program computes, for each token it walks, its
key head's query and key channels and its own value columns: convolved over the row's last
`taps` inputs (from the row's history for its first taps - 1 tokens), SiLU, cast to the
channels' dtype and back to float32, queries and keys L2-normed and the queries scaled by
key dim^-1/2, in the order `gated_delta_rule.causal_conv_taps` and `prepared_queries_keys`
compute them. The programs of one key head repeat that work (a few hundred multiply-adds a
token); the rule's walk is `delta_rule`'s, so each token's inputs still load before a run's
chain of updates.

Channels are one device's [q | k | v] (key heads x key dim twice, then value heads x value
dim); rows are `[start, end)` token ranges of the batch, each continuing its `history_RKC`
row and its state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.delta_rule import BLOCK_V, make_advance, rule_call, walk_row

L2_EPS = 1e-6  # the queries' and keys' L2 norm (as the jnp path's)


def _kernel(mixed_ref, history_ref, weight_ref, g_ref, beta_ref, state_in_ref, starts_ref, ends_ref, commits_ref,
            out_ref, state_ref, *, repeat: int, key_dim: int, key_width: int, value_dim: int, block_v: int, taps: int,
            unroll: int, write_out: bool):
    row, head, col_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = starts_ref[row]
    groups = ((head // repeat * key_dim, key_dim),                                # queries
              (key_width + head // repeat * key_dim, key_dim),                    # keys
              (2 * key_width + head * value_dim + col_block * block_v, block_v))  # this program's values
    weights = [[weight_ref[pl.ds(first, width), j].astype(jnp.float32) for j in range(taps)]
               for first, width in groups]

    def convolved(t, first, width, weight):
        """SiLU of the convolution of channels [first, first + width) at token t."""
        place = t - start
        total = None
        for j in range(taps):
            back = taps - 1 - j  # tap j multiplies the input `back` tokens before t
            from_batch = mixed_ref[jnp.maximum(t - back, 0), pl.ds(first, width)]
            from_history = history_ref[row, jnp.clip(taps - 1 + place - back, 0, taps - 2), pl.ds(first, width)]
            term = jnp.where(place >= back, from_batch, from_history).astype(jnp.float32) * weight[j]
            total = term if total is None else total + term
        return jax.nn.silu(total).astype(mixed_ref.dtype).astype(jnp.float32)

    def token(t):
        q_K, k_K, v_V = (convolved(t, first, width, weight) for (first, width), weight in zip(groups, weights))
        q_K = q_K * jax.lax.rsqrt(jnp.sum(q_K * q_K) + L2_EPS) * key_dim ** -0.5
        k_K = k_K * jax.lax.rsqrt(jnp.sum(k_K * k_K) + L2_EPS)
        return k_K, q_K, v_V, g_ref[t, head], beta_ref[t, head]

    cols = pl.ds(col_block * block_v, block_v)
    state_KV = walk_row(start, ends_ref[row], state_in_ref[row, head, :, cols], token,
                        make_advance(out_ref, head, cols, write_out), unroll)

    @pl.when(commits_ref[row] != 0)  # else the row's state stays as it came in (the output aliases it)
    def _():
        state_ref[row, head, :, cols] = state_KV


def conv_delta_rule_pallas(mixed_TC, history_RKC, conv_weight_C1K, g_TH, beta_TH, state_RHKV, starts_R, ends_R, *,
                           num_key_heads: int, outputs: bool = True, commits_R=None, block_v: int = BLOCK_V,
                           unroll: int | None = None, num_warps: int = 4, interpret: bool | None = None):
    """(out [T, value heads, value dim] float32, state [R, value heads, key dim, value dim]):
    `delta_rule_pallas` over the queries, keys and values that the causal convolution of
    `mixed_TC` [T, C] (weights `conv_weight_C1K` [C, 1, taps], each row continuing its
    `history_RKC` [R, taps - 1, C] of earlier inputs), SiLU and the L2 norms give; `g_TH`,
    `beta_TH` float32 per value head. Same conventions as `delta_rule_pallas` (`outputs`,
    `commits_R`, `block_v`, `unroll`, `interpret`)."""
    T, C = mixed_TC.shape
    R, H, K, V = state_RHKV.shape
    taps = conv_weight_C1K.shape[-1]
    key_width = num_key_heads * K
    block_v = min(block_v, V)
    if C != 2 * key_width + H * V or history_RKC.shape != (R, taps - 1, C) or conv_weight_C1K.shape != (C, 1, taps):
        raise ValueError(f"channels {mixed_TC.shape}, history {history_RKC.shape} and weights {conv_weight_C1K.shape} "
                         f"do not fit {num_key_heads} key heads x {K} and {H} value heads x {V} over {R} rows.")
    if taps < 2 or H % num_key_heads:
        raise ValueError(f"need a convolution of at least 2 taps (got {taps}) and value heads ({H}) a multiple of "
                         f"the key heads ({num_key_heads}).")
    return rule_call(functools.partial(_kernel, repeat=H // num_key_heads, key_dim=K, key_width=key_width, value_dim=V,
                                       block_v=block_v, taps=taps),
                     (mixed_TC, history_RKC, conv_weight_C1K.reshape(C, taps), g_TH, beta_TH), state_RHKV, starts_R,
                     ends_R, num_tokens=T, key_dim=K, block_v=block_v, unroll=unroll, outputs=outputs,
                     commits_R=commits_R, num_warps=num_warps, interpret=interpret, name="conv_gated_delta_rule")
