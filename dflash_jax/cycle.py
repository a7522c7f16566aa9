"""The speculative cycle on the device: verify, accept, commit, draft. One function for both
drivers: `generate` runs it in a `lax.while_loop`, the `Engine` once per scheduled step.

A cycle takes a ragged target batch whose rows are either verify rows (a request's anchor,
the last committed token, followed by its N drafts) or a prefill chunk, and per-slot decode
state (`DecodeState`) indexed by request slot. It runs the target over the batch, verifies
each verifying row's drafts against the target's logits (greedy: the longest prefix equal to
the target's argmaxes; sampled: rejection sampling, `sampling.rejection_sample`), commits the
accepted drafts plus one token from the target, and proposes the next block with the
drafter, conditioned on the features the target just computed. Without a drafter (N = 0) a
cycle is one plain decode step.

One rule decides what a row commits (`drafts_to_verify`, `commit_counts`): a request that may
still generate `remaining` tokens verifies at most `remaining - 1` drafts, so that it never
commits more than `remaining`; what it commits ends at its first stop token. Its drivers
read the committed tokens and finish a request when `stopped` or when the tokens it
committed reach `remaining`.

Names end in shape letters (`drafts_SN`, `tokens_RQ`): the legend is docs/ARCHITECTURE.md, "Shape letters".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dflash_jax import sampling
from dflash_jax.kernels import Kernels
from dflash_jax.kv_cache import PAD_SLOT, DraftCacheGroups, PagedKVCache, slots_of
from dflash_jax.recurrent_state import RecurrentState, advanced_rows, states_after
from dflash_jax.steps import TargetBatch, block_batch, draft_step, target_step


@dataclasses.dataclass(frozen=True)
class CycleConfig:
    """Everything static about a cycle (hashable: part of each program's jit key)."""

    num_drafts: int  # N drafts verified per request and cycle (0: plain decoding)
    draft_block_size: int  # rows the drafter fills per request (its anchor + mask tokens), >= 1 + N
    max_model_len: int  # the longest sequence a request may reach
    layer_ids: tuple[int, ...]  # target layers whose outputs are the drafter's features
    kernels: Kernels  # resolved: no "auto"
    greedy: bool  # every row at temperature 0: sampling compiles to argmaxes, draft_probs unused
    draft_sampling: str  # how sampled rows propose drafts: "sample" or "argmax" (`sampling.DRAFT_SAMPLING`)
    logprobs: bool = False  # also report the committed tokens' log-probabilities (`Committed.logprobs`)
    adjusts_logits: bool = False  # apply the batch's `LogitsAdjustment` (logit bias, min_tokens)
    penalizes: bool = False  # apply the batch's `PenaltyRows`, keeping the state's token counts

    @property
    def argmax_drafts(self) -> bool:
        return self.draft_sampling == "argmax"

    @property
    def keeps_draft_probs(self) -> bool:
        """Whether verification reads q: only sampled drafts need it (a one-hot q is implied)."""
        return not self.greedy and not self.argmax_drafts


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["target_cache", "draft_caches", "drafts_SN", "draft_probs_SNV", "anchor_S", "anchor_pos_S",
                 "output_counts_SV", "prompt_seen_SV", "recurrent", "saved_recurrent"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """What the device keeps per request slot between cycles."""

    target_cache: PagedKVCache  # the target's K/V, every layer, all slots' pages
    draft_caches: tuple[PagedKVCache, ...]  # the drafter's K/V, one cache per group (DraftCacheGroups)
    drafts_SN: jax.Array  # int32 [S, N]: the drafts the slot's next verify checks
    draft_probs_SNV: jax.Array  # float32 [S, N, V]: the drafter's q for them (V is 0 unless cfg.keeps_draft_probs)
    anchor_S: jax.Array  # int32 [S]: the last committed token, not yet in the caches (verify row 0)
    anchor_pos_S: jax.Array  # int32 [S]: its position
    # For penalties (V is 0 unless the state was made for them): per slot, how often each
    # token occurs among the generated tokens in the cache (positions prompt .. anchor - 1),
    # and which tokens the prompt holds. Kept only by steps that penalize.
    output_counts_SV: jax.Array | None = None  # int32 [S, V]
    prompt_seen_SV: jax.Array | None = None  # bool [S, V]
    recurrent: RecurrentState | None = None  # a hybrid target's gated-delta-net states, per slot
    # With prefix caching on a hybrid target: states saved after cached prefixes (`prefix_states`)
    saved_recurrent: RecurrentState | None = None

    @classmethod
    def zeros(cls, models, cfg: CycleConfig, *, num_slots: int, page_size: int, target_pages: int,
              draft_pages: tuple[int, ...], penalties: bool = False, saved_states: int = 0) -> DecodeState:
        """An empty state: caches of `target_pages` (and per drafter group `draft_pages`)
        pages; draft probabilities only if `cfg.keeps_draft_probs`; token counts for
        penalties only if `penalties`; a hybrid target's pool of `saved_states` states."""
        target = models[0]
        draft_caches = ()
        if cfg.num_drafts:
            groups = DraftCacheGroups.for_drafter(models[1].cfg)
            draft_caches = tuple(PagedKVCache.for_model(models[1], len(layers), pages, page_size, cfg.kernels)
                                 for layers, pages in zip(groups.layers, draft_pages))
        vocab = target.cfg.vocab_size if cfg.keeps_draft_probs else 0
        return cls(
            target_cache=PagedKVCache.for_model(target, len(target.cfg.kv_layers), target_pages, page_size,
                                                cfg.kernels),
            draft_caches=draft_caches,
            drafts_SN=jnp.zeros((num_slots, cfg.num_drafts), jnp.int32),
            draft_probs_SNV=jnp.zeros((num_slots, cfg.num_drafts, vocab), jnp.float32),
            anchor_S=jnp.zeros((num_slots,), jnp.int32),
            anchor_pos_S=jnp.zeros((num_slots,), jnp.int32),
            output_counts_SV=jnp.zeros((num_slots, target.cfg.vocab_size if penalties else 0), jnp.int32),
            prompt_seen_SV=jnp.zeros((num_slots, target.cfg.vocab_size if penalties else 0), bool),
            recurrent=RecurrentState.zeros(target.cfg, num_slots, target.dtype, target.mesh),
            saved_recurrent=RecurrentState.zeros(target.cfg, saved_states, target.dtype, target.mesh)
            if saved_states else None,
        )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["temperature_R", "top_k_R", "top_p_R", "seeds_R"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling parameters (`sampling`'s conventions: temperature 0 is greedy)."""

    temperature_R: jax.Array
    top_k_R: jax.Array
    top_p_R: jax.Array
    seeds_R: jax.Array


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["bias_ids_RW", "bias_RW", "min_stop_pos_R"], meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class LogitsAdjustment:
    """Per-row changes to the target's logits before verification and sampling
    (`sampling.adjusted_logits`)."""

    bias_ids_RW: jax.Array  # token ids of the row's logit bias, padded with -1
    bias_RW: jax.Array  # their biases
    min_stop_pos_R: jax.Array  # stop tokens are impossible at positions before this (prompt + min_tokens)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["presence_R", "frequency_R", "repetition_R", "prompt_len_R"], meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class PenaltyRows:
    """Per-row penalties (`sampling.penalized_logits`; 0, 0 and 1 are off) and prompt lengths."""

    presence_R: jax.Array
    frequency_R: jax.Array
    repetition_R: jax.Array
    prompt_len_R: jax.Array  # positions before it are the prompt's


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "target", "draft_page_tables", "slots_R", "verify_rows_RQ", "anchor_pos_R", "verifying_R", "remaining_R",
        "next_prefill_tokens_R", "stop_ids_RE", "sampling", "adjustment", "penalties", "restore_R", "save_R",
        "last_pos_R",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class CycleBatch:
    """One cycle's rows, with every token (verify rows' anchors and drafts included) filled in."""

    target: TargetBatch  # the target's ragged batch; logits are taken at verify_rows_RQ
    draft_page_tables: tuple[jax.Array, ...]  # [R, pages] per drafter cache group
    slots_R: jax.Array | None  # state slot of each row (S: a padding row, writes dropped); None: row r is slot r
    verify_rows_RQ: jax.Array  # target token rows whose logits verify (a prefill row: its last row)
    anchor_pos_R: jax.Array  # position of verify row 0 (a prefill row: its last position)
    verifying_R: jax.Array  # bool: the row verifies drafts (else a prefill chunk)
    remaining_R: jax.Array  # tokens the row may still commit; 0: it commits nothing (mid-prefill, done)
    next_prefill_tokens_R: jax.Array  # the next prompt token of a row mid-prefill (the drafter's anchor)
    stop_ids_RE: jax.Array  # the row's stop token ids, padded with -1
    sampling: SamplingRows
    adjustment: LogitsAdjustment | None = None  # read when `CycleConfig.adjusts_logits`
    penalties: PenaltyRows | None = None  # read when `CycleConfig.penalizes`
    # With saved hybrid states (`DecodeState.saved_recurrent`): the saved state a row starts
    # from in place of its slot's, and where its state after the row is saved; -1: none
    restore_R: jax.Array | None = None
    save_R: jax.Array | None = None
    # The last position each row may reach. A request resumed after preemption drafts its next
    # block in its last recomputed chunk, which commits nothing: this sizes that block's tail as
    # an uninterrupted request's (None: only committing rows' drafts are verified)
    last_pos_R: jax.Array | None = None


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["tokens_RQ", "count_R", "stopped_R", "logprobs"], meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Committed:
    """What a cycle commits per row: the first `count_R` of `tokens_RQ`."""

    tokens_RQ: jax.Array  # accepted drafts then the target's token (junk past count_R)
    count_R: jax.Array  # tokens committed: accepted + 1, cut at a stop token; 0 if remaining_R was 0
    stopped_R: jax.Array  # bool: the last committed token is a stop token
    # With `CycleConfig.logprobs`: `sampling.token_logprobs` of tokens_RQ under the verify
    # rows' logits (row j's logits give token j), else None.
    logprobs: tuple[jax.Array, jax.Array, jax.Array] | None = None


def drafts_to_verify(remaining_R, num_drafts: int):
    """Drafts a row verifies: all N, fewer near its length cap (it commits accepted + 1)."""
    return jnp.clip(remaining_R - 1, 0, num_drafts)


def tail_block_lens(remaining_R, draft_block_size: int):
    """Block positions each row drafts across: the anchor and as many positions as the row may
    still commit, at most the whole block. Near its length cap a row drafts a shorter block,
    as z-lab's loop does (its drafter attends across the shorter block only)."""
    return jnp.clip(remaining_R + 1, 1, draft_block_size)


def commit_counts(tokens_RQ, num_accepted_R, remaining_R, stop_ids_RE):
    """(count_R, stopped_R): a row commits its accepted drafts and the target's token, up to
    and including its first stop token; nothing if it had nothing remaining. E.g. tokens [5, 9,
    2, 7], 2 accepted, stop ids [2]: count 3 -> [5, 9, 2], stopped."""
    offsets_Q = jnp.arange(tokens_RQ.shape[1], dtype=jnp.int32)
    count_R = jnp.where(remaining_R > 0, num_accepted_R + 1, 0)
    is_stop_RQ = (tokens_RQ[:, :, None] == stop_ids_RE[:, None, :]).any(-1) & (offsets_Q < count_R[:, None])
    stopped_R = is_stop_RQ.any(axis=1)
    count_R = jnp.where(stopped_R, jnp.argmax(is_stop_RQ, axis=1) + 1, count_R)
    return count_R, stopped_R


def slot_rows(array_S, slots_R):
    """Each row's entry of a per-slot array (a padding row reads the last slot)."""
    return array_S if slots_R is None else array_S[jnp.minimum(slots_R, array_S.shape[0] - 1)]


def with_slot_rows(array_S, slots_R, values_R, where_R=None):
    """A per-slot array with each row's value written to its slot, where `where_R` (all rows
    if None); padding rows write nothing. Rows that are their slots need no scatter."""
    if slots_R is None:
        if where_R is None:
            return values_R
        return jnp.where(where_R.reshape(where_R.shape + (1,) * (values_R.ndim - 1)), values_R, array_S)
    if where_R is not None:
        slots_R = jnp.where(where_R, slots_R, array_S.shape[0])  # out of range: dropped
    return array_S.at[slots_R].set(values_R, mode="drop")


def verify_batch(state: DecodeState, page_table_SP, remaining_S, stop_ids_SE, sampling_rows: SamplingRows,
                 page_size: int) -> CycleBatch:
    """Every slot as one verify row block (anchor + drafts at consecutive positions): the
    batch of `generate`'s loop, where batch row r is slot r."""
    num_slots = state.anchor_S.shape[0]
    tokens_SQ = jnp.concatenate([state.anchor_S[:, None], state.drafts_SN], axis=1)
    target = block_batch(tokens_SQ, state.anchor_pos_S, page_table_SP, page_size)
    return CycleBatch(
        target=target,
        draft_page_tables=(page_table_SP,) * len(state.draft_caches),
        slots_R=None,
        verify_rows_RQ=target.logits_rows.reshape(tokens_SQ.shape),
        anchor_pos_R=state.anchor_pos_S,
        verifying_R=jnp.ones((num_slots,), bool),
        remaining_R=remaining_S,
        next_prefill_tokens_R=jnp.zeros((num_slots,), jnp.int32),
        stop_ids_RE=stop_ids_SE,
        sampling=sampling_rows,
    )


def fill_verify_rows(batch: CycleBatch, state: DecodeState) -> CycleBatch:
    """`batch` with each verifying row's tokens, positions and KV slots taken from its slot's
    state (the host that scheduled it need not know them) and every real token's KV slot
    computed. A verifying row r's target tokens are `anchor_S[slot], drafts_SN[slot]` at
    positions `anchor_pos_S[slot] + 0 .. N`."""
    target = batch.target
    anchor_pos_R = jnp.where(batch.verifying_R, slot_rows(state.anchor_pos_S, batch.slots_R), batch.anchor_pos_R)
    num_tokens = target.token_ids.shape[0]
    t_T = jnp.arange(num_tokens)
    real_T = t_T < target.query_start_loc[-1]
    from_state_T = real_T & batch.verifying_R[target.rows]
    positions_T = jnp.where(from_state_T, anchor_pos_R[target.rows] + t_T - target.query_start_loc[target.rows],
                            target.positions)
    first_rows_R = jnp.where(batch.verifying_R, target.query_start_loc[:-1], num_tokens)  # out of range: dropped
    tokens_T = target.token_ids.at[first_rows_R].set(slot_rows(state.anchor_S, batch.slots_R), mode="drop")
    num_drafts = state.drafts_SN.shape[1]
    if num_drafts:
        draft_rows_RN = jnp.where(batch.verifying_R[:, None], batch.verify_rows_RQ[:, 1:], num_tokens)
        tokens_T = tokens_T.at[draft_rows_RN].set(slot_rows(state.drafts_SN, batch.slots_R), mode="drop")
    slots_T = jnp.where(real_T, slots_of(target.page_table, positions_T, state.target_cache.page_size, target.rows),
                        PAD_SLOT)
    target = dataclasses.replace(target, token_ids=tokens_T, positions=positions_T, slots=slots_T)
    return dataclasses.replace(batch, target=target, anchor_pos_R=anchor_pos_R)


def prefill_token_counts(state: DecodeState, batch: CycleBatch):
    """(counts_RV, seen_RV): each row's slot's generated-token counts and prompt tokens with
    its prefill chunk's tokens added (positions from the prompt length on are generated: a
    request recomputed after preemption); a chunk from position 0 starts them afresh."""
    target, p = batch.target, batch.penalties
    counts_RV = slot_rows(state.output_counts_SV, batch.slots_R)
    seen_RV = slot_rows(state.prompt_seen_SV, batch.slots_R)
    fresh_R = fresh_rows(batch)
    counts_RV = jnp.where(fresh_R[:, None], 0, counts_RV)
    seen_RV = seen_RV & ~fresh_R[:, None]
    real_T = jnp.arange(target.token_ids.shape[0]) < target.query_start_loc[-1]
    prefill_T = real_T & ~batch.verifying_R[target.rows]
    generated_T = target.positions >= p.prompt_len_R[target.rows]
    counts_RV = counts_RV.at[target.rows, target.token_ids].add((prefill_T & generated_T).astype(jnp.int32))
    seen_RV = seen_RV.at[target.rows, target.token_ids].max(prefill_T & ~generated_T)
    return counts_RV, seen_RV


def fresh_rows(batch: CycleBatch):
    """bool [R]: the row is a prefill chunk from position 0, a request (re)starting in its slot."""
    target = batch.target
    starts_R = target.query_start_loc[:-1]
    has_tokens_R = target.query_start_loc[1:] > starts_R
    return ~batch.verifying_R & has_tokens_R & (target.positions[starts_R] == 0)


def recurrent_rows(state: DecodeState, batch: CycleBatch) -> RecurrentState | None:
    """Each row's gated-delta-net states before the batch: its slot's, zero for a fresh row,
    a saved one where the row restores one."""
    if state.recurrent is None:
        return None
    def where_rows(mask_R, x, y):
        return jnp.where(mask_R.reshape(-1, *(1,) * (y.ndim - 1)), x, y).astype(y.dtype)

    fresh_R = fresh_rows(batch)
    rows = jax.tree.map(lambda a: where_rows(fresh_R, 0, slot_rows(a, batch.slots_R)), state.recurrent)
    if state.saved_recurrent is None or batch.restore_R is None:
        return rows
    return jax.tree.map(lambda pool, a: where_rows(batch.restore_R >= 0, pool[jnp.maximum(batch.restore_R, 0)], a),
                        state.saved_recurrent, rows)


def kept_tokens(batch: CycleBatch, count_R):
    """bool [T]: the batch tokens now in the caches, a prefill chunk's all, a verify row's
    anchor and committed drafts (its first `count_R`)."""
    target = batch.target
    t_T = jnp.arange(target.token_ids.shape[0])
    real_T = t_T < target.query_start_loc[-1]
    index_T = t_T - target.query_start_loc[target.rows]
    return real_T & (~batch.verifying_R[target.rows] | (index_T < count_R[target.rows]))


def penalty_counts(counts_RV, seen_RV, inputs_RQ, verifying_R):
    """(counts_RQV, seen_RQV) each verify row's logits are penalized with: a verifying row j
    follows the anchor and drafts 0 .. j - 1, generated tokens not yet in the cache
    (`inputs_RQ`: the anchor then the drafts); a prefill row's token follows the cache alone."""
    vocab = counts_RV.shape[-1]
    pending_RQV = jnp.cumsum(jax.nn.one_hot(inputs_RQ, vocab, dtype=jnp.int32), axis=1) * verifying_R[:, None, None]
    counts_RQV = counts_RV[:, None, :] + pending_RQV
    return counts_RQV, seen_RV[:, None, :] | (counts_RQV > 0)


def speculative_cycle(models, state: DecodeState, batch: CycleBatch, cfg: CycleConfig,
                      prefill_rows: str = "mixed", context_weights: tuple | None = None
                      ) -> tuple[DecodeState, Committed]:
    """Target forward, verification, commit, next drafts: one cycle over `batch`.

    `models` is (target,) or (target, drafter). Rows whose `remaining_R` is 0 commit nothing;
    a verifying one leaves its slot's anchor alone, a prefill chunk makes its next prompt
    token the anchor. Padding rows (slot S) write no state at all. `prefill_rows` (static):
    "mixed" (any row may be a prefill chunk), "all" (every row is one) or "none" (every row
    verifies): where a hybrid target's long prefill chunks may be, and whether the batch must
    be asked at run time (`recurrent_state.rule_by_rows`). `context_weights`: the drafter's
    `context_kv_weights`, built once by a program that loops over cycles (None: built here)."""
    target = models[0]
    n = cfg.num_drafts
    num_rows, num_query = batch.verify_rows_RQ.shape
    rows_R = jnp.arange(num_rows)
    p = batch.sampling
    rows_before = recurrent_rows(state, batch)
    # Without drafts a row keeps its one token when it has any remaining: known beforehand
    known_kept_T = kept_tokens(batch, jnp.minimum(batch.remaining_R, 1)) if num_query == 1 else None
    # With drafts only the prefill chunks' states are final after the pass (`advanced_rows`)
    commits_R = None if num_query == 1 else ~batch.verifying_R
    if prefill_rows not in ("mixed", "all", "none"):
        raise ValueError(f"prefill_rows must be 'mixed', 'all' or 'none', got {prefill_rows!r}.")
    prefill_R = None if prefill_rows == "none" else ~batch.verifying_R
    target_cache, logits, features, rule_passes = target_step(target, state.target_cache, batch.target,
                                                              cfg.layer_ids, cfg.kernels, rows_before, known_kept_T,
                                                              commits_R, prefill_R, prefill_rows == "mixed")
    raw_logits_RQV = logits_RQV = logits.reshape(num_rows, num_query, -1)
    if cfg.penalizes:
        counts_RV, seen_RV = prefill_token_counts(state, batch)
        inputs_RQ = batch.target.token_ids[batch.verify_rows_RQ]  # anchor then drafts (verifying rows)
        counts_RQV, seen_RQV = penalty_counts(counts_RV, seen_RV, inputs_RQ, batch.verifying_R)
        q = batch.penalties
        logits_RQV = sampling.penalized_logits(logits_RQV, counts_RQV, seen_RQV, q.presence_R, q.frequency_R,
                                               q.repetition_R)
    if cfg.adjusts_logits:
        a = batch.adjustment
        token_pos_RQ = batch.anchor_pos_R[:, None] + 1 + jnp.arange(num_query)
        logits_RQV = sampling.adjusted_logits(logits_RQV, token_pos_RQ, a.bias_ids_RW, a.bias_RW, a.min_stop_pos_R,
                                              batch.stop_ids_RE)
    with jax.named_scope("verify"):
        if num_query == 1:  # no drafts in this batch: one token from the target
            tokens_RQ = sampling.sample_target(logits_RQV[:, 0], p.temperature_R, p.top_k_R, p.top_p_R, p.seeds_R,
                                               batch.anchor_pos_R, greedy=cfg.greedy)[:, None]
            accepted_R = jnp.zeros_like(rows_R)
        else:
            num_drafts_R = jnp.where(batch.verifying_R, drafts_to_verify(batch.remaining_R, n), 0)
            tokens_RQ, accepted_R = sampling.rejection_sample(
                logits_RQV, slot_rows(state.drafts_SN, batch.slots_R),
                slot_rows(state.draft_probs_SNV, batch.slots_R) if cfg.keeps_draft_probs else None,
                num_drafts_R, p.temperature_R, p.top_k_R, p.top_p_R, p.seeds_R, batch.anchor_pos_R,
                greedy=cfg.greedy, argmax_drafts=cfg.argmax_drafts,
            )
        count_R, stopped_R = commit_counts(tokens_RQ, accepted_R, batch.remaining_R, batch.stop_ids_RE)
        logprobs = sampling.token_logprobs(raw_logits_RQV, tokens_RQ) if cfg.logprobs else None
    samples_R = batch.remaining_R > 0
    if rows_before is not None:  # the states after the kept tokens only: rejected drafts leave no trace
        rows_after = states_after(rule_passes) if known_kept_T is not None else advanced_rows(
            rows_before, rule_passes, batch.target.rows, batch.target.query_start_loc[:-1], kept_tokens(batch, count_R),
            commits_R)
        state = dataclasses.replace(state, recurrent=jax.tree.map(
            lambda slots, rows: with_slot_rows(slots, batch.slots_R, rows), state.recurrent, rows_after
        ).placed(target.cfg, target.mesh))
        if state.saved_recurrent is not None and batch.save_R is not None:
            state = dataclasses.replace(state, saved_recurrent=jax.tree.map(
                lambda pool, rows: with_slot_rows(pool, batch.save_R, rows, batch.save_R >= 0), state.saved_recurrent,
                rows_after).placed(target.cfg, target.mesh))
    if cfg.penalizes:  # the verify rows' tokens now in the cache: the anchor and the committed drafts
        cached_RQ = batch.verifying_R[:, None] & (jnp.arange(num_query) < count_R[:, None])
        counts_RV = counts_RV.at[rows_R[:, None], inputs_RQ].add(cached_RQ.astype(jnp.int32))
        state = dataclasses.replace(
            state, output_counts_SV=with_slot_rows(state.output_counts_SV, batch.slots_R, counts_RV),
            prompt_seen_SV=with_slot_rows(state.prompt_seen_SV, batch.slots_R, seen_RV))
    # A prefill chunk that commits nothing is followed by its next prompt token, the anchor
    # the drafter conditions on (a request resumed after preemption continues from its last
    # token, drafted and verified as if it had never stopped).
    next_anchor_R = jnp.where(samples_R, tokens_RQ[rows_R, accepted_R], batch.next_prefill_tokens_R)
    next_anchor_pos_R = batch.anchor_pos_R + accepted_R + 1
    new_anchor_R = samples_R | ~batch.verifying_R
    state = dataclasses.replace(
        state,
        target_cache=target_cache,
        anchor_S=with_slot_rows(state.anchor_S, batch.slots_R, next_anchor_R, new_anchor_R),
        anchor_pos_S=with_slot_rows(state.anchor_pos_S, batch.slots_R, next_anchor_pos_R, new_anchor_R),
    )
    if n:
        left_after_R = batch.remaining_R - count_R  # tokens a row may commit after the next anchor
        if batch.last_pos_R is not None:
            left_after_R = jnp.where(samples_R, left_after_R, batch.last_pos_R - next_anchor_pos_R)
        draft_caches, draft_logits_RNV, draft_hidden_RND = draft_step(
            target, models[1], state.draft_caches, batch.draft_page_tables, batch.target, features,
            num_rejected_R=jnp.where(batch.verifying_R, n - accepted_R, 0),
            num_sampled_R=samples_R.astype(jnp.int32),
            last_sampled_R=next_anchor_R,
            next_prefill_tokens_R=batch.next_prefill_tokens_R,
            num_drafts=n, draft_block_size=cfg.draft_block_size, max_model_len=cfg.max_model_len,
            kernels=cfg.kernels, block_lens_R=tail_block_lens(left_after_R, cfg.draft_block_size),
            context_weights=context_weights,
        )
        with jax.named_scope("sample_drafts"):
            if models[1].cfg.dflash2 is None:
                drafts_RN, probs_RNV = sampling.sample_drafts(draft_logits_RNV, p.temperature_R, p.top_k_R, p.top_p_R,
                                                              p.seeds_R, next_anchor_pos_R, greedy=cfg.greedy,
                                                              argmax=cfg.argmax_drafts)
            else:  # DFlash 2: the candidate selector walks each block (drawing where rows sample)
                sampled = {} if not cfg.keeps_draft_probs else dict(
                    temperature_R=p.temperature_R, seeds_R=p.seeds_R, positions_R=next_anchor_pos_R)
                drafts_RN, _, probs_RNV = models[1].candidate_selector.walk(draft_hidden_RND, draft_logits_RNV,
                                                                           next_anchor_R, **sampled)
        state = dataclasses.replace(
            state,
            draft_caches=draft_caches,
            drafts_SN=with_slot_rows(state.drafts_SN, batch.slots_R, drafts_RN),
            draft_probs_SNV=with_slot_rows(state.draft_probs_SNV, batch.slots_R, probs_RNV) if cfg.keeps_draft_probs
            else state.draft_probs_SNV,
        )
    return state, Committed(tokens_RQ, count_R, stopped_R, logprobs)
