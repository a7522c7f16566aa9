"""`Engine`: continuous batching of speculative decoding over paged KV caches.

Requests arrive and leave at any step. Each step the host schedules a ragged batch (prefill
chunks and 1 + N verify rows side by side, within a token budget), pads it to power-of-two
buckets, and runs one jitted program: target forward, verification (greedy or rejection
sampling), then the draft step that proposes the next block of every row. Drafts and their
distributions stay on the device, indexed by request slot, and so do each request's last
token and next position: a verify row is built on the device from them.

So the host need not know a step's tokens to schedule the next one. With asynchronous
scheduling (the default) `step()` launches step k + 1 before it reads step k's tokens: the
host's scheduling, batch building and dispatch overlap the device's work, and `step()`
returns the tokens of the step before. A request that finishes in step k still runs in step
k + 1 (unless the host knows it ends in k: its length runs out); those outputs are dropped.

When pages run out, the most recently admitted request is preempted: its pages are freed and
it is recomputed later from its prompt and the tokens it already has. A request that could
never fit is refused when it is added. Nothing a request does can touch another's pages.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from collections import deque
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import sampling
from dflash_jax.attention import resolve_attention_impl
from dflash_jax.config import check_drafter_fits_target
from dflash_jax.flat_models import flatten_models, unflatten_models
from dflash_jax.kv_cache import (
    NULL_PAGE,
    PAD_SLOT,
    DraftCacheGroups,
    OutOfPages,
    PageAllocator,
    PagedKVCache,
    kv_cache_bytes,
    slots_of,
)
from dflash_jax.models import Drafter, Target
from dflash_jax.requests import (
    check_prompt, check_request, resolve_block_size, resolve_draft_block_size,
)
from dflash_jax.steps import DraftShape, TargetBatch, draft_step, target_step
from pallas_kernels.common import next_pow2


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" or "length"


@dataclasses.dataclass
class RequestStats:
    """Per-request statistics: tokens committed per verify cycle, and timing."""

    accepted_lengths: list[int] = dataclasses.field(default_factory=list)
    num_generated: int = 0
    num_preemptions: int = 0
    arrival_s: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def tokens_per_s(self) -> float:
        end = self.finish_s or time.perf_counter()
        return self.num_generated / max(end - self.arrival_s, 1e-9)

    @property
    def mean_accepted_length(self) -> float:
        return float(np.mean(self.accepted_lengths)) if self.accepted_lengths else 0.0


class _Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class _Request:
    request_id: int
    prompt_len: int
    tokens: list[int]  # prompt + generated; the last one (the anchor) is not in the cache yet
    params: SamplingParams
    stats: RequestStats
    status: _Status = _Status.WAITING
    slot: int = -1
    epoch: int = 0  # bumped when preempted: outputs of steps launched before are dropped
    pages: list[int] = dataclasses.field(default_factory=list)
    # Per windowed drafter cache group: page per block index, NULL_PAGE once out of the window.
    window_pages: list[list[int]] = dataclasses.field(default_factory=list)
    # Positions 0..num_computed-1 have target (and draft) K/V, counting prefill chunks when
    # launched and verify steps when committed (their accepted length is known then).
    num_computed: int = 0
    # The last prefill chunk is launched: each later step verifies 1 + N rows whose anchor
    # token and position (and drafts) the device holds, for the verify step in flight too.
    decoding: bool = False
    in_flight: _Work | None = None  # this request's share of the launched, uncommitted step

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclasses.dataclass(frozen=True)
class _Work:
    """One request's share of a step: `rows` target rows, verify rows or a prefill chunk."""

    request: _Request
    rows: int
    verifying: bool
    samples: bool  # the step gives the request a token (verify, or the last prefill chunk)
    epoch: int  # the request's epoch at launch


@dataclasses.dataclass(frozen=True)
class _Launched:
    """A launched step: its work and its (not yet read) device outputs."""

    work: list[_Work]
    tokens_RQ: jax.Array
    accepted_R: jax.Array


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["target_cache", "draft_caches", "drafts", "draft_probs", "last_token", "next_pos"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class _DeviceState:
    target_cache: PagedKVCache
    draft_caches: tuple[PagedKVCache, ...]  # one per drafter cache group (DraftCacheGroups)
    drafts: jax.Array  # [max_num_reqs, N] by request slot
    draft_probs: jax.Array  # [max_num_reqs, N, V] the drafter's q for each draft
    last_token: jax.Array  # [max_num_reqs] the last sampled token: the next verify's anchor
    next_pos: jax.Array  # [max_num_reqs] its position


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "target", "window_tables", "slots", "verify_rows", "anchor_pos", "last_pos", "verifying", "num_sampled",
        "next_prefill_tokens", "temperature", "top_k", "top_p", "seeds",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class _StepBatch:
    """One step's host-built inputs; per-row arrays have the bucket's R rows. A verifying
    row's tokens, positions and slots, and its anchor position, come from the device state
    (`_verify_rows_from_state`): the host leaves them blank."""

    target: TargetBatch
    window_tables: tuple[jax.Array, ...]  # [R, max_blocks] per windowed drafter cache group
    slots: jax.Array  # [R] request slot (max_num_reqs for padding rows: writes dropped)
    verify_rows: jax.Array  # [R, 1 + N] target rows whose logits verify (prefill: last row x Q)
    anchor_pos: jax.Array  # [R] position of verify row 0 (prefill rows: their last position)
    last_pos: jax.Array  # [R] the request's last position (prompt + max new tokens - 1)
    verifying: jax.Array  # [R] bool: a verify row (anchor + drafts), not a prefill chunk
    num_sampled: jax.Array  # [R] 1 if the row samples a token this step, 0 mid-prefill
    next_prefill_tokens: jax.Array  # [R] the next prompt token of a row mid-prefill
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seeds: jax.Array


@dataclasses.dataclass(frozen=True)
class _StepShape:
    num_drafts: int
    max_model_len: int
    layer_ids: tuple[int, ...]
    layout_impl: str
    attention_impl: str
    draft_block_size: int


# Traces of the step program; a test asserts that a warmed-up engine adds none.
_traces = [0]


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
        max_model_len: int | None = None,
        layout_impl: str = "auto",
        attention_impl: str = "auto",
        draft_block_size: int | None = None,
        async_scheduling: bool = True,
    ):
        resolve_attention_impl(attention_impl)
        if drafter is not None:
            check_drafter_fits_target(target.cfg, drafter.cfg)
            block_size = resolve_block_size(drafter.cfg, block_size)
            draft_block_size = resolve_draft_block_size(drafter.cfg, block_size, draft_block_size)
        elif block_size is not None or draft_block_size is not None:
            raise ValueError("block_size and draft_block_size need a drafter; pass one, or drop them for plain decoding.")
        self.draft_block_size = draft_block_size or 1  # the drafter's block (generate's draft_block_size)
        if num_pages is not None and kv_cache_memory_bytes is not None:
            raise ValueError("give num_pages or kv_cache_memory_bytes, not both.")
        self.num_drafts = 0 if drafter is None else block_size - 1
        limit = target.cfg.max_position_embeddings
        if max_model_len is not None and not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must lie in [1, {limit}] (the target's max positions), got {max_model_len}.")
        self.max_model_len = max_model_len or limit
        for name, value in (("max_num_reqs", max_num_reqs), ("max_num_tokens", max_num_tokens)):
            if value < 1 or value != next_pow2(value):
                raise ValueError(f"{name} must be a power of two (batches are padded to those), got {value}.")
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        if max_num_tokens < max_num_reqs * (1 + self.num_drafts):
            raise ValueError(
                f"max_num_tokens={max_num_tokens} cannot hold {max_num_reqs} requests x "
                f"{1 + self.num_drafts} verify rows; raise it or lower max_num_reqs."
            )
        self.page_size = page_size
        # Room for every position a request can touch: its tokens, a verify block and the
        # draft query rows after it.
        self.max_blocks = self._pages_needed(self.max_model_len + self._lookahead)
        self._groups = DraftCacheGroups.for_drafter(drafter.cfg) if drafter else None
        num_pages = num_pages or self._pages_for_budget(target, drafter, kv_cache_memory_bytes)
        self.allocator = PageAllocator(num_pages)
        # Windowed groups hold at most a window plus one step per request: a fixed pool.
        self._window_allocators = [
            PageAllocator(1 + max_num_reqs * self._pages_needed(w + max_num_tokens + 2 * self._lookahead + 2 * page_size))
            for w in (self._groups.windows[1:] if self._groups else ())
        ]
        self._target, self._drafter = target, drafter
        self._models = (target,) if drafter is None else (target, drafter)
        treedefs, _ = flatten_models(self._models)
        shape = _StepShape(
            num_drafts=self.num_drafts,
            max_model_len=self.max_model_len,
            layer_ids=drafter.cfg.target_layer_ids if drafter is not None else (),
            layout_impl=layout_impl,
            attention_impl=attention_impl,
            draft_block_size=self.draft_block_size,
        )
        self._step_program = _step_program(treedefs, shape)
        self._state = self._initial_state(num_pages)
        self._requests: dict[int, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))
        self._next_id = 0
        self._async_scheduling = async_scheduling
        self._launched: _Launched | None = None  # the step in flight (asynchronous scheduling)

    # ---- public API ---------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], sampling_params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Refuses (ValueError) what could never run."""
        params = sampling_params or SamplingParams()
        prompt = check_prompt(prompt_ids, self._target.cfg.vocab_size, "prompt_ids")
        check_request(prompt.size, params.max_new_tokens, self.max_model_len, temperature=params.temperature,
                      top_k=params.top_k, top_p=params.top_p, seed=params.seed)
        needed = self._pages_needed(prompt.size + params.max_new_tokens + self._lookahead)
        if needed > self.allocator.num_pages - 1:
            raise ValueError(
                f"this request needs up to {needed} KV pages but the cache has "
                f"{self.allocator.num_pages - 1}; give the Engine more num_pages or memory."
            )
        request_id = self._next_id
        self._next_id += 1
        request = _Request(request_id, int(prompt.size), prompt.tolist(), params, RequestStats())
        self._requests[request_id] = request
        self._waiting.append(request)
        return request_id

    def abort(self, request_id: int) -> None:
        request = self._requests.get(request_id)
        if request is None or request.status is _Status.FINISHED:
            return
        if request in self._waiting:
            self._waiting.remove(request)
        self._finish(request)

    @property
    def async_scheduling(self) -> bool:
        """Fixed at construction: switching with a step in flight would lose that step."""
        return self._async_scheduling

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def stats(self, request_id: int) -> RequestStats:
        return self._request(request_id).stats

    def output(self, request_id: int) -> list[int]:
        """Every token generated so far for the request."""
        request = self._request(request_id)
        return request.tokens[request.prompt_len :]

    def _request(self, request_id: int) -> _Request:
        if request_id not in self._requests:
            raise ValueError(f"no request with id {request_id}; use an id returned by add_request.")
        return self._requests[request_id]

    def step(self) -> list[RequestOutput]:
        """Launch one scheduled batch; returns the new tokens of every request that advanced:
        in the step before this one with asynchronous scheduling, in this one without."""
        work = self._schedule()
        launched = self._launch(work) if work else None
        if launched is None and self._running and self._launched is None:
            # Pages are always reserved to fit: this is a bug, never a wait.
            raise RuntimeError("the engine could schedule none of its running requests.")
        if not self.async_scheduling:
            return self._commit(launched) if launched else []
        previous, self._launched = self._launched, launched
        return self._commit(previous) if previous else []

    def precompile(self) -> int:
        """Compile every step program up front, for each (rows, tokens) bucket a greedy and a
        sampling one, by running inert batches through them (every write of an inert batch is
        dropped); returns how many programs there are."""
        buckets = sorted({
            (next_pow2(num_rows), self._token_bucket(num_tokens, num_rows))
            for num_rows in range(1, self.max_num_reqs + 1)
            for num_tokens in range(num_rows, self.max_num_tokens + 1)
        })
        leaves = self._param_leaves()
        for num_rows, num_tokens in buckets:
            inert = self._host_batch(num_rows, num_tokens)
            for greedy in (True, False):
                self._state, *_ = self._step_program(leaves, self._state, *inert.to_device(), inert.layout, greedy)
        return 2 * len(buckets)

    @staticmethod
    def num_traces() -> int:
        """How many step programs have been traced (compiled) in this process."""
        return _traces[0]

    # ---- scheduling ---------------------------------------------------------------------

    def _token_bucket(self, num_tokens: int, num_rows: int) -> int:
        """Static token count of a batch: a power of two, at least 8 rows unless the budget is smaller."""
        return min(max(next_pow2(num_tokens), 8, next_pow2(num_rows)), self.max_num_tokens)

    def _schedule(self) -> list[_Work]:
        """Running requests first (verify rows), then admissions; prefill takes what is left.

        A request's step in flight may be uncommitted: its verify rows' count is known, not
        how many were accepted, so pages are reserved for all of them."""
        while self._waiting and len(self._running) < self.max_num_reqs:
            request = self._waiting.popleft()
            request.status, request.slot = _Status.RUNNING, self._free_slots.pop()
            self._running.append(request)
        budget = self.max_num_tokens
        work: list[_Work] = []
        ending: list[_Request] = []  # finished by the step in flight: their pages free at its commit
        for request in list(self._running):
            if request.status is not _Status.RUNNING:
                continue  # preempted while scheduling an earlier request
            flight = request.in_flight
            if request.decoding:
                if flight is not None and request.num_generated + 1 >= request.params.max_new_tokens:
                    ending.append(request)  # the step in flight gives its last token
                    continue
                rows = 1 + self.num_drafts
                # The anchor is at most the step in flight's verify rows past num_computed.
                end = request.num_computed + (rows if flight is not None and flight.verifying else 0) + rows
            else:
                rows = min(len(request.tokens) - request.num_computed, budget)
                end = request.num_computed + rows
            if not 0 < rows <= budget:
                continue
            if not self._reserve(request, end + self._lookahead, ending + [w.request for w in work]):
                continue
            samples = request.decoding or end == len(request.tokens)
            work.append(_Work(request, rows, request.decoding, samples, request.epoch))
            budget -= rows
        return work

    def _launch(self, work: list[_Work]) -> _Launched:
        """Run the step program on `work` (asynchronously: nothing is read back here)."""
        batch = self._build_batch(work)
        self._state, tokens_RQ, accepted_R = self._step_program(self._param_leaves(), self._state, *batch.to_device(),
                                                                batch.layout, batch.greedy)
        for w in work:
            w.request.in_flight = w
            if not w.verifying:  # a prefill chunk's rows are all computed
                w.request.num_computed += w.rows
                w.request.decoding = w.samples
        return _Launched(work, tokens_RQ, accepted_R)

    @property
    def _lookahead(self) -> int:
        """Positions past a step's rows that a step writes: the drafter's block (at least the
        verify block; 1 without a drafter)."""
        return self.draft_block_size

    def _reserve(self, request: _Request, num_positions: int, protected: list[_Request]) -> bool:
        """Pages for positions < num_positions, preempting the newest unscheduled others.

        Capped at what the request can ever touch (its longest sequence and one draft block
        after it), which `add_request` checked fits the cache.
        """
        longest = request.prompt_len + request.params.max_new_tokens + self._lookahead
        blocks = self._pages_needed(min(num_positions, longest))
        missing = blocks - len(request.pages)
        while missing > 0:
            try:
                request.pages += self.allocator.allocate(missing)
                break
            except OutOfPages:
                victims = [r for r in self._running if r is not request and r not in protected and r.pages]
                if not victims:
                    return False
                self._preempt(victims[-1])
        if not request.window_pages:
            request.window_pages = [[] for _ in self._window_allocators]
        for table, allocator in zip(request.window_pages, self._window_allocators):
            table += allocator.allocate(max(blocks - len(table), 0))  # sized never to run out
        return True

    def _evict_out_of_window(self, request: _Request) -> None:
        """Give back windowed-group pages no future query can see (spec section 2's window)."""
        for table, allocator, window in zip(request.window_pages, self._window_allocators, self._groups.windows[1:]):
            # The next queries sit at positions >= num_computed and see keys >= q - (W - 1). A
            # prefill chunk in flight may still read a page freed here: steps run on the device
            # in launch order, so whoever gets the page next writes it after that chunk.
            first_visible = request.num_computed - window + 1
            for block in range(max(first_visible, 0) // self.page_size):
                if table[block] != NULL_PAGE:
                    allocator.free([table[block]])
                    table[block] = NULL_PAGE

    def _free_pages(self, request: _Request) -> None:
        self.allocator.free(request.pages)
        for table, allocator in zip(request.window_pages, self._window_allocators):
            allocator.free([page for page in table if page != NULL_PAGE])
        request.pages, request.window_pages = [], []

    def _preempt(self, request: _Request) -> None:
        self._free_pages(request)
        self._running.remove(request)
        self._free_slots.append(request.slot)
        request.slot, request.num_computed = -1, 0
        request.status, request.decoding, request.in_flight = _Status.WAITING, False, None
        request.epoch += 1
        request.stats.num_preemptions += 1
        self._waiting.appendleft(request)

    def _finish(self, request: _Request) -> None:
        """Free the request's slot and pages now, even with a step of it in flight: steps run
        on the device in launch order (each takes the state the last one donated), so a
        later owner's writes land after that step."""
        if request in self._running:
            self._running.remove(request)
            self._free_slots.append(request.slot)
        self._free_pages(request)
        request.slot, request.in_flight = -1, None
        request.status = _Status.FINISHED
        request.stats.finish_s = time.perf_counter()

    def _pages_needed(self, num_positions: int) -> int:
        return -(-num_positions // self.page_size)

    # ---- batches ------------------------------------------------------------------------

    def _build_batch(self, work: list[_Work]) -> _HostBatch:
        num_rows = next_pow2(len(work))
        host = self._host_batch(num_rows, self._token_bucket(sum(w.rows for w in work), len(work)))
        q = 1 + self.num_drafts
        start = 0
        for r, w in enumerate(work):
            request, rows = w.request, w.rows
            span = slice(start, start + rows)
            if w.verifying:  # tokens and positions from the device state
                host.verify_rows[r] = start + np.arange(q)
            else:
                positions = np.arange(request.num_computed, request.num_computed + rows)
                host.tokens[span] = request.tokens[request.num_computed : request.num_computed + rows]
                host.positions[span] = positions
                host.verify_rows[r] = start + rows - 1
                host.anchor_pos[r] = positions[-1]
                if not w.samples:
                    host.next_prefill[r] = request.tokens[request.num_computed + rows]
            host.verifying[r] = w.verifying
            host.num_sampled[r] = int(w.samples)
            host.rows[span] = r
            host.block_table[r, : len(request.pages)] = request.pages
            for window_table, pages in zip(host.window_tables, request.window_pages):
                window_table[r, : len(pages)] = pages
            host.last_pos[r] = request.prompt_len + request.params.max_new_tokens - 1
            host.slot[r] = request.slot
            p = request.params
            host.temperature[r], host.top_k[r], host.top_p[r], host.seeds[r] = p.temperature, p.top_k, p.top_p, p.seed
            start += rows
            host.query_start_loc[r + 1] = start
        host.query_start_loc[len(work) + 1 :] = start
        return host

    def _host_batch(self, num_rows: int, num_tokens: int) -> _HostBatch:
        return _HostBatch(num_rows, num_tokens, 1 + self.num_drafts, self.max_blocks, self.max_num_reqs,
                          num_window_groups=len(self._window_allocators))

    def _commit(self, launched: _Launched) -> list[RequestOutput]:
        """Read a launched step's tokens (waiting for the device) and apply them; outputs of
        requests finished or preempted since the launch are dropped."""
        tokens_RQ, accepted_R = jax.device_get((launched.tokens_RQ, launched.accepted_R))
        outputs = []
        for r, w in enumerate(launched.work):
            request = w.request
            if request.status is _Status.FINISHED or request.epoch != w.epoch:
                continue
            if request.in_flight is w:
                request.in_flight = None
            accepted = 0
            if w.verifying:
                accepted = int(accepted_R[r])
                request.num_computed += accepted + 1
            if self._window_allocators:
                self._evict_out_of_window(request)
            if not w.samples:
                continue
            new = [int(t) for t in tokens_RQ[r, : accepted + 1]]
            params = request.params
            new = new[: params.max_new_tokens - request.num_generated]
            reason = None
            for i, token in enumerate(new):
                if token in params.stop_token_ids:
                    new, reason = new[: i + 1], "stop"
                    break
            request.tokens += new
            stats = request.stats
            stats.num_generated = request.num_generated
            stats.first_token_s = stats.first_token_s or time.perf_counter()
            if w.verifying:
                stats.accepted_lengths.append(len(new))
            if reason is None and request.num_generated >= params.max_new_tokens:
                reason = "length"
            if reason is not None:
                self._finish(request)
            outputs.append(RequestOutput(request.request_id, new, reason is not None, reason))
        return outputs

    # ---- device state -------------------------------------------------------------------

    def _pages_for_budget(self, target, drafter, budget: int | None) -> int:
        if budget is None:
            return 1 + self.max_num_reqs * self.max_blocks
        layers = [(target, target.cfg.num_layers)]
        if drafter is not None:
            layers.append((drafter, len(self._groups.layers[0])))  # windowed groups have their own pool
        per_page = sum(
            kv_cache_bytes(num_layers=n, num_pages=1, page_size=self.page_size,
                           num_kv_heads=m.cfg.num_kv_heads, head_dim=m.cfg.head_dim, dtype=m.dtype)
            for m, n in layers
        )
        return max(2, budget // per_page)

    def _param_leaves(self) -> tuple[list[jax.Array], ...]:
        """The models' current parameter arrays: each step reads values updated in place."""
        return flatten_models(self._models)[1]

    def _initial_state(self, num_pages: int) -> _DeviceState:
        draft_caches = ()
        if self._drafter is not None:
            pools = [num_pages] + [allocator.num_pages for allocator in self._window_allocators]
            draft_caches = tuple(
                PagedKVCache.for_model(self._drafter, len(layers), pages, self.page_size)
                for layers, pages in zip(self._groups.layers, pools)
            )
        n, vocab = self.num_drafts, self._target.cfg.vocab_size
        return _DeviceState(
            target_cache=PagedKVCache.for_model(self._target, self._target.cfg.num_layers, num_pages, self.page_size),
            draft_caches=draft_caches,
            drafts=jnp.zeros((self.max_num_reqs, n), jnp.int32),
            draft_probs=jnp.zeros((self.max_num_reqs, n, vocab), jnp.float32),
            last_token=jnp.zeros((self.max_num_reqs,), jnp.int32),
            next_pos=jnp.zeros((self.max_num_reqs,), jnp.int32),
        )


class _HostBatch:
    """One step's inputs as numpy views into one int32 and one float32 buffer, filled row by
    row, then moved to the device as those two arrays (as a pytree of 18 arrays the move took
    18 transfers). `layout`, static, is how the step program cuts them apart (`_unpack`)."""

    def __init__(self, num_rows, num_tokens, q, max_blocks, max_num_reqs, num_window_groups):
        T, R = num_tokens, num_rows
        int_fields = [
            ("tokens", (T,), 0), ("positions", (T,), 0), ("rows", (T,), 0),
            ("query_start_loc", (R + 1,), 0), ("block_table", (R, max_blocks), NULL_PAGE),
            *((f"window_table_{i}", (R, max_blocks), NULL_PAGE) for i in range(num_window_groups)),
            ("verify_rows", (R, q), 0), ("slot", (R,), max_num_reqs), ("anchor_pos", (R,), 0),
            ("last_pos", (R,), 0), ("verifying", (R,), 0), ("num_sampled", (R,), 0), ("next_prefill", (R,), 0),
            ("top_k", (R,), 0), ("seeds", (R,), 0),
        ]
        float_fields = [("temperature", (R,), 0.0), ("top_p", (R,), 1.0)]
        self.ints, int_layout = self._buffer(int_fields, np.int32)
        self.floats, float_layout = self._buffer(float_fields, np.float32)
        self.layout = (int_layout, float_layout)
        self.window_tables = tuple(getattr(self, f"window_table_{i}") for i in range(num_window_groups))

    def _buffer(self, fields, dtype):
        """One buffer for `fields` (name, shape, fill value), each also set as a named view."""
        sizes = [int(np.prod(shape)) for _, shape, _ in fields]
        buffer = np.empty(sum(sizes), dtype)
        layout, offset = [], 0
        for (name, shape, fill), size in zip(fields, sizes):
            view = buffer[offset : offset + size].reshape(shape)
            view[...] = fill
            setattr(self, name, view)
            layout.append((name, shape, offset))
            offset += size
        return buffer, tuple(layout)

    @property
    def greedy(self) -> bool:
        """Every row at temperature 0 (padding rows are): the step's greedy program."""
        return not self.temperature.any()

    def to_device(self) -> tuple[jax.Array, jax.Array]:
        return jax.device_put((self.ints, self.floats))


def _unpack(ints, floats, layout) -> _StepBatch:
    """The step's `_StepBatch` from a `_HostBatch`'s two buffers and static layout."""
    f = {name: buffer[offset : offset + int(np.prod(shape))].reshape(shape)
         for buffer, fields in zip((ints, floats), layout) for name, shape, offset in fields}
    target = TargetBatch(
        token_ids=f["tokens"], positions=f["positions"], rows=f["rows"], slots=None,  # `_verify_rows_from_state`
        query_start_loc=f["query_start_loc"], block_table=f["block_table"], logits_rows=f["verify_rows"].reshape(-1),
    )
    window_tables = tuple(f[name] for name, _, _ in layout[0] if name.startswith("window_table_"))
    return _StepBatch(
        target=target, window_tables=window_tables, slots=f["slot"], verify_rows=f["verify_rows"],
        anchor_pos=f["anchor_pos"], last_pos=f["last_pos"], verifying=f["verifying"] != 0,
        num_sampled=f["num_sampled"], next_prefill_tokens=f["next_prefill"], temperature=f["temperature"],
        top_k=f["top_k"], top_p=f["top_p"], seeds=f["seeds"],
    )


@functools.lru_cache(maxsize=None)
def _step_program(treedefs, shape: _StepShape):
    """The jitted step of engines with these models' structures and shape, made once per
    (treedefs, shape): engines of one model share its compiled programs.

    Parameters travel as flat lists of arrays (`flat_models`). With the graph definitions and
    the nnx State as jit arguments, each `step()` hashed the graph and flattened the State in
    Python: dispatching a 36-layer model's step took 5.9 ms on a 2-core CPU host, 1.5 ms
    with flat arrays."""

    def step(param_leaves, state, ints, floats, layout, greedy):
        return _engine_step(unflatten_models(treedefs, param_leaves), state, _unpack(ints, floats, layout),
                            shape=shape, greedy=greedy)

    return jax.jit(step, donate_argnums=1, static_argnums=(4, 5))


def _engine_step(models, state: _DeviceState, batch: _StepBatch, *, shape: _StepShape, greedy: bool):
    """Target forward, verification, next drafts: one program per (rows, tokens) bucket and
    per `greedy` (every row at temperature 0: sampling compiles to argmaxes, and the draft
    probabilities, which only sampled rows read, are neither read nor written)."""
    _traces[0] += 1
    target = models[0]
    num_rows, num_query = batch.verify_rows.shape
    n = shape.num_drafts
    rows_R = jnp.arange(num_rows)
    slot_R = jnp.minimum(batch.slots, state.next_pos.shape[0] - 1)  # padding rows read the last slot, write nothing
    target_batch, anchor_pos_R = _verify_rows_from_state(batch, state, slot_R)
    drafts_RN = state.drafts[slot_R]
    num_drafts_R = jnp.where(batch.verifying, jnp.clip(batch.last_pos - anchor_pos_R - 1, 0, n), 0)
    if n:  # the verify rows' drafts
        num_tokens = target_batch.token_ids.shape[0]  # an out-of-range row: the write is dropped
        draft_rows_RN = jnp.where(batch.verifying[:, None], batch.verify_rows[:, 1:], num_tokens)
        tokens = target_batch.token_ids.at[draft_rows_RN].set(drafts_RN, mode="drop")
        target_batch = dataclasses.replace(target_batch, token_ids=tokens)
    target_cache, logits, features = target_step(target, state.target_cache, target_batch, shape.layer_ids,
                                                  shape.attention_impl)
    logits_RQV = logits.reshape(num_rows, num_query, -1)
    if not n:
        token_R = sampling.sample_target(logits_RQV[:, 0], batch.temperature, batch.top_k, batch.top_p, batch.seeds,
                                         anchor_pos_R, greedy=greedy)
        state = _advance(dataclasses.replace(state, target_cache=target_cache), batch, token_R, anchor_pos_R + 1)
        return state, token_R[:, None], jnp.zeros_like(token_R)

    draft_probs_RNV = None if greedy else state.draft_probs[slot_R]
    tokens_RQ, accepted_R = sampling.rejection_sample(
        logits_RQV, drafts_RN, draft_probs_RNV, num_drafts_R, batch.temperature, batch.top_k, batch.top_p,
        batch.seeds, anchor_pos_R, greedy=greedy,
    )
    bonus_R = tokens_RQ[rows_R, accepted_R]
    drafter = models[1]
    draft_caches, draft_logits_RNV = draft_step(
        target, drafter, state.draft_caches, (target_batch.block_table, *batch.window_tables), target_batch, features,
        num_rejected_R=jnp.where(batch.verifying, n - accepted_R, 0),
        num_sampled_R=batch.num_sampled,
        last_sampled_R=bonus_R,
        next_prefill_tokens_R=batch.next_prefill_tokens,
        shape=DraftShape(n, shape.max_model_len, shape.layout_impl, shape.attention_impl, shape.draft_block_size),
    )
    next_anchor_pos_R = anchor_pos_R + accepted_R + 1
    new_drafts_RN, new_probs_RNV = sampling.sample_drafts(
        draft_logits_RNV, batch.temperature, batch.top_k, batch.top_p, batch.seeds, next_anchor_pos_R, greedy=greedy
    )
    state = dataclasses.replace(
        state,
        target_cache=target_cache,
        draft_caches=draft_caches,
        drafts=state.drafts.at[batch.slots].set(new_drafts_RN, mode="drop"),
        draft_probs=state.draft_probs if greedy else state.draft_probs.at[batch.slots].set(new_probs_RNV, mode="drop"),
    )
    return _advance(state, batch, bonus_R, next_anchor_pos_R), tokens_RQ, accepted_R


def _verify_rows_from_state(batch: _StepBatch, state: _DeviceState, slot_R) -> tuple[TargetBatch, jax.Array]:
    """(target batch, anchor position per row): verify rows get their anchor token and
    positions from the device state, every real token its KV slot."""
    target = batch.target
    anchor_pos_R = jnp.where(batch.verifying, state.next_pos[slot_R], batch.anchor_pos)
    num_tokens = target.token_ids.shape[0]
    t = jnp.arange(num_tokens)
    real_T = t < target.query_start_loc[-1]
    from_state_T = real_T & batch.verifying[target.rows]
    positions_T = jnp.where(from_state_T, anchor_pos_R[target.rows] + t - target.query_start_loc[target.rows],
                            target.positions)
    first_rows_R = jnp.where(batch.verifying, target.query_start_loc[:-1], num_tokens)
    tokens_T = target.token_ids.at[first_rows_R].set(state.last_token[slot_R], mode="drop")
    slots_T = jnp.where(real_T, slots_of(target.block_table, positions_T, state.target_cache.page_size, target.rows),
                        PAD_SLOT)
    return dataclasses.replace(target, token_ids=tokens_T, positions=positions_T, slots=slots_T), anchor_pos_R


def _advance(state: _DeviceState, batch: _StepBatch, token_R, next_pos_R) -> _DeviceState:
    """Record each sampling row's new last token and its position: the next verify's anchor."""
    slots_R = jnp.where(batch.num_sampled > 0, batch.slots, state.next_pos.shape[0])
    return dataclasses.replace(
        state,
        last_token=state.last_token.at[slots_R].set(token_R, mode="drop"),
        next_pos=state.next_pos.at[slots_R].set(next_pos_R, mode="drop"),
    )
