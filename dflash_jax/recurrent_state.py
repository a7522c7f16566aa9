"""Per-request state of a hybrid target's gated-delta-net layers in the paged runtime, and the
rule over a ragged batch: each batch row (a prefill chunk or a verify block) continues its own
request's state.

A verify block advances the state over drafts the target may reject, so a cycle runs the rule
twice: once over every token of the batch for the outputs (each token sees the state after
the tokens before it in its row), then, once the accepted lengths are known, over the tokens
each row keeps (`advancing_T`: a prefill chunk's all, a verify row's anchor and accepted
drafts) for the state it commits. Rejected drafts leave no trace.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dflash_jax.config_types import TargetConfig
from dflash_jax.gated_delta_rule import RecurrentInputs, causal_conv_taps, prepared_queries_keys, split_heads
from dflash_jax.kernels import Kernels


@functools.partial(jax.tree_util.register_dataclass, data_fields=["history", "delta"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class RecurrentState:
    """Per gated-delta-net layer (in layer order), per slot or batch row: the convolution's last
    taps - 1 inputs [.., taps - 1, C] (the model's dtype) and the delta rule's state
    [.., value heads, key dim, value dim] (float32)."""

    history: tuple[jax.Array, ...]
    delta: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, cfg: TargetConfig, num_slots: int, dtype) -> RecurrentState | None:
        """A zero state for `num_slots` slots, or None for a target without such layers."""
        la = cfg.linear_attention
        if la is None:
            return None
        layers = range(len(la.layers))  # an array per layer: each is donated on its own
        return cls(tuple(jnp.zeros((num_slots, la.conv_kernel_size - 1, la.conv_dim), dtype) for _ in layers),
                   tuple(jnp.zeros((num_slots, la.num_value_heads, la.key_head_dim, la.value_head_dim), jnp.float32)
                         for _ in layers))


def ragged_rule(inputs: RecurrentInputs, history_RKC, delta_RHKV, rows_T, starts_R, advancing_T, kernels: Kernels, *,
                outputs: bool = True):
    """(out [T, value heads, value dim] float32, history [R, taps - 1, C], delta [R, ...]):
    each token t of batch row `rows_T[t]` (rows start at `starts_R`) where `advancing_T` (a
    prefix of each row's tokens) convolved and run through the rule from its row's state,
    which advances over those tokens; the other tokens' outputs are zeros, and so are all
    of them with `outputs=False` (a caller that wants the states alone)."""
    cfg = inputs.cfg
    taps, num_tokens = cfg.conv_kernel_size, inputs.mixed_TC.shape[0]
    index_T = jnp.arange(num_tokens) - starts_R[rows_T]  # each token's place in its row

    def earlier(offset):  # the input `offset` tokens before each token: in the batch, or the row's history
        in_batch = inputs.mixed_TC[jnp.maximum(jnp.arange(num_tokens) - offset, 0)]
        from_history = history_RKC[rows_T, jnp.clip(taps - 1 + index_T - offset, 0, taps - 2)]
        return jnp.where((index_T >= offset)[:, None], in_batch, from_history)

    conv_TC = causal_conv_taps([earlier(taps - 1 - j) for j in range(taps)], inputs.conv_weight_C1K)
    q_THK, k_THK, v_THV = split_heads(conv_TC, cfg)
    kept_R = jnp.zeros(starts_R.shape, jnp.int32).at[rows_T].add(advancing_T.astype(jnp.int32))
    out_THV, delta_RHKV = kernels.delta_rule(*prepared_queries_keys(q_THK, k_THK), v_THV.astype(jnp.float32),
                                             inputs.g_TV, inputs.beta_TV, delta_RHKV.astype(jnp.float32), starts_R,
                                             starts_R + kept_R, outputs=outputs)
    place_RK = kept_R[:, None] - (taps - 1) + jnp.arange(taps - 1)[None, :]  # the new history's places in each row
    history_RKC = jnp.where((place_RK >= 0)[..., None],
                            inputs.mixed_TC[jnp.clip(starts_R[:, None] + place_RK, 0, num_tokens - 1)],
                            history_RKC[jnp.arange(starts_R.shape[0])[:, None], jnp.clip(taps - 1 + place_RK, 0,
                                                                                         taps - 2)])
    return out_THV, history_RKC, delta_RHKV


def advanced_rows(rows: RecurrentState, layer_inputs: tuple[RecurrentInputs, ...], rows_T, starts_R,
                  advancing_T, kernels: Kernels) -> RecurrentState:
    """Each batch row's state after the tokens it keeps (`advancing_T`), from `rows` (its
    state before the batch) and what each layer's rule read in the batch."""
    history, delta = [], []
    for inputs, history_RKC, delta_RHKV in zip(layer_inputs, rows.history, rows.delta):
        _, history_RKC, delta_RHKV = ragged_rule(inputs, history_RKC, delta_RHKV, rows_T, starts_R, advancing_T,
                                                 kernels, outputs=False)
        history.append(history_RKC)
        delta.append(delta_RHKV)
    return RecurrentState(tuple(history), tuple(delta))
