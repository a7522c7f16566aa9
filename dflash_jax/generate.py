"""`generate` and `generate_autoregressive`: a static batch decoded as one XLA program.

Prefill, then a `lax.while_loop` of draft -> verify -> accept -> commit cycles, with no host
round trip until every request is done. Each request gets its own pages (a trivial block
table), so the loop uses exactly the paged steps the Engine uses. Without a drafter the same
loop commits one token per cycle: the autoregressive baseline every speedup is measured
against.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import sampling
from dflash_jax.attention import resolve_attention_impl
from dflash_jax.config import check_drafter_fits_target
from dflash_jax.flat_models import flatten_models, unflatten_models
from dflash_jax.kv_cache import PAD_SLOT, DraftCacheGroups, PagedKVCache, slots_of
from dflash_jax.models import Drafter, Target
from dflash_jax.requests import (
    check_prompt, check_request, resolve_block_size, resolve_draft_block_size,
)
from dflash_jax.steps import DraftShape, TargetBatch, block_batch, draft_step, target_step
from pallas_kernels.common import next_pow2


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """token_ids[r]: generated tokens (a hit stop token included); accepted_lengths[r][i]:
    tokens committed by cycle i (accepted drafts + 1; the prefill token is not a cycle);
    elapsed_s: the call's wall time, from its input checks to the tokens on the host."""

    token_ids: list[list[int]]
    accepted_lengths: list[list[int]]
    elapsed_s: float

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def mean_accepted_length(self) -> float:
        lengths = [n for per_request in self.accepted_lengths for n in per_request]
        return float(np.mean(lengths)) if lengths else 0.0


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything shape-like the program is compiled for."""

    num_drafts: int  # N (0: autoregressive)
    capacity: int  # token buffer length per request, >= max_new_tokens
    max_model_len: int
    layer_ids: tuple[int, ...]
    layout_impl: str
    attention_impl: str
    page_size: int
    draft_block_size: int  # the drafter's block (1 + its mask tokens), >= 1 + num_drafts
    greedy: bool  # temperature 0: sampling compiles to argmaxes, with no runtime branch


def generate(
    target: Target,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | Sequence[int] = 0,
    block_size: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    page_size: int = 16,
    layout_impl: str = "auto",
    attention_impl: str = "auto",
    draft_block_size: int | None = None,
) -> GenerateResult:
    """DFlash speculative decoding of a static batch of prompts (token id lists).

    block_size: the verified block, the last token plus block_size - 1 drafts (default: the
    drafter's trained B). draft_block_size: the block the drafter fills in its forward (default
    B), of which the first block_size - 1 drafts are verified; drafting the trained block keeps
    the drafter in its training regime. draft_block_size=block_size drafts only the verified
    block, as vLLM and z-lab do. layout_impl: the DFlash layout kernel's `impl`;
    attention_impl: "auto", "reference" (jnp) or "pallas" (the paged-attention kernel).
    """
    check_drafter_fits_target(target.cfg, drafter.cfg)
    block_size = resolve_block_size(drafter.cfg, block_size)
    draft_block_size = resolve_draft_block_size(drafter.cfg, block_size, draft_block_size)
    return _run(target, drafter, prompts, block_size - 1, max_new_tokens, temperature, top_k, top_p, seed,
                stop_token_ids, page_size, layout_impl, attention_impl, draft_block_size)


def generate_autoregressive(
    target: Target,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | Sequence[int] = 0,
    stop_token_ids: Sequence[int] | None = None,
    page_size: int = 16,
    attention_impl: str = "auto",
) -> GenerateResult:
    """Plain one-token-per-step decoding with the same paged steps: the baseline."""
    return _run(target, None, prompts, 0, max_new_tokens, temperature, top_k, top_p, seed,
                stop_token_ids, page_size, "auto", attention_impl, 1)


def _run(target, drafter, prompts, num_drafts, max_new_tokens, temperature, top_k, top_p, seed,
         stop_token_ids, page_size, layout_impl, attention_impl, draft_block_size) -> GenerateResult:
    start = time.perf_counter()  # elapsed_s: the whole call, as its caller waits for it
    resolve_attention_impl(attention_impl)  # refuse a bad name before anything compiles
    if isinstance(prompts, (str, bytes)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token id lists.")
    prompts = [check_prompt(p, target.cfg.vocab_size, f"prompt {i}") for i, p in enumerate(prompts)]
    max_model_len = target.cfg.max_position_embeddings
    longest = max(len(p) for p in prompts)
    check_request(longest, max_new_tokens, max_model_len, temperature=temperature, top_k=top_k, top_p=top_p,
                  seed=seed)
    num_reqs = len(prompts)
    seeds = np.broadcast_to(np.asarray(seed), (num_reqs,)).astype(np.int32)
    stops = np.asarray(sorted(set(stop_token_ids or ())) or [-1], np.int32)
    # Pages per request: prompt + all new tokens + one drafter block (which covers the verify
    # block) beyond the last one, in power-of-two buckets so that nearby lengths share a
    # compiled program.
    capacity = next_pow2(max_new_tokens)
    pages_per_req = -(-(next_pow2(longest) + capacity + draft_block_size) // page_size)
    block_table = 1 + np.arange(num_reqs * pages_per_req, dtype=np.int32).reshape(num_reqs, pages_per_req)
    static = _Static(
        num_drafts=num_drafts,
        capacity=capacity,
        max_model_len=max_model_len,
        layer_ids=drafter.cfg.target_layer_ids if drafter is not None else (),
        layout_impl=layout_impl,
        attention_impl=attention_impl,
        page_size=page_size,
        draft_block_size=draft_block_size,
        greedy=temperature == 0,
    )
    prefill = _prefill_batch(prompts, block_table, page_size)
    sampling_R = (
        np.full((num_reqs,), temperature, np.float32),
        np.full((num_reqs,), top_k, np.int32),
        np.full((num_reqs,), top_p, np.float32),
        seeds,
    )
    treedefs, leaves = flatten_models((target,) if drafter is None else (target, drafter))
    # Host arrays go to the program as numpy: jit transfers them with its arguments, no
    # eager op per array.
    out = _program(leaves, prefill, np.int32(max_new_tokens), sampling_R, stops, static=static, treedefs=treedefs)
    tokens, num_generated, accepted, num_cycles = jax.device_get(out)
    elapsed = time.perf_counter() - start
    return GenerateResult(
        token_ids=[tokens[r, : num_generated[r]].tolist() for r in range(num_reqs)],
        accepted_lengths=[accepted[r, : num_cycles[r]].tolist() for r in range(num_reqs)],
        elapsed_s=elapsed,
    )


def _prefill_batch(prompts, block_table, page_size) -> TargetBatch:
    """All prompts packed back to back, padded to a power of two with inert rows."""
    lengths = np.array([len(p) for p in prompts])
    num_tokens = next_pow2(max(int(lengths.sum()), 16))
    start_loc = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    rows = np.zeros(num_tokens, np.int32)
    slots = np.full(num_tokens, PAD_SLOT, np.int32)
    for r, prompt in enumerate(prompts):
        span = slice(start_loc[r], start_loc[r + 1])
        pos = np.arange(len(prompt))
        token_ids[span], positions[span], rows[span] = prompt, pos, r
        slots[span] = slots_of(block_table[r], pos, page_size)
    return TargetBatch(
        token_ids=token_ids,
        positions=positions,
        rows=rows,
        slots=slots,
        query_start_loc=start_loc,
        block_table=block_table,
        logits_rows=start_loc[1:] - 1,
    )


@functools.partial(jax.jit, static_argnames=("static", "treedefs"))
def _program(leaves, prefill: TargetBatch, max_new_tokens, sampling_R, stops_S, *, static: _Static, treedefs):
    """The whole run as one program. The models arrive as flat lists of their arrays
    (`flat_models`): a call reads their current parameters without walking their graphs. On
    the H200's host `nnx.split` of SmolLM2 and its drafter took 10.5 ms per call and
    flattening them as pytrees 2.5 ms (bench/generate_overhead.py)."""
    models = unflatten_models(treedefs, leaves)
    target = models[0]
    drafter = models[1] if static.num_drafts else None
    temperature_R, top_k_R, top_p_R, seeds_R = sampling_R
    num_reqs, num_drafts = prefill.block_table.shape[0], static.num_drafts
    num_query = 1 + num_drafts
    page_size = static.page_size
    # Caches are born inside the program: nothing to transfer or donate.
    # Every request owns its pages for the whole run: each drafter cache group (one per
    # attention kind) uses the same trivial block table, and nothing is evicted.
    num_pages = 1 + prefill.block_table.size
    caches = [PagedKVCache.for_model(target, target.cfg.num_layers, num_pages, page_size)]
    if num_drafts:
        groups = DraftCacheGroups.for_drafter(drafter.cfg)
        caches.append(tuple(PagedKVCache.for_model(drafter, len(layers), num_pages, page_size) for layers in groups.layers))
        draft_tables = (prefill.block_table,) * len(groups.layers)
    rows_R = jnp.arange(num_reqs, dtype=jnp.int32)

    def sample_rows(logits_RV, positions_R):
        """The next token from each row's logits; `positions_R` = the rows' positions."""
        return sampling.sample_target(logits_RV, temperature_R, top_k_R, top_p_R, seeds_R, positions_R,
                                      greedy=static.greedy)

    def propose(draft_cache, batch, features, num_rejected_R, anchor_R, anchor_pos_R):
        """(draft cache, (drafts [R, N], their distribution q [R, N, V])) for the next block."""
        draft_cache, logits_RNV = draft_step(
            target, drafter, draft_cache, draft_tables, batch, features,
            num_rejected_R=num_rejected_R, num_sampled_R=jnp.ones_like(rows_R), last_sampled_R=anchor_R,
            next_prefill_tokens_R=jnp.zeros_like(rows_R),
            shape=DraftShape(num_drafts, static.max_model_len, static.layout_impl, static.attention_impl,
                             static.draft_block_size),
        )
        return draft_cache, sampling.sample_drafts(logits_RNV, temperature_R, top_k_R, top_p_R, seeds_R, anchor_pos_R,
                                                   greedy=static.greedy)

    def verify(logits_RQV, drafts, remaining_R, start_R):
        """(committed tokens [R, 1 + N], accepted drafts [R]) from the verify rows' logits."""
        if not num_drafts:
            return sample_rows(logits_RQV[:, 0], start_R)[:, None], jnp.zeros_like(rows_R)
        return sampling.rejection_sample(
            logits_RQV, *drafts, jnp.clip(remaining_R - 1, 0, num_drafts),
            temperature_R, top_k_R, top_p_R, seeds_R, start_R, greedy=static.greedy,
        )

    # Prefill: the whole prompt of every request, the first token, the first drafts.
    target_cache, logits_RV, features = target_step(target, caches[0], prefill, static.layer_ids, static.attention_impl)
    prompt_lens_R = prefill.query_start_loc[1:] - prefill.query_start_loc[:-1]
    first_R = sample_rows(logits_RV, prompt_lens_R - 1)
    draft_cache = caches[1] if num_drafts else None
    drafts = (jnp.zeros((num_reqs, 0), jnp.int32), None)
    if num_drafts:
        draft_cache, drafts = propose(draft_cache, prefill, features, jnp.zeros_like(rows_R), first_R, prompt_lens_R)

    tokens_RC = jnp.zeros((num_reqs, static.capacity), jnp.int32).at[:, 0].set(first_R)
    state = dict(
        target_cache=target_cache,
        draft_cache=draft_cache,
        tokens=tokens_RC,
        num_generated=jnp.ones_like(rows_R),
        accepted=jnp.zeros((num_reqs, static.capacity), jnp.int32),
        num_cycles=jnp.zeros_like(rows_R),
        done=jnp.isin(first_R, stops_S) | (max_new_tokens <= 1),
        anchor=first_R,
        start=prompt_lens_R,  # position of the anchor: the last committed token
        drafts=drafts,
    )

    def cycle(s):
        offsets = jnp.arange(num_query, dtype=jnp.int32)
        block_RQ = jnp.concatenate([s["anchor"][:, None], s["drafts"][0]], axis=1)
        batch = block_batch(block_RQ, s["start"], prefill.block_table, page_size)
        target_cache, logits, features = target_step(target, s["target_cache"], batch, static.layer_ids,
                                                      static.attention_impl)
        committed_RQ, num_accepted_R = verify(
            logits.reshape(num_reqs, num_query, -1), s["drafts"], max_new_tokens - s["num_generated"], s["start"]
        )
        # Commit accepted drafts + the bonus, cut at the first stop token; nothing once done.
        count_R = num_accepted_R + 1
        is_stop_RQ = jnp.isin(committed_RQ, stops_S) & (offsets[None, :] < count_R[:, None])
        hit_stop_R = is_stop_RQ.any(axis=1)
        count_R = jnp.where(hit_stop_R, jnp.argmax(is_stop_RQ, axis=1) + 1, count_R)
        count_R = jnp.where(s["done"], 0, count_R)
        write_at_RQ = jnp.where(offsets[None, :] < count_R[:, None], s["num_generated"][:, None] + offsets, static.capacity)
        tokens = s["tokens"].at[rows_R[:, None], write_at_RQ].set(committed_RQ, mode="drop")
        accepted = s["accepted"].at[rows_R, jnp.where(s["done"], static.capacity, s["num_cycles"])].set(count_R, mode="drop")
        num_generated = s["num_generated"] + count_R
        bonus_R = committed_RQ[rows_R, num_accepted_R]
        new = dict(
            s,
            target_cache=target_cache,
            tokens=tokens,
            accepted=accepted,
            num_generated=num_generated,
            num_cycles=s["num_cycles"] + (count_R > 0),
            done=s["done"] | hit_stop_R | (num_generated >= max_new_tokens),
            anchor=jnp.where(s["done"], s["anchor"], bonus_R),
            start=jnp.where(s["done"], s["start"], s["start"] + num_accepted_R + 1),
        )
        if num_drafts:
            new["draft_cache"], new["drafts"] = propose(
                s["draft_cache"], batch, features, num_drafts - num_accepted_R, new["anchor"], new["start"]
            )
        return new

    state = jax.lax.while_loop(lambda s: ~jnp.all(s["done"]), cycle, state)
    return state["tokens"], state["num_generated"], state["accepted"], state["num_cycles"]
