"""The two forward steps of a speculative cycle over paged caches, as traceable functions.

`target_step` runs the target on a flat ragged batch (prefill chunks and verify rows alike)
and returns logits at the rows that need sampling plus the drafter's features at every row.
`draft_step` turns that batch into the drafter's inputs with the layout kernel, writes the
context K/V of all draft layers (one fused projection), runs the block and returns the draft
logits at the sample rows (its three parts, `draft_layouts`, `write_context_kv` and
`draft_block`, are exposed for benchmarks). `block_batch` builds the batch of a decode or
verify step. All are pure; `cycle.speculative_cycle` composes them into one cycle.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dflash_jax.gated_delta_rule import RecurrentInputs
from dflash_jax.kernels import Kernels
from dflash_jax.kv_cache import DraftCacheGroups, PagedKVCache, slots_of
from dflash_jax.layers import ProjectedHeads
from dflash_jax.models import Drafter, Target
from dflash_jax.recurrent_state import RecurrentState, ragged_rule
from dflash_jax.sharding import per_shard
from pallas_kernels.dflash_layout import DFlashLayout, prepare_dflash_inputs


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["token_ids", "positions", "rows", "slots", "query_start_loc", "page_table", "logits_rows"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class TargetBatch:
    """One ragged target batch, padded to static sizes (T tokens, R batch rows).

    Batch row r owns tokens `query_start_loc[r] .. query_start_loc[r + 1]`; padding tokens sit
    past `query_start_loc[R]` with the pad slot, so they write no K/V.
    """

    token_ids: jax.Array  # [T]
    positions: jax.Array  # [T]
    rows: jax.Array  # [T] batch row of each token (0 for padding)
    slots: jax.Array  # [T] KV slot, PAD_SLOT for padding
    query_start_loc: jax.Array  # [R + 1]
    page_table: jax.Array  # [R, pages_per_req]
    logits_rows: jax.Array  # [R * Q] token rows whose logits are wanted


def target_step(target: Target, cache: PagedKVCache, batch: TargetBatch, layer_ids: tuple[int, ...],
                kernels: Kernels, recurrent_rows: RecurrentState | None = None, advancing_T=None, commits_R=None,
                prefill_R=None, asks_for_chunks: bool = True):
    """(cache, logits [R * Q, V] float32, features [T, F], the gated-delta-net layers'
    `RulePass`es) for one batch, with the (resolved) `kernels`. A hybrid target's
    gated-delta-net layers run from `recurrent_rows`, each batch row's state before the batch,
    and advance it over `advancing_T` (a prefix of each row's tokens; None: every real token)
    in the rows `commits_R` (None: all), the others' states left as they were, long prefill
    chunks (`prefill_R`; `asks_for_chunks` as for `recurrent_state.rule_by_rows`) in chunks of
    tokens; the caller commits the states (`recurrent_state.states_after`, or `advanced_rows`
    over the tokens kept)."""
    seq_lens_R = _seq_lens(batch)
    passes = []
    cache_layers = {layer: i for i, layer in enumerate(target.cfg.kv_layers)}  # the cache holds attention layers
    if advancing_T is None:  # every real token
        advancing_T = jnp.arange(batch.token_ids.shape[0]) < batch.query_start_loc[-1]

    def attend(layer, heads):
        nonlocal cache
        if isinstance(heads, RecurrentInputs):
            j = len(passes)
            out_THV, rule_pass = ragged_rule(heads, recurrent_rows.history[j], recurrent_rows.delta[j], batch.rows,
                                             batch.query_start_loc[:-1], advancing_T, kernels, commits_R, prefill_R,
                                             asks_for_chunks)
            passes.append(rule_pass)
            return out_THV
        out_TUH, cache = attend_paged(target.mesh, cache, cache_layers[layer], heads, kernels, slots_T=batch.slots,
                                      q_rows_T=batch.rows, page_table=batch.page_table, seq_lens_R=seq_lens_R,
                                      rule=target.cfg.layer_attention(layer))
        return out_TUH

    with jax.named_scope("target"):
        hidden_TD, features_TF = target(batch.token_ids, batch.positions, attend, layer_ids=layer_ids, kernels=kernels)
        logits = target.unembed(hidden_TD[batch.logits_rows])
    return cache, logits, features_TF, tuple(passes)


def attend_paged(mesh, cache: PagedKVCache, layer: int, heads: ProjectedHeads, kernels: Kernels, *, slots_T,
                 q_rows_T, page_table, seq_lens_R, rule) -> tuple[jax.Array, PagedKVCache]:
    """(attention output [T, U, H], cache): one layer's projected heads finished (q/k norm,
    RoPE), their keys and values written to `slots_T` of `cache`'s `layer`, then paged
    attention of the queries (batch row `q_rows_T`) under the mask `rule`. On a mesh this runs
    once per shard (`sharding.per_shard`), on the shard's query and kv heads."""
    attention = heads.attention
    cos_TZ, sin_TZ, q_weight_H, k_weight_H, eps = attention.finish_args(heads.positions_T)
    num_heads, group = attention.cfg.num_heads // attention.shards, attention.cfg.num_heads // attention.cfg.num_kv_heads
    shared = (slots_T, cos_TZ, sin_TZ, q_weight_H, k_weight_H, heads.positions_T, q_rows_T, page_table, seq_lens_R)

    sinks_U = attention.sinks_U()

    def local(qkv_TYH, k_XKH, v_XKH, *rest):
        *sinks_1U1, shared = rest  # a shard's sinks as [1, U, 1]: split by head like the heads
        slots_T, cos_TZ, sin_TZ, q_weight_H, k_weight_H, positions_T, q_rows_T, page_table, seq_lens_R = shared
        q_TUH, k_XKH, v_XKH = kernels.finish_heads(qkv_TYH, cos_TZ, sin_TZ, q_weight_H, k_weight_H, eps, slots_T,
                                                   k_XKH, v_XKH, num_heads=num_heads)
        paged_attention = kernels.paged_attention(q_rows_T, num_rows=page_table.shape[0], num_kv_heads=k_XKH.shape[1],
                                                  group=group, dtype=q_TUH.dtype)
        out_TUH = paged_attention(q_TUH, positions_T, q_rows_T, k_XKH, v_XKH, page_table, seq_lens_R,
                                  page_size=cache.page_size, rule=rule,
                                  sinks_U=sinks_1U1[0].reshape(-1) if sinks_1U1 else None)
        return out_TUH, k_XKH, v_XKH

    split = (heads.qkv_TYH, cache.k[layer], cache.v[layer]) + (() if sinks_U is None else (sinks_U.reshape(1, -1, 1),))
    out_TUH, k_XKH, v_XKH = per_shard(mesh, local, len(split))(*split, shared)
    return out_TUH, cache.with_layer(layer, k_XKH, v_XKH)


def block_batch(tokens_RQ, start_R, page_table_RP, page_size: int) -> TargetBatch:
    """R requests of Q consecutive tokens each (a verify block, or one decode token), row r
    at positions start_R[r] .. start_R[r] + Q - 1 through its block-table row; logits are
    wanted at every token. E.g. Q = 3, start_R = [7, 2]: positions [7, 8, 9, 2, 3, 4]."""
    num_reqs, num_query = tokens_RQ.shape
    positions_RQ = start_R[:, None] + jnp.arange(num_query, dtype=jnp.int32)[None, :]
    return TargetBatch(
        token_ids=tokens_RQ.reshape(-1),
        positions=positions_RQ.reshape(-1),
        rows=jnp.repeat(jnp.arange(num_reqs, dtype=jnp.int32), num_query),
        slots=slots_of(page_table_RP, positions_RQ, page_size).reshape(-1),
        query_start_loc=jnp.arange(num_reqs + 1, dtype=jnp.int32) * num_query,
        page_table=page_table_RP,
        logits_rows=jnp.arange(num_reqs * num_query, dtype=jnp.int32),
    )


def _seq_lens(batch: TargetBatch):
    """Keys visible to row r: every position up to its last token (causality does the rest)."""
    last = jnp.maximum(batch.query_start_loc[1:] - 1, 0)
    has_tokens = batch.query_start_loc[1:] > batch.query_start_loc[:-1]
    return jnp.where(has_tokens, batch.positions[last] + 1, 0)


def draft_step(
    target: Target,
    drafter: Drafter,
    caches: tuple[PagedKVCache, ...],
    page_tables: tuple[jax.Array, ...],
    batch: TargetBatch,
    features_TF,
    *,
    num_rejected_R,
    num_sampled_R,
    last_sampled_R,
    next_prefill_tokens_R,
    num_drafts: int,
    draft_block_size: int,
    max_model_len: int,
    kernels: Kernels,
    block_lens_R=None,
    context_weights: tuple | None = None,
):
    """(caches, draft logits [R, N, V] float32, their hidden states [R, N, D]) after the target
    ran `batch`. `block_lens_R`: the block positions each row's drafter attends across (None:
    all `draft_block_size`). `context_weights`: the drafter's `context_kv_weights`, where a
    loop of cycles built them once (None: built here).

    `caches` and `page_tables` hold one entry per drafter KV-cache group
    (`DraftCacheGroups`); the layout kernel runs once per group with that group's table.
    Per-request inputs are in batch-row order (the layout's request states are the batch rows).
    The drafter fills `draft_block_size` rows per request (its anchor + mask tokens), of
    which the first `num_drafts` drafts are returned. Three parts, in order: `draft_layouts`,
    `write_context_kv`, `draft_block`.
    """
    with jax.named_scope("draft_layout"):
        layouts = draft_layouts(
            drafter, caches, page_tables, batch, num_rejected_R=num_rejected_R, num_sampled_R=num_sampled_R,
            last_sampled_R=last_sampled_R, next_prefill_tokens_R=next_prefill_tokens_R,
            draft_block_size=draft_block_size, max_model_len=max_model_len, layout_impl=kernels.layout,
        )
    with jax.named_scope("draft_context_kv"):
        caches = write_context_kv(drafter, caches, layouts, features_TF, context_weights)
    with jax.named_scope("draft_block"):
        return draft_block(target, drafter, caches, page_tables, layouts, num_drafts=num_drafts,
                           draft_block_size=draft_block_size, kernels=kernels, block_lens_R=block_lens_R)


def draft_layouts(drafter: Drafter, caches, page_tables, batch: TargetBatch, *, num_rejected_R, num_sampled_R,
                  last_sampled_R, next_prefill_tokens_R, draft_block_size: int, max_model_len: int,
                  layout_impl: str) -> list[DFlashLayout]:
    """The layout kernel's query, context and sample rows for `batch`, once per cache group
    (with that group's page table; of `caches` only the page sizes are read). The kernel
    keeps vLLM's names: its `block_table` is a page table, its `block_size` a page size."""
    num_rows = batch.page_table.shape[0]
    unused_R = jnp.zeros(num_rows, jnp.int32)  # the layout's sampling copies are not read here
    return [
        prepare_dflash_inputs(
            batch.positions,
            batch.query_start_loc,
            jnp.arange(num_rows, dtype=jnp.int32),
            last_sampled_R,
            next_prefill_tokens_R,
            num_sampled_R,
            num_rejected_R,
            unused_R.astype(jnp.float32),
            unused_R,
            table,
            block_size=cache.page_size,
            parallel_drafting_token_id=drafter.cfg.mask_token_id,
            num_speculative_steps=draft_block_size - 1,
            max_num_reqs=num_rows,
            max_num_tokens=num_rows * draft_block_size,
            # Pages cover a draft block past the last position: no query row needs clamping.
            max_model_len=max_model_len + draft_block_size,
            impl=layout_impl,
        )
        for cache, table in zip(caches, page_tables)
    ]


def write_context_kv(drafter: Drafter, caches, layouts: list[DFlashLayout], features_TF,
                     context_weights: tuple | None = None) -> tuple[PagedKVCache, ...]:
    """Context K/V of every drafter layer from the target's features (one fused projection,
    `Drafter.context_kv` with `context_weights`), written to each layer's group cache at the
    layout's context slots."""
    groups = DraftCacheGroups.for_drafter(drafter.cfg)
    caches = list(caches)
    for layer, (k_TKH, v_TKH) in enumerate(drafter.context_kv(features_TF, layouts[0].context_positions,
                                                              context_weights)):
        group, index = groups.group_of(layer)
        caches[group] = caches[group].write(index, layouts[group].context_slot_mapping, k_TKH, v_TKH)
    return tuple(caches)


def draft_block(target: Target, drafter: Drafter, caches, page_tables, layouts: list[DFlashLayout], *,
                num_drafts: int, draft_block_size: int, kernels: Kernels, block_lens_R=None):
    """(caches, draft logits [R, N, V] float32, the drafter's hidden states of those rows
    [R, N, D]): the block's query rows through the drafter, their K/V written to the caches,
    logits at the sample rows through the target's head. With `block_lens_R`, each row's
    keys end after that many block positions (a shorter block: the rows past it draft what
    no one verifies)."""
    num_rows = page_tables[0].shape[0]
    groups = DraftCacheGroups.for_drafter(drafter.cfg)
    caches = list(caches)
    layout = layouts[0]  # ids, positions and sample rows are the same in every group
    query_rows = jnp.arange(num_rows * draft_block_size, dtype=jnp.int32) // draft_block_size
    seq_lens_R = layout.seq_lens
    if block_lens_R is not None:
        seq_lens_R = jnp.maximum(seq_lens_R - (draft_block_size - block_lens_R), 0)

    def attend(layer, heads):
        group, index = groups.group_of(layer)
        out_TUH, caches[group] = attend_paged(
            drafter.mesh, caches[group], index, heads, kernels, slots_T=layouts[group].query_slot_mapping,
            q_rows_T=query_rows, page_table=page_tables[group], seq_lens_R=seq_lens_R,
            rule=drafter.cfg.layers[layer])
        return out_TUH

    block_embeds = target.embed(layout.input_ids).astype(drafter.dtype)
    hidden_TD = drafter(block_embeds, layout.query_positions, attend, kernels, block_size=draft_block_size)
    # The drafter's B - 1 drafts per request; only the first N are verified (the rest get no head).
    hidden_RND = hidden_TD[layout.sample_indices].reshape(num_rows, draft_block_size - 1, -1)[:, :num_drafts]
    logits = drafter.logits(target.unembed, hidden_RND.reshape(num_rows * num_drafts, -1).astype(target.dtype))
    return tuple(caches), logits.reshape(num_rows, num_drafts, -1), hidden_RND
