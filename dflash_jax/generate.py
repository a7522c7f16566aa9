"""`generate` and `generate_autoregressive`: a static batch decoded as one XLA program.

Prefill, then a `lax.while_loop` of `cycle.speculative_cycle`, with no host round trip
until every request is done. Each request gets its own pages (a trivial page table), so the
loop runs exactly the cycle the Engine runs. Without a drafter the same loop commits one
token per cycle: the autoregressive baseline every speedup is measured against.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dflash_jax.config import check_drafter_fits_target
from dflash_jax.cycle import CycleBatch, CycleConfig, DecodeState, SamplingRows, speculative_cycle, verify_batch
from dflash_jax.flat_models import flatten_models, unflatten_models
from dflash_jax.kernels import Kernels, check_kernels
from dflash_jax.kv_cache import PAD_SLOT, DraftCacheGroups, slots_of
from dflash_jax.models import Drafter, Target
from dflash_jax.placement import on_one_mesh
from dflash_jax.sharding import replicated
from dflash_jax.requests import (
    SamplingParams, check_count, check_prompt, check_request, check_stop_token_ids,
    resolve_block_size, resolve_draft_block_size, stop_id_array,
)
from dflash_jax.sampling import DEFAULT_DRAFT_SAMPLING, check_draft_sampling
from dflash_jax.steps import TargetBatch
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


def generate(
    target: Target,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | Sequence[int] = 0,
    stop_token_ids: Sequence[int] | None = None,
    sampling_params: SamplingParams | None = None,
    block_size: int | None = None,
    draft_block_size: int | None = None,
    page_size: int = 16,
    kernels: Kernels = Kernels(),
    draft_sampling: str = DEFAULT_DRAFT_SAMPLING,
    mesh: Mesh | None = None,
    compile_only: bool = False,
) -> GenerateResult:
    """DFlash speculative decoding of a static batch of prompts (token id lists).

    Sampling: the keywords, or `sampling_params` (a `SamplingParams`, then without them).
    block_size: the verified block, the last token plus block_size - 1 drafts (default: the
    drafter's trained block; on a mixture-of-experts target with the Pallas experts' product,
    the block whose cycle cost and expected acceptance project the most tokens per second,
    `verify_block`). draft_block_size: the block the drafter fills in its forward
    (default: the trained block), of which the first block_size - 1 drafts are verified;
    drafting the trained block keeps the drafter in its training regime, and
    draft_block_size=block_size drafts only the verified block, as vLLM and z-lab do.
    kernels: which implementation runs each kernel (`Kernels`; "auto": Pallas on a GPU).
    draft_sampling: how sampled requests propose drafts, "sample" (drawn from the drafter's
    distribution) or "argmax" (its most likely tokens); either way the output follows the
    target's distribution (`sampling`). Greedy requests propose argmaxes regardless.
    mesh: run tensor-parallel over its "model" axis (`sharding.make_mesh`); models loaded
    with it run there as they are, others are placed on it first (a copy through the host,
    at every call: load them with `mesh=` instead). Without it the models run where they are.
    compile_only: compile the program these arguments run (or load it from the compilation
    cache) without decoding; the result has no tokens and elapsed_s is the compile time. A
    later call with arguments of the same shapes runs it without compiling: a warm-up that
    costs no decode.
    """
    target, drafter = on_one_mesh((target, drafter), mesh)
    check_drafter_fits_target(target.cfg, drafter.cfg)
    check_draft_sampling(draft_sampling)
    block_size = resolve_block_size(drafter.cfg, block_size, target.cfg, batch=len(prompts),
                                    kernels=check_kernels(kernels).resolve(target.mesh))
    draft_block_size = resolve_draft_block_size(drafter.cfg, block_size, draft_block_size)
    params = _sampling(sampling_params, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids)
    return _run(target, drafter, prompts, params, block_size - 1, draft_block_size, page_size, kernels, draft_sampling,
                compile_only)


def generate_autoregressive(
    target: Target,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | Sequence[int] = 0,
    stop_token_ids: Sequence[int] | None = None,
    sampling_params: SamplingParams | None = None,
    page_size: int = 16,
    kernels: Kernels = Kernels(),
    mesh: Mesh | None = None,
    compile_only: bool = False,
) -> GenerateResult:
    """Plain one-token-per-step decoding through the same cycle: the baseline (`mesh` and
    `compile_only` as for `generate`)."""
    (target,) = on_one_mesh((target,), mesh)
    params = _sampling(sampling_params, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids)
    return _run(target, None, prompts, params, 0, 1, page_size, kernels, DEFAULT_DRAFT_SAMPLING, compile_only)


def _sampling(params, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids) -> dict:
    """The run's sampling settings from either `sampling_params` or the keywords (a per-request
    seed list only through the keywords)."""
    if params is None:
        if max_new_tokens is None:
            raise ValueError("give max_new_tokens (or sampling_params=SamplingParams(max_new_tokens=...)).")
        return dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    stop_token_ids=stop_token_ids)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
    keywords = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    stop_token_ids=stop_token_ids)
    defaults = dict(max_new_tokens=None, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_token_ids=None)
    clashing = [name for name, value in keywords.items() if value is not defaults[name] and value != defaults[name]]
    if clashing:
        raise ValueError(f"give sampling_params or {', '.join(clashing)}, not both.")
    engine_only = [name for name, off in (("logprobs", None), ("logit_bias", ()), ("min_tokens", 0))
                   if getattr(params, name) != off]
    if engine_only:
        raise ValueError(f"generate does not take {', '.join(engine_only)}; run such requests on the Engine "
                         "(dflash_jax.Engine, or dflash-jax serve).")
    return {name: getattr(params, name) for name in keywords}


def _run(target, drafter, prompts, params: dict, num_drafts, draft_block_size, page_size, kernels,
         draft_sampling, compile_only) -> GenerateResult:
    start = time.perf_counter()  # elapsed_s: the whole call, as its caller waits for it
    page_size = check_count("page_size", page_size)
    params["stop_token_ids"] = tuple(check_stop_token_ids(params["stop_token_ids"], target.cfg.vocab_size))
    check_kernels(kernels)
    if isinstance(prompts, (str, bytes)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token id lists.")
    prompts = [check_prompt(p, target.cfg.vocab_size, f"prompt {i}") for i, p in enumerate(prompts)]
    max_model_len = target.cfg.max_position_embeddings
    longest = max(len(p) for p in prompts)
    max_new_tokens = params["max_new_tokens"]
    check_request(longest, max_new_tokens, max_model_len, temperature=params["temperature"], top_k=params["top_k"],
                  top_p=params["top_p"], seed=params["seed"])
    num_reqs = len(prompts)
    # Pages per request: prompt + all new tokens + one drafter block (which covers the verify
    # block) beyond the last one, in power-of-two buckets so that nearby lengths share a
    # compiled program.
    capacity = next_pow2(max_new_tokens)
    pages_per_req = -(-(next_pow2(longest) + capacity + draft_block_size) // page_size)
    page_table = 1 + np.arange(num_reqs * pages_per_req, dtype=np.int32).reshape(num_reqs, pages_per_req)
    cfg = CycleConfig(
        num_drafts=num_drafts,
        draft_block_size=draft_block_size,
        max_model_len=max_model_len,
        layer_ids=drafter.cfg.target_layer_ids if drafter is not None else (),
        kernels=kernels.resolve(target.mesh),
        greedy=params["temperature"] == 0,
        draft_sampling=draft_sampling,
    )
    sampling_rows = SamplingRows(
        temperature_R=np.full((num_reqs,), params["temperature"], np.float32),
        top_k_R=np.full((num_reqs,), params["top_k"], np.int32),
        top_p_R=np.full((num_reqs,), params["top_p"], np.float32),
        seeds_R=np.broadcast_to(np.asarray(params["seed"]), (num_reqs,)).astype(np.int32),
    )
    stop_ids_E = stop_id_array(params["stop_token_ids"])
    stop_ids_RE = np.broadcast_to(stop_ids_E, (num_reqs, stop_ids_E.size))
    treedefs, leaves = flatten_models((target,) if drafter is None else (target, drafter))
    # Host arrays go to the program as numpy: jit transfers them with its arguments, no
    # eager op per array.
    arguments = (leaves, _prefill_batch(prompts, page_table, page_size), np.int32(max_new_tokens), sampling_rows,
                 np.ascontiguousarray(stop_ids_RE))
    static = dict(capacity=capacity, page_size=page_size, cfg=cfg, treedefs=treedefs)
    if compile_only:  # the jitted function keeps the executable for the call that runs it
        _program.lower(*arguments, **static).compile()
        return GenerateResult([[] for _ in prompts], [[] for _ in prompts], time.perf_counter() - start)
    tokens, num_generated, accepted, num_cycles = jax.device_get(_program(*arguments, **static))
    elapsed = time.perf_counter() - start
    return GenerateResult(
        token_ids=[tokens[r, : num_generated[r]].tolist() for r in range(num_reqs)],
        accepted_lengths=[accepted[r, : num_cycles[r]].tolist() for r in range(num_reqs)],
        elapsed_s=elapsed,
    )


def _prefill_batch(prompts, page_table, page_size) -> TargetBatch:
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
        slots[span] = slots_of(page_table[r], pos, page_size)
    return TargetBatch(
        token_ids=token_ids,
        positions=positions,
        rows=rows,
        slots=slots,
        query_start_loc=start_loc,
        page_table=page_table,
        logits_rows=start_loc[1:] - 1,
    )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["decode", "tokens_RC", "num_generated_R", "accepted_RC", "num_cycles_R", "done_R"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class _Loop:
    """The while loop's carry: the decode state and what the run has committed so far."""

    decode: DecodeState
    tokens_RC: jax.Array  # int32 [R, C]: generated tokens (C = capacity >= max_new_tokens)
    num_generated_R: jax.Array  # how many of them there are
    accepted_RC: jax.Array  # tokens committed by each cycle (prefill excluded)
    num_cycles_R: jax.Array  # how many cycles committed something
    done_R: jax.Array  # bool: stopped, or max_new_tokens reached

    def commit(self, committed, is_cycle: bool, max_new_tokens) -> _Loop:
        """The carry after a cycle's commit (`is_cycle`: a cycle, not the prefill, recorded in accepted_RC)."""
        rows_R = jnp.arange(self.tokens_RC.shape[0])
        capacity = self.tokens_RC.shape[1]
        offsets_Q = jnp.arange(committed.tokens_RQ.shape[1], dtype=jnp.int32)
        write_at_RQ = jnp.where(offsets_Q < committed.count_R[:, None], self.num_generated_R[:, None] + offsets_Q,
                                capacity)
        num_generated_R = self.num_generated_R + committed.count_R
        accepted_RC, num_cycles_R = self.accepted_RC, self.num_cycles_R
        if is_cycle:
            cycle_at_R = jnp.where(committed.count_R > 0, num_cycles_R, capacity)
            accepted_RC = accepted_RC.at[rows_R, cycle_at_R].set(committed.count_R, mode="drop")
            num_cycles_R = num_cycles_R + (committed.count_R > 0)
        return dataclasses.replace(
            self,
            tokens_RC=self.tokens_RC.at[rows_R[:, None], write_at_RQ].set(committed.tokens_RQ, mode="drop"),
            num_generated_R=num_generated_R,
            accepted_RC=accepted_RC,
            num_cycles_R=num_cycles_R,
            done_R=self.done_R | committed.stopped_R | (num_generated_R >= max_new_tokens),
        )


# Traces of the generate program, as the Engine counts its step's.
_traces = [0]


def num_traces() -> int:
    """How many generate programs have been traced (compiled) in this process: benchmarks
    check that their timed runs add none."""
    return _traces[0]


@functools.partial(jax.jit, static_argnames=("capacity", "page_size", "cfg", "treedefs"))
def _program(leaves, prefill: TargetBatch, max_new_tokens, sampling_rows: SamplingRows, stop_ids_RE, *,
             capacity: int, page_size: int, cfg: CycleConfig, treedefs):
    """The whole run as one program: the prefill as a cycle over the prompts, then cycles
    over every request's verify rows until all are done. The models arrive as flat lists of
    their arrays (`flat_models`): a call reads their current parameters without walking their
    graphs."""
    _traces[0] += 1
    models = unflatten_models(treedefs, leaves)
    num_reqs = prefill.page_table.shape[0]
    num_pages = 1 + prefill.page_table.size
    draft_groups = DraftCacheGroups.for_drafter(models[1].cfg).layers if cfg.num_drafts else ()
    # Caches are born inside the program: nothing to transfer or donate.
    state = DecodeState.zeros(models, cfg, num_slots=num_reqs, page_size=page_size, target_pages=num_pages,
                              draft_pages=(num_pages,) * len(draft_groups))
    zeros_R = jnp.zeros((num_reqs,), jnp.int32)
    prompt_lens_R = prefill.query_start_loc[1:] - prefill.query_start_loc[:-1]
    # Every request owns its pages for the whole run: each drafter cache group uses the same
    # trivial page table, and nothing is evicted.
    prefill_batch = CycleBatch(
        target=prefill,
        draft_page_tables=(prefill.page_table,) * len(state.draft_caches),
        slots_R=None,
        verify_rows_RQ=prefill.logits_rows[:, None],
        anchor_pos_R=prompt_lens_R - 1,
        verifying_R=jnp.zeros((num_reqs,), bool),
        remaining_R=jnp.full((num_reqs,), max_new_tokens, jnp.int32),
        next_prefill_tokens_R=zeros_R,
        stop_ids_RE=stop_ids_RE,
        sampling=sampling_rows,
    )
    # The drafter's stacked context K/V weights, built once for every cycle of the loop
    context_weights = models[1].context_kv_weights() if cfg.num_drafts else None
    with jax.named_scope("prefill"):
        state, committed = speculative_cycle(models, state, prefill_batch, cfg, prefill_rows="all",
                                             context_weights=context_weights)
    loop = _Loop(
        decode=state,
        tokens_RC=jnp.zeros((num_reqs, capacity), jnp.int32),
        num_generated_R=zeros_R,
        accepted_RC=jnp.zeros((num_reqs, capacity), jnp.int32),
        num_cycles_R=zeros_R,
        done_R=jnp.zeros((num_reqs,), bool),
    ).commit(committed, False, max_new_tokens)

    def cycle(loop: _Loop) -> _Loop:
        remaining_R = jnp.where(loop.done_R, 0, max_new_tokens - loop.num_generated_R)
        batch = verify_batch(loop.decode, prefill.page_table, remaining_R, stop_ids_RE, sampling_rows, page_size)
        decode, committed = speculative_cycle(models, loop.decode, batch, cfg, prefill_rows="none",
                                              context_weights=context_weights)
        return dataclasses.replace(loop, decode=decode).commit(committed, True, max_new_tokens)

    loop = jax.lax.while_loop(lambda loop: ~jnp.all(loop.done_R), cycle, loop)
    # Whole on every device: each process of a multi-process mesh reads them from its own.
    return tuple(replicated(x, models[0].mesh) for x in (loop.tokens_RC, loop.num_generated_R, loop.accepted_RC,
                                                         loop.num_cycles_R))
