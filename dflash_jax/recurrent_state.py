"""Per-request state of a hybrid target's gated-delta-net layers in the paged runtime, and the
rule over a ragged batch: each batch row (a prefill chunk or a verify block) continues its own
request's state.

A verify block advances the state over drafts the target may reject, so a cycle with drafts
runs the rule twice: once over every token of the batch for the outputs (each token sees the
state after the tokens before it in its row), which commits the states of the rows that keep
all their tokens (prefill chunks) and leaves the verify rows' as they were; then, once the
accepted lengths are known, over each verify row's anchor and accepted drafts
(`advancing_T`) for the state it commits, over the inputs the first pass prepared
(`RulePass.walk`). Rejected drafts leave no trace, and no state is copied or walked twice.
A step without drafts knows the tokens it keeps beforehand, and its one pass leaves the
states to commit. Long prefill chunks go through the rule in chunks of tokens (products in
place of a walk over every token); decode and verify rows always take the walk.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dflash_jax.config_types import TargetConfig
from dflash_jax.gated_delta_rule import RecurrentInputs, causal_conv_taps, prepared_queries_keys, split_heads
from dflash_jax.kernels import Kernels
from dflash_jax.shard_layout import linear_attention_shards
from dflash_jax.sharding import MODEL, per_shard
from pallas_kernels.chunked_delta_rule import CHUNK, chunked_delta_rule_reference, chunks_for
from pallas_kernels.delta_rule import delta_rule_reference


@functools.partial(jax.tree_util.register_dataclass, data_fields=["history", "delta"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class RecurrentState:
    """Per gated-delta-net layer (in layer order), per slot or batch row: the convolution's last
    taps - 1 inputs [.., taps - 1, C] (the model's dtype) and the delta rule's state
    [.., value heads, key dim, value dim] (float32)."""

    history: tuple[jax.Array, ...]
    delta: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, cfg: TargetConfig, num_slots: int, dtype, mesh: Mesh | None = None) -> RecurrentState | None:
        """A zero state for `num_slots` slots, or None for a target without such layers; on
        `mesh`, split by head as the layers' heads are (the histories by channel group) when
        the heads divide among its shards, else whole on every device."""
        la = cfg.linear_attention
        if la is None:
            return None
        history = jax.ShapeDtypeStruct((num_slots, la.conv_kernel_size - 1, la.conv_dim), dtype)
        delta = jax.ShapeDtypeStruct((num_slots, la.num_value_heads, la.key_head_dim, la.value_head_dim), jnp.float32)
        history_sharding, delta_sharding = cls.shardings(cfg, mesh)

        def zeros(shape, sharding):  # an array per layer: each is donated on its own
            return tuple(jnp.zeros(shape.shape, shape.dtype, device=sharding) for _ in la.layers)

        return cls(zeros(history, history_sharding), zeros(delta, delta_sharding))

    @staticmethod
    def shardings(cfg: TargetConfig, mesh: Mesh | None) -> tuple[NamedSharding | None, NamedSharding | None]:
        """(histories', delta states') shardings on `mesh` (`zeros`' docstring; None off a mesh)."""
        if mesh is None:
            return None, None
        if linear_attention_shards(cfg, mesh.shape[MODEL]) == 1:
            return (NamedSharding(mesh, PartitionSpec()),) * 2
        return NamedSharding(mesh, PartitionSpec(None, None, MODEL)), NamedSharding(mesh, PartitionSpec(None, MODEL))

    def placed(self, cfg: TargetConfig, mesh: Mesh | None) -> RecurrentState:
        """This state constrained to `zeros`' shardings (inside a step program): a step returns
        the state as it took it, and the programs compiled for it take the next one. A
        replicated state's history is otherwise sliced from a split projection, and left split."""
        if mesh is None:
            return self
        history_sharding, delta_sharding = self.shardings(cfg, mesh)
        return RecurrentState(tuple(jax.lax.with_sharding_constraint(h, history_sharding) for h in self.history),
                              tuple(jax.lax.with_sharding_constraint(d, delta_sharding) for d in self.delta))


def recurrent_state_bytes(cfg: TargetConfig, num_slots: int, dtype) -> int:
    """Bytes `RecurrentState.zeros(cfg, num_slots, dtype)` takes on one device (0 without
    gated-delta-net layers)."""
    la = cfg.linear_attention
    if la is None:
        return 0
    history = (la.conv_kernel_size - 1) * la.conv_dim * jnp.dtype(dtype).itemsize
    delta = la.num_value_heads * la.key_head_dim * la.value_head_dim * 4
    return (history + delta) * num_slots * len(la.layers)


@dataclasses.dataclass(frozen=True)
class RulePass:
    """One gated-delta-net layer's rule over a batch, as a commit needs it: the layer's inputs,
    `walk(delta_RHKV, starts_R, ends_R)`, the states after each row's `[start, end)` tokens of
    this batch from `delta_RHKV` (the rule again, over the inputs the pass prepared), and each
    row's state after the tokens that advanced it."""

    inputs: RecurrentInputs
    walk: Callable
    after: tuple[jax.Array, jax.Array]  # (history [R, taps - 1, C], delta [R, value heads, key dim, value dim])
    # after the tokens that advanced each row (the delta as it was in rows that do not commit)


def sharded_rule(inputs: RecurrentInputs, rule, reference, *, outputs: bool = True):
    """`rule` (`delta_rule_reference`'s signature) for the layer of `inputs`: where its heads
    are split over a mesh, run once per shard on the shard's heads (a Pallas kernel included);
    heads left whole on a mesh take `reference`, which XLA partitions."""
    if inputs.mesh is None:
        return functools.partial(rule, outputs=outputs)
    if inputs.shards == 1:
        return functools.partial(reference, outputs=outputs)

    def local(q_THK, k_THK, v_THV, g_TV1, beta_TV1, delta_RHKV, shared):
        starts_R, ends_R, commits_R = shared
        return rule(q_THK, k_THK, v_THV, g_TV1[..., 0], beta_TV1[..., 0], delta_RHKV, starts_R, ends_R,
                    outputs=outputs, commits_R=commits_R)

    split = per_shard(inputs.mesh, local, 6)
    return lambda q, k, v, g, beta, delta, starts, ends, commits_R=None: split(
        q, k, v, g[..., None], beta[..., None], delta, (starts, ends, commits_R))


def sharded_conv_rule(inputs: RecurrentInputs, fused, history_RKC):
    """`walk(delta_RHKV, starts_R, ends_R, outputs=False, commits_R=None)`: `fused`
    (`conv_delta_rule_pallas`) over the layer's channels continuing `history_RKC`; where the
    heads are split over a mesh, once per shard on the shard's channels, heads and states."""
    cfg = inputs.cfg
    if inputs.mesh is None:
        def walk(delta_RHKV, starts_R, ends_R, outputs=False, commits_R=None):
            return fused(inputs.mixed_TC, history_RKC, inputs.conv_weight_C1K, inputs.g_TV, inputs.beta_TV, delta_RHKV,
                         starts_R, ends_R, num_key_heads=cfg.num_key_heads, outputs=outputs, commits_R=commits_R)
        return walk
    # per_shard splits the second axis: channels and heads go there, then back inside each shard
    channels, taps = inputs.mixed_TC.shape[1], cfg.conv_kernel_size
    split_inputs = (inputs.mixed_TC[..., None], jnp.swapaxes(history_RKC, 1, 2),
                    inputs.conv_weight_C1K.reshape(1, channels, taps), inputs.g_TV[..., None], inputs.beta_TV[..., None])

    def walk(delta_RHKV, starts_R, ends_R, outputs=False, commits_R=None):
        def local(mixed_TC1, history_RCK, weight_1CK, g_TV1, beta_TV1, delta_RHKV, rows):
            return fused(mixed_TC1[..., 0], jnp.swapaxes(history_RCK, 1, 2), weight_1CK[0][:, None, :], g_TV1[..., 0],
                         beta_TV1[..., 0], delta_RHKV, *rows[:2], num_key_heads=cfg.num_key_heads // inputs.shards,
                         outputs=outputs, commits_R=rows[2])
        return per_shard(inputs.mesh, local, 6)(*split_inputs, delta_RHKV, (starts_R, ends_R, commits_R))
    return walk


def rule_by_rows(inputs: RecurrentInputs, kernels: Kernels, q_THK, k_THK, v_THV, delta_RHKV, starts_R, ends_R,
                 commits_R, prefill_R, asks_for_chunks: bool = True):
    """(out, state) of the rule over each row's `[start, end)` (`delta_rule_reference`'s
    result): prefill rows (`prefill_R`, None: none) of at least `CHUNK` tokens in chunks
    (unless `kernels.prefill_rule` is "tokens"), the others token by token, so that decode
    and verify rows compute exactly what single steps compute. With `asks_for_chunks` the chunked pass runs only in a batch that has
    such a row (a conditional, which the device runs inside a CUDA graph where the program's
    options put conditionals there, and the host decides otherwise); without, always."""
    rule_inputs = (q_THK, k_THK, v_THV, inputs.g_TV, inputs.beta_TV)
    by_token = sharded_rule(inputs, kernels.delta_rule, delta_rule_reference)
    if prefill_R is None or q_THK.shape[0] < CHUNK or kernels.chunked_delta_rule is None:
        return by_token(*rule_inputs, delta_RHKV, starts_R, ends_R, commits_R=commits_R)
    chunked_R = prefill_R & (ends_R - starts_R >= CHUNK)
    commits_R = jnp.ones_like(chunked_R) if commits_R is None else commits_R
    out_THV, delta_RHKV = by_token(*rule_inputs, delta_RHKV, starts_R, jnp.where(chunked_R, starts_R, ends_R),
                                   commits_R=commits_R & ~chunked_R)
    num_chunks = chunks_for(q_THK.shape[0], starts_R.shape[0], min_row_tokens=CHUNK)
    by_chunk = sharded_rule(inputs, functools.partial(kernels.chunked_delta_rule, num_chunks=num_chunks),
                            functools.partial(chunked_delta_rule_reference, num_chunks=num_chunks))

    def chunked(delta_RHKV):
        chunk_out_THV, delta_RHKV = by_chunk(*rule_inputs, delta_RHKV, starts_R, jnp.where(chunked_R, ends_R, starts_R),
                                             commits_R=commits_R & chunked_R)
        return out_THV + chunk_out_THV, delta_RHKV

    if not asks_for_chunks:
        return chunked(delta_RHKV)
    return jax.lax.cond(jnp.any(chunked_R), chunked, lambda delta_RHKV: (out_THV, delta_RHKV), delta_RHKV)


def kept_counts(rows_T, advancing_T, num_rows: int):
    """int32 [R]: the tokens of each row where `advancing_T`."""
    return jnp.zeros((num_rows,), jnp.int32).at[rows_T].add(advancing_T.astype(jnp.int32))


def history_after(mixed_TC, history_RKC, starts_R, kept_R):
    """Each row's convolution history after its first `kept_R` tokens: the last taps - 1
    inputs, from the batch where the row has that many, else partly from its history."""
    taps, num_tokens = history_RKC.shape[1] + 1, mixed_TC.shape[0]
    place_RK = kept_R[:, None] - (taps - 1) + jnp.arange(taps - 1)[None, :]  # the new history's places in each row
    from_history = history_RKC[jnp.arange(starts_R.shape[0])[:, None], jnp.clip(taps - 1 + place_RK, 0, taps - 2)]
    from_batch = mixed_TC[jnp.clip(starts_R[:, None] + place_RK, 0, num_tokens - 1)]
    return jnp.where((place_RK >= 0)[..., None], from_batch, from_history)


def prepared_inputs(inputs: RecurrentInputs, history_RKC, rows_T, index_T, kernels: Kernels):
    """(q, k, v) float32 as the rule reads them, for every token of the batch (token t at
    place `index_T[t]` of row `rows_T[t]`, which continues `history_RKC`): the causal
    convolution, SiLU, q and k L2-normed and q scaled; off a mesh, one Pallas kernel where
    `kernels.rule_inputs` is "pallas", else jnp."""
    cfg, (num_tokens, _) = inputs.cfg, inputs.mixed_TC.shape
    if kernels.prepare_rule_inputs is not None and inputs.mesh is None:
        q_THK, k_THK, v_TV = kernels.prepare_rule_inputs(inputs.mixed_TC, history_RKC, inputs.conv_weight_C1K, rows_T,
                                                         index_T, num_key_heads=cfg.num_key_heads,
                                                         key_dim=cfg.key_head_dim)
        return q_THK, k_THK, v_TV.reshape(num_tokens, cfg.num_value_heads, cfg.value_head_dim)
    taps = cfg.conv_kernel_size

    def earlier(offset):  # the input `offset` tokens before each token: in the batch, or the row's history
        in_batch = inputs.mixed_TC[jnp.maximum(jnp.arange(num_tokens) - offset, 0)]
        from_history = history_RKC[rows_T, jnp.clip(taps - 1 + index_T - offset, 0, taps - 2)]
        return jnp.where((index_T >= offset)[:, None], in_batch, from_history)

    conv_TC = causal_conv_taps([earlier(taps - 1 - j) for j in range(taps)], inputs.conv_weight_C1K)
    q_THK, k_THK, v_THV = split_heads(conv_TC, cfg, inputs.shards)
    q_THK, k_THK = prepared_queries_keys(q_THK, k_THK)
    return q_THK, k_THK, v_THV.astype(jnp.float32)


def ragged_rule(inputs: RecurrentInputs, history_RKC, delta_RHKV, rows_T, starts_R, advancing_T,
                kernels: Kernels, commits_R=None, prefill_R=None,
                asks_for_chunks: bool = True) -> tuple[jax.Array, RulePass]:
    """(out [T, value heads, value dim] float32, the pass): each token t of batch row
    `rows_T[t]` (rows start at `starts_R`) where `advancing_T` (a prefix of each row's
    tokens) convolved and run through the rule from its row's state, which advances over
    those tokens in the rows `commits_R` (bool [R], None: all) and stays in the others; the
    other tokens' outputs are zeros. Long prefill rows (`prefill_R`) go in chunks
    (`rule_by_rows`, with `asks_for_chunks`)."""
    num_tokens = inputs.mixed_TC.shape[0]
    kept_R = kept_counts(rows_T, advancing_T, starts_R.shape[0])
    history = history_after(inputs.mixed_TC, history_RKC, starts_R, kept_R)
    fused = kernels.conv_delta_rule(num_tokens <= starts_R.shape[0]) if inputs.mesh is None or inputs.shards > 1 else None
    if fused is not None and (prefill_R is None or num_tokens < CHUNK or kernels.chunked_delta_rule is None):
        walk = sharded_conv_rule(inputs, fused, history_RKC)
        out_THV, delta_RHKV = walk(delta_RHKV.astype(jnp.float32), starts_R, starts_R + kept_R, True, commits_R)
        return out_THV, RulePass(inputs, lambda *rows: walk(*rows)[1], (history, delta_RHKV))
    index_T = jnp.arange(num_tokens) - starts_R[rows_T]  # each token's place in its row
    rule_inputs = (*prepared_inputs(inputs, history_RKC, rows_T, index_T, kernels), inputs.g_TV, inputs.beta_TV)
    out_THV, delta_RHKV = rule_by_rows(inputs, kernels, *rule_inputs[:3], delta_RHKV.astype(jnp.float32), starts_R,
                                       starts_R + kept_R, commits_R, prefill_R, asks_for_chunks)
    by_token = sharded_rule(inputs, kernels.delta_rule, delta_rule_reference, outputs=False)
    return out_THV, RulePass(inputs, lambda *rows: by_token(*rule_inputs, *rows)[1], (history, delta_RHKV))


def advanced_rows(rows: RecurrentState, passes: tuple[RulePass, ...], rows_T, starts_R, advancing_T,
                  commits_R) -> RecurrentState:
    """Each batch row's state after the tokens it keeps (`advancing_T`), from the passes
    (`ragged_rule` with `commits_R`) and `rows` (the states before the batch): rows whose pass
    committed keep its state; in the others the rule runs again over their kept tokens alone,
    from the state the pass left them (the one before the batch), for the states alone."""
    kept_R = kept_counts(rows_T, advancing_T, starts_R.shape[0])
    history, delta = [], []
    for p, history_RKC in zip(passes, rows.history):
        history.append(history_after(p.inputs.mixed_TC, history_RKC, starts_R, kept_R))
        delta.append(p.walk(p.after[1], starts_R, starts_R + jnp.where(commits_R, 0, kept_R)))
    return RecurrentState(tuple(history), tuple(delta))


def states_after(passes: tuple[RulePass, ...]) -> RecurrentState:
    """The rows' states the passes left (when the tokens that advanced them are the ones kept)."""
    return RecurrentState(tuple(p.after[0] for p in passes), tuple(p.after[1] for p in passes))
