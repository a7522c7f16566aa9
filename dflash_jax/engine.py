"""`Engine`: continuous batching of speculative decoding over paged KV caches.

Requests arrive and leave at any step. Each step the `Scheduler` picks a ragged batch
(prefill chunks and 1 + N verify rows side by side, within a token budget), `StepInputs`
pads it to one of a few static shapes (`buckets`), and one compiled program runs it: verify rows filled from the
device state, then `cycle.speculative_cycle`. Drafts and their distributions stay on the
device, indexed by request slot, and so do each request's anchor token and position.

So the host need not know a step's tokens to schedule the next one. With asynchronous
scheduling (the default) `step()` launches step k + 1 before it reads step k's tokens: the
host's scheduling, batch building and dispatch overlap the device's work, and `step()`
returns the tokens of the step before. A request that finishes in step k still runs in step
k + 1 (unless the host knows it ends in k: its length runs out); those outputs are dropped.
A request that could never fit is refused when it is added. Nothing a request does can
touch another's pages.

When every running request decodes, one step may run several verify cycles on the device
(`cycles_per_step`, a loop inside the program): the host's work and the program's dispatch
(hundreds of arrays) are then paid once per that many cycles, which matters where a model is
small enough for a cycle to take about as long as that work (on a GPU). Tokens and their
randomness do not depend on it: each cycle's draws are keyed by position, as in single steps.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dflash_jax.buckets import Program, holds, program_for, programs
from dflash_jax.config import check_drafter_fits_target
from dflash_jax.cycle import CycleConfig, DecodeState
from dflash_jax.flat_models import flatten_models
from dflash_jax.kernels import Kernels, check_kernels
from dflash_jax.kv_cache import DraftCacheGroups, PageAllocator, kv_cache_bytes, pages_within
from dflash_jax.models import Drafter, Target
from dflash_jax.placement import on_one_mesh
from dflash_jax.prefix_cache import PrefixCache, PrefixCacheStats
from dflash_jax.prefix_states import SavedStates
from dflash_jax.recurrent_state import recurrent_state_bytes
from dflash_jax.requests import (
    DraftCounts, RequestOutput, RequestStats, SamplingParams, TokenLogprobs, check_count, check_logit_bias,
    check_logprobs, check_penalties, check_prompt, check_request, check_stop_token_ids,
    resolve_block_size, resolve_draft_block_size, stop_id_array,
)
from dflash_jax.sampling import DEFAULT_DRAFT_SAMPLING, check_draft_sampling
from dflash_jax.scheduler import Request, Scheduler, Status, Work
from dflash_jax.step_inputs import StepInputs
from dflash_jax.step_program import (
    HashedOnce, default_cycles_per_step, executables, num_traces, platform_of, shape_of, unpack_committed,
)
from pallas_kernels.common import next_pow2

# Distinct stop token ids one request may have (the width of the step's stop-id rows).
MAX_STOP_IDS = 16


@dataclasses.dataclass(frozen=True)
class StepFeatures:
    """What a step computes beyond its tokens, static in its program (each combination
    compiles a program of its own): log-probabilities, logit bias and min_tokens, penalties."""

    logprobs: bool = False
    adjusts_logits: bool = False
    penalizes: bool = False

    @classmethod
    def of(cls, work: list[Work]) -> StepFeatures:
        params = [w.request.params for w in work]
        return cls(logprobs=any(p.logprobs is not None for p in params),
                   adjusts_logits=any(p.logit_bias or p.min_tokens for p in params),
                   penalizes=any(p.penalized for p in params))


@dataclasses.dataclass(frozen=True)
class _Launched:
    """A launched step: its work and its (not yet read) device outputs."""

    work: list[Work]  # every share runs the step's cycles (`Work.cycles`)
    packed: jax.Array  # int32 [max cycles, R, width]: each cycle's `Committed` packed for one transfer
    logprobs: bool  # whether `packed` holds log-probabilities (`step_program.pack`)


class Engine:
    """Serve many requests with DFlash speculative decoding (or plain decoding, no drafter)."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        *,
        max_num_reqs: int = 8,
        max_num_tokens: int = 256,
        num_pages: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        page_size: int = 16,
        block_size: int | None = None,
        draft_block_size: int | None = None,
        max_model_len: int | None = None,
        kernels: Kernels = Kernels(),
        async_scheduling: bool = True,
        draft_sampling: str = DEFAULT_DRAFT_SAMPLING,
        mesh: Mesh | None = None,
        cycles_per_step: int | None = None,
        prefix_caching: bool = True,
    ):
        """`draft_sampling`: how sampled requests propose drafts, "sample" or "argmax" (see
        `generate`); one choice per engine, part of its compiled programs. `mesh`: serve
        tensor-parallel over its "model" axis (`sharding.make_mesh`), as `generate` does:
        models loaded with it are used as they are, others placed on it. `cycles_per_step`:
        verify cycles a step runs at most when every request decodes (None: the platform's
        `default_cycles_per_step`); more cycles spread the host's work, fewer admit new
        requests sooner. `prefix_caching`: a request starts from the cached KV pages (the
        target's and the drafter's) of the longest prefix of its tokens that an earlier request
        computed (`prefix_cache`, `prefix_states`); the drafter's windowed layers then keep whole contexts too."""
        target, drafter = on_one_mesh((target, drafter), mesh)
        self.cycles_per_step = (default_cycles_per_step(target.mesh) if cycles_per_step is None
                                else check_count("cycles_per_step", cycles_per_step))
        check_kernels(kernels)
        max_num_reqs = check_count("max_num_reqs", max_num_reqs)
        if drafter is not None:
            check_drafter_fits_target(target.cfg, drafter.cfg)
            block_size = resolve_block_size(drafter.cfg, block_size, target.cfg, batch=max_num_reqs,
                                            kernels=kernels.resolve(target.mesh))
            draft_block_size = resolve_draft_block_size(drafter.cfg, block_size, draft_block_size)
        elif block_size is not None or draft_block_size is not None:
            raise ValueError("block_size and draft_block_size need a drafter; pass one, or drop them for plain decoding.")
        self.draft_block_size = draft_block_size or 1  # the drafter's block (generate's draft_block_size)
        if num_pages is not None and kv_cache_memory_bytes is not None:
            raise ValueError("give num_pages or kv_cache_memory_bytes, not both.")
        page_size = check_count("page_size", page_size)
        if num_pages is not None:
            num_pages = check_count("num_pages", num_pages, 2)
        if kv_cache_memory_bytes is not None:
            kv_cache_memory_bytes = check_count("kv_cache_memory_bytes", kv_cache_memory_bytes)
        max_num_tokens = check_count("max_num_tokens", max_num_tokens)
        self.num_drafts = 0 if drafter is None else block_size - 1
        limit = target.cfg.max_position_embeddings
        if max_model_len is not None and not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must lie in [1, {limit}] (the target's max positions), got {max_model_len}.")
        self.max_model_len = max_model_len or limit
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        # Programs take power-of-two shapes at most these: a batch pads up to its program's.
        self._padded_reqs, self._padded_tokens = next_pow2(max_num_reqs), next_pow2(max_num_tokens)
        if max_num_tokens < max_num_reqs * (1 + self.num_drafts):
            raise ValueError(
                f"max_num_tokens={max_num_tokens} cannot hold {max_num_reqs} requests x "
                f"{1 + self.num_drafts} verify rows; raise it or lower max_num_reqs."
            )
        self.page_size = page_size
        lookahead = self.draft_block_size  # positions past a step's rows it writes: the drafter's block
        # Room for every position a request can touch: its tokens, a verify block, the draft rows after it.
        self.pages_per_req = -(-(self.max_model_len + lookahead) // page_size)
        if not isinstance(prefix_caching, bool):
            raise TypeError(f"prefix_caching must be True or False, got {prefix_caching!r}.")
        self.prefix_caching = prefix_caching
        saved_states = SavedStates.for_target(target.cfg, max_num_reqs, page_size) if prefix_caching else None
        self._groups = DraftCacheGroups.for_drafter(drafter.cfg) if drafter else None
        # Windowed drafter groups have pages of their own, given back as the window passes,
        # unless their context is cached with the target's pages.
        windows = self._groups.windows[1:] if self._groups and not self.prefix_caching else ()
        if num_pages is None:
            states = max_num_reqs + (saved_states.capacity if saved_states else 0)  # a hybrid's slots, saved
            num_pages = self._pages_for_budget(target, drafter, kv_cache_memory_bytes, len(windows), states)
        # Windowed groups hold at most a window plus two steps (the one in flight and the
        # next) per request: a fixed pool.
        step_span = max(max_num_tokens, 2 * self.cycles_per_step * (1 + self.num_drafts))
        window_allocators = [
            PageAllocator(1 + max_num_reqs * -(-(w + step_span + 2 * lookahead + 2 * page_size) // page_size))
            for w in windows
        ]
        self.scheduler = Scheduler(
            max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens, num_drafts=self.num_drafts,
            lookahead=lookahead, page_size=page_size,
            allocator=PrefixCache(num_pages) if self.prefix_caching else PageAllocator(num_pages),
            window_allocators=window_allocators, windows=windows, cycles_per_step=self.cycles_per_step,
            saved_states=saved_states)
        self._target, self._drafter = target, drafter
        self._models = (target,) if drafter is None else (target, drafter)
        treedefs, _ = flatten_models(self._models)
        cfg = CycleConfig(
            num_drafts=self.num_drafts,
            draft_block_size=self.draft_block_size,
            max_model_len=self.max_model_len,
            layer_ids=drafter.cfg.target_layer_ids if drafter is not None else (),
            kernels=kernels.resolve(target.mesh),
            greedy=False,  # set per program: `_step_program`'s `greedy`
            draft_sampling=check_draft_sampling(draft_sampling),
        )
        self._executables = executables(treedefs, cfg, self.cycles_per_step, platform_of(target.mesh))
        self._state = DecodeState.zeros(
            self._models, cfg, num_slots=max_num_reqs, page_size=page_size, target_pages=num_pages,
            # Groups on the target's pages first, then those with pools of their own.
            draft_pages=(num_pages,) * (len(self._groups.layers) - len(windows) if self._groups else 0)
            + tuple(a.num_pages for a in window_allocators), penalties=True,
            saved_states=saved_states.capacity if saved_states else 0)
        # On a mesh the step's small inputs and the state's per-slot arrays live whole on every
        # device (the caches are split by kv head): compiled programs take fixed placements.
        self._whole = None if target.mesh is None else NamedSharding(target.mesh, PartitionSpec())
        if self._whole is not None:
            self._state = jax.tree.map(
                lambda x: x if len(x.sharding.device_set) > 1 else jax.device_put(x, self._whole), self._state)
        # Shapes of the arguments every program takes: programs compile from these alone, on
        # any thread, while steps donate and replace the arrays themselves.
        self._argument_shapes = jax.tree.map(shape_of, (self._param_leaves(), self._state))
        self._argument_shapes_key = self._executables.canonical(HashedOnce(
            (jax.tree.structure(self._argument_shapes), *jax.tree.leaves(self._argument_shapes))))
        self._keys: dict[Program, tuple] = {}
        self.programs: tuple[Program, ...] = tuple(programs(
            max_num_reqs=self._padded_reqs, max_num_tokens=self._padded_tokens, num_query=1 + self.num_drafts))
        # While another thread precompiles (a server warming up): admit only as many requests
        # as compiled programs hold, and run each batch on the smallest compiled program that
        # holds it until its own is compiled, so no step waits for a compilation.
        self.admit_within_compiled = False
        self._requests: dict[int, Request] = {}
        self._next_id = 0
        self._async_scheduling = async_scheduling
        self._launched: _Launched | None = None  # the step in flight (asynchronous scheduling)
        # Host seconds the last step that launched a batch spent launching it (choosing its
        # program, filling its inputs, dispatching): for benchmarks that split a step into
        # host and device time.
        self.last_launch_s: float | None = None
        # Drafts checked and accepted since construction (read by a server's metrics).
        self.draft_counts = DraftCounts(accepted_per_position=[0] * self.num_drafts)

    # ---- public API ---------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], sampling_params: SamplingParams | None = None, *,
                    prefill_after: int | None = None) -> int:
        """Queue a request; returns its id. Refuses (ValueError, TypeError) what could never
        run, before it takes a slot or a page: nothing about it can reach another request.
        `prefill_after`: the id of a request with the same prompt (another choice of one
        question); with prefix caching this one is admitted once that one's prompt is
        prefilled, and starts from its pages."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        prompt = check_prompt(prompt_ids, self._target.cfg.vocab_size, "prompt_ids")
        check_request(prompt.size, params.max_new_tokens, self.max_model_len, temperature=params.temperature,
                      top_k=params.top_k, top_p=params.top_p, seed=params.seed)
        stops = check_stop_token_ids(params.stop_token_ids, self._target.cfg.vocab_size)
        stop_id_array(stops, MAX_STOP_IDS)  # refuses too many
        presence, frequency, repetition = check_penalties(params.presence_penalty, params.frequency_penalty,
                                                          params.repetition_penalty)
        params = dataclasses.replace(params, max_new_tokens=int(params.max_new_tokens), top_k=int(params.top_k),
                                     seed=int(params.seed), temperature=float(params.temperature),
                                     top_p=float(params.top_p), stop_token_ids=tuple(stops),
                                     logprobs=check_logprobs(params.logprobs),
                                     logit_bias=check_logit_bias(params.logit_bias, self._target.cfg.vocab_size),
                                     min_tokens=check_count("min_tokens", params.min_tokens, 0),
                                     presence_penalty=presence, frequency_penalty=frequency,
                                     repetition_penalty=repetition)
        if params.min_tokens > params.max_new_tokens:
            raise ValueError(f"min_tokens={params.min_tokens} exceeds max_new_tokens={params.max_new_tokens}; "
                             "lower min_tokens.")
        needed = self.scheduler.pages_needed(prompt.size + params.max_new_tokens + self.draft_block_size)
        if needed > self.scheduler.allocator.num_pages - 1:
            raise ValueError(
                f"this request needs up to {needed} KV pages but the cache has "
                f"{self.scheduler.allocator.num_pages - 1}; give the Engine more num_pages or memory."
            )
        request_id = self._next_id
        self._next_id += 1
        first = None if prefill_after is None else self._request(prefill_after)
        request = Request(request_id, int(prompt.size), prompt.tolist(), params, RequestStats(), prefill_after=first)
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: int) -> None:
        request = self._requests.get(request_id)
        if request is None or request.status is Status.FINISHED:
            return
        self.scheduler.finish(request)

    def release(self, request_id: int) -> None:
        """Forget a request (aborting it if it still runs): its tokens and stats are gone, and
        a long-running server's memory stays bounded."""
        self.abort(request_id)
        self._requests.pop(request_id, None)

    @property
    def async_scheduling(self) -> bool:
        """Fixed at construction: switching with a step in flight would lose that step."""
        return self._async_scheduling

    @property
    def num_running(self) -> int:
        """Requests holding a slot now."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """The share of the target's KV cache pages held by requests, 0 to 1."""
        allocator = self.scheduler.allocator
        return 1 - allocator.num_free / (allocator.num_pages - 1)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Prompt tokens looked up in the prefix cache and found there (None: caching is off)."""
        cache = self.scheduler.prefix_cache
        return None if cache is None else cache.stats

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: 0 .. vocab_size - 1."""
        return self._target.cfg.vocab_size

    def is_waiting(self, request_id: int) -> bool:
        """Whether the request waits for a slot (not admitted yet, or preempted)."""
        return self._request(request_id).status is Status.WAITING

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self, request_id: int) -> RequestStats:
        return self._request(request_id).stats

    def output(self, request_id: int) -> list[int]:
        """Every token generated so far for the request."""
        request = self._request(request_id)
        return request.tokens[request.prompt_len :]

    def _request(self, request_id: int) -> Request:
        if request_id not in self._requests:
            raise ValueError(f"no request with id {request_id}; use an id returned by add_request.")
        return self._requests[request_id]

    def step(self) -> list[RequestOutput]:
        """Launch one scheduled batch; returns the new tokens of every request that advanced:
        in the step before this one with asynchronous scheduling, in this one without."""
        self.scheduler.max_running = self._admissible_rows() if self.admit_within_compiled else self.max_num_reqs
        work = self.scheduler.schedule()
        launched = self._launch(work) if work else None
        if launched is None and self.scheduler.running and self._launched is None:
            # Pages are always reserved to fit: this is a bug, never a wait.
            raise RuntimeError("the engine could schedule none of its running requests.")
        if not self.async_scheduling:
            return self._commit(launched) if launched else []
        previous, self._launched = self._launched, launched
        return self._commit(previous) if previous else []

    def precompile(self, progress: Callable[[Iterable], Iterable] | None = None,
                   programs: Sequence[Program] | None = None) -> int:
        """Compile the step programs (`programs`, default all of `self.programs`) up front;
        returns how many. `progress` wraps the programs' iterable (e.g.
        `functools.partial(tqdm, desc=...)`) to show how far it is. Safe to call from another
        thread while this one steps: a program that thread needs and that is compiling here
        is waited for, not compiled twice."""
        programs = self.programs if programs is None else programs
        for program in (progress or iter)(programs):
            self._executable(program)
        return len(programs)

    def is_compiled(self, program: Program) -> bool:
        return self._key(program) in self._executables.compiled

    def num_compiled(self) -> int:
        """How many of `self.programs` are compiled (by this engine or one of the same models and sizes)."""
        return sum(map(self.is_compiled, self.programs))

    def memory_analysis(self, program: Program):
        """The compiled `program`'s memory statistics (XLA's: argument, output, alias and
        temporary bytes), compiling it if need be. Its temporary bytes stay far below the
        caches' when the step updates them in place, as it should."""
        return self._executable(program).memory_analysis()

    @staticmethod
    def num_traces() -> int:
        """How many step programs have been traced (compiled) in this process."""
        return num_traces()

    # ---- launch and commit --------------------------------------------------------------

    def _step_inputs(self, num_rows: int, num_tokens: int) -> StepInputs:
        return StepInputs(num_rows=num_rows, num_tokens=num_tokens, num_query=1 + self.num_drafts,
                          pages_per_req=self.pages_per_req, max_num_reqs=self.max_num_reqs,
                          num_window_groups=len(self.scheduler.window_allocators), max_stop_ids=MAX_STOP_IDS)

    def _launch(self, work: list[Work]) -> _Launched:
        """Run the step program on `work` (asynchronously: nothing is read back here)."""
        started = time.perf_counter()
        program = self._program_for(work)
        features = StepFeatures.of(work)
        inputs = self._step_inputs(program.rows, program.tokens)
        inputs.fill(work, 1 + self.num_drafts)
        buffer = jax.device_put(inputs.buffer, self._whole)
        self._state, packed = self._executable(program, features)(self._param_leaves(), self._state, buffer)
        # Queue the tokens' copy to the host behind this step now: asked for at commit, after
        # the next step's launch, it would wait for that step too, and no two steps would overlap.
        packed.copy_to_host_async()
        self.scheduler.launched(work)
        self.last_launch_s = time.perf_counter() - started
        return _Launched(work, packed, features.logprobs)

    def _program_for(self, work: list[Work]) -> Program:
        """The batch's own program; while warming up, if that is not compiled yet, the smallest
        compiled one that holds the batch (same tokens, more padding)."""
        greedy = all(w.request.params.temperature == 0 for w in work)
        num_rows, num_tokens = len(work), sum(w.rows for w in work)
        program = program_for(num_rows, num_tokens, greedy, max_num_tokens=self._padded_tokens,
                              num_query=1 + self.num_drafts)
        if self.admit_within_compiled and not self.is_compiled(program):
            compiled = [p for p in self.programs if self.is_compiled(p) and holds(p, num_rows, num_tokens, greedy)]
            return min(compiled, key=lambda p: (p.rows * p.tokens, not p.greedy), default=program)
        return program

    def _admissible_rows(self) -> int:
        """The most requests that a compiled program holds whatever they run: the rows of the
        largest compiled sampling program at the token budget (at least 1, which then
        compiles on demand)."""
        return min(max((p.rows for p in self.programs if not p.greedy and p.tokens == self._padded_tokens
                        and self.is_compiled(p)), default=1), self.max_num_reqs)

    def _key(self, program: Program, features: StepFeatures = StepFeatures()):
        """What identifies `program`'s executable with `features` among those of engines of these models."""
        key = self._keys.get((program, features))
        if key is None:
            layout = self._step_inputs(program.rows, program.tokens).layout
            key = self._keys[program, features] = (self._argument_shapes_key, layout, program.greedy, features)
        return key

    def _executable(self, program: Program, features: StepFeatures = StepFeatures()):
        """The compiled step for `program`, compiled now if no engine of these models and
        sizes has compiled it yet. Steps with features have programs of their own, compiled
        when a step first needs one."""
        def shapes():
            inputs = self._step_inputs(program.rows, program.tokens)
            return (*self._argument_shapes, shape_of(inputs.buffer, self._whole), inputs.layout, program.greedy,
                    *dataclasses.astuple(features))

        return self._executables.get(self._key(program, features), shapes)

    def _commit(self, launched: _Launched) -> list[RequestOutput]:
        """Read a launched step's tokens (waiting for the device) and apply them cycle by
        cycle, one output per request; outputs of requests finished or preempted since the
        launch (or in an earlier cycle of it) are dropped."""
        packed = jax.device_get(launched.packed)
        outputs: dict[int, RequestOutput] = {}
        for cycle in packed[: launched.work[0].cycles]:
            tokens_RQ, count_R, stopped_R, logprobs = unpack_committed(cycle, 1 + self.num_drafts, launched.logprobs)
            for r, w in enumerate(launched.work):
                if not self.scheduler.is_current(w):
                    continue
                try:
                    row_logprobs = None if logprobs is None else tuple(part[r] for part in logprobs)
                    output = self._commit_one(w, tokens_RQ[r], int(count_R[r]), bool(stopped_R[r]), row_logprobs)
                except Exception as error:  # one request's failure ends that request, not the batch
                    self.scheduler.finish(w.request)
                    output = RequestOutput(w.request.request_id, [], True, "error")
                    w.request.stats.error = f"{type(error).__name__}: {error}"
                if output is not None:
                    earlier = outputs.get(output.request_id)
                    if earlier is not None:
                        output.new_token_ids[:0] = earlier.new_token_ids
                        if output.logprobs is not None:
                            output.logprobs[:0] = earlier.logprobs
                    outputs[output.request_id] = output
        return list(outputs.values())

    def _commit_one(self, w: Work, tokens_Q, count: int, stopped: bool, logprobs=None) -> RequestOutput | None:
        """Apply one request's share of a committed step; its output, if it got tokens.
        `logprobs`: the row's (logprob_Q, top_ids_QJ, top_logprobs_QJ), if the step has them."""
        request = w.request
        new = tokens_Q[:count].tolist() if w.samples else []
        request.tokens += new  # before the scheduler's books: the pages it publishes hold these
        self.scheduler.committed(w, count if w.verifying else 0)
        if not w.samples:
            return None
        if w.verifying and count:  # it checked the drafts its tokens left room for (`drafts_to_verify`)
            remaining = request.params.max_new_tokens - (request.num_generated - count)
            checked = min(max(remaining - 1, 0), self.num_drafts)
            self.draft_counts.add(checked, min(count - 1, checked))
        stats = request.stats
        stats.num_generated = request.num_generated
        stats.first_token_s = stats.first_token_s or time.perf_counter()
        if w.verifying:
            stats.accepted_lengths.append(count)
        reason = "stop" if stopped else "length" if request.num_generated >= request.params.max_new_tokens else None
        if reason is not None:
            self.scheduler.finish(request)
        return RequestOutput(request.request_id, new, reason is not None, reason,
                             token_logprobs(logprobs, count, request.params.logprobs))

    # ---- device state -------------------------------------------------------------------

    def _pages_for_budget(self, target, drafter, budget: int | None, num_windowed_groups: int, states: int) -> int:
        if budget is None:
            return 1 + self.max_num_reqs * self.pages_per_req
        layers = [(target, len(target.cfg.kv_layers))]
        if drafter is not None:  # windowed groups with pages of their own have their own pool
            in_pool = self._groups.layers[: len(self._groups.layers) - num_windowed_groups]
            layers.append((drafter, sum(map(len, in_pool))))
        per_page = sum(kv_cache_bytes(num_layers=n, num_pages=1, page_size=self.page_size,
                                      num_kv_heads=m.cfg.num_kv_heads, head_dim=m.cfg.head_dim, dtype=m.dtype)
                       for m, n in layers)
        return pages_within(budget, per_page, recurrent_state_bytes(target.cfg, states, target.dtype))

    def _param_leaves(self) -> tuple[list[jax.Array], ...]:
        """The models' current parameter arrays: each step reads values updated in place."""
        return flatten_models(self._models)[1]


def token_logprobs(logprobs, count: int, num_top: int | None) -> list[TokenLogprobs] | None:
    """The first `count` tokens' `TokenLogprobs` with `num_top` alternatives each, from a row's
    (logprob_Q, top_ids_QJ, top_logprobs_QJ); None if the request asked for none."""
    if num_top is None:
        return None
    logprob_Q, top_ids_QJ, top_logprobs_QJ = logprobs
    return [TokenLogprobs(float(logprob_Q[j]), tuple(zip(top_ids_QJ[j, :num_top].tolist(),
                                                          top_logprobs_QJ[j, :num_top].tolist())))
            for j in range(count)]
