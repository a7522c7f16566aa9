"""Host-side scheduling for the Engine: waiting and running requests, request slots, KV pages,
preemption, window eviction and prefix-cache hits. No model and no device here: it decides what the next step
runs and keeps each request's bookkeeping, and the Engine turns that into a device step.

Each step runs the running requests first (1 + N verify rows each), then admits waiting ones
into free slots; prefill chunks take the token budget that is left. A step in which every
request decodes may run several verify cycles on the device (`cycles_per_step`): the host's
work per step is then spread over that many cycles. Pages are reserved for
everything a step may write; when they run out, the most recently admitted request that is
not in this step is preempted: its pages and slot are freed, and it is recomputed later from
its prompt and the tokens it already has. With a `PrefixCache` as the allocator, a request
admitted starts from the longest run of cached full pages of its tokens, and publishes each
page it fills. A request's step in flight may be uncommitted (the
Engine launches step k + 1 before it reads step k): its verify rows' count is known then, not
how many of them were accepted, so pages are reserved for all of them, in every cycle.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections import deque

from dflash_jax.kv_cache import NULL_PAGE, OutOfPages, PageAllocator
from dflash_jax.prefix_cache import PrefixCache, extend_page_keys
from dflash_jax.prefix_states import SavedStates
from dflash_jax.requests import RequestStats, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    request_id: int
    prompt_len: int
    tokens: list[int]  # prompt + generated; the last one (the anchor) is not in the cache yet
    params: SamplingParams
    stats: RequestStats
    status: Status = Status.WAITING
    slot: int = -1
    epoch: int = 0  # bumped when preempted: outputs of steps launched before are dropped
    pages: list[int] = dataclasses.field(default_factory=list)
    # Per windowed drafter cache group: page per page index, NULL_PAGE once out of the window.
    window_pages: list[list[int]] = dataclasses.field(default_factory=list)
    # Positions 0..num_computed-1 have target (and draft) K/V, counting prefill chunks when
    # launched and verify steps when committed (their accepted length is known then).
    num_computed: int = 0
    # The last prefill chunk is launched: each later step verifies 1 + N rows whose anchor
    # token and position (and drafts) the device holds, for the verify step in flight too.
    decoding: bool = False
    in_flight: Work | None = None  # this request's share of the launched, uncommitted step
    # Prefix caching: the hash chain of the full pages known so far, and how many of its
    # pages are published (or were found cached).
    page_keys: list[bytes] = dataclasses.field(default_factory=list)
    num_published: int = 0
    # With prefix caching: a request with the same prompt (another choice of one question)
    # that this one waits for before it is admitted, so as to start from its cached pages.
    prefill_after: Request | None = None
    # A hybrid target's saved state (`prefix_states`) the first chunk starts from; -1: none
    restore_from: int = -1

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def prefill_end(self) -> int:
        """Positions a prefill computes: the whole prompt, or for a request recomputed after
        preemption everything but its last token, which the next step verifies with drafts
        as it would have had the request not stopped (so sampled tokens do not depend on
        preemption)."""
        return len(self.tokens) - (1 if self.num_generated else 0)

    @property
    def last_pos(self) -> int:
        """The last position the request may reach (prompt + max new tokens - 1)."""
        return self.prompt_len + self.params.max_new_tokens - 1


@dataclasses.dataclass(frozen=True, eq=False)
class Work:
    """One request's share of a step: `rows` target rows, verify rows or a prefill chunk."""

    request: Request
    rows: int
    verifying: bool
    samples: bool  # the step gives the request a token (verify, or the last chunk of a fresh prefill)
    epoch: int  # the request's epoch at launch
    ends_prefill: bool = False  # the request decodes after this chunk
    cycles: int = 1  # verify cycles the step runs (each commits at least one token while the request lasts)
    restore: int = -1  # a prefill chunk's saved state to start from (`prefix_states`)
    save: int = -1  # where to save the state after a prefill chunk


class Scheduler:
    """Which requests run in the next step, in which slot, on which pages."""

    def __init__(self, *, max_num_reqs: int, max_num_tokens: int, num_drafts: int, lookahead: int, page_size: int,
                 allocator: PageAllocator, window_allocators: list[PageAllocator], windows: tuple[int, ...],
                 cycles_per_step: int = 1, saved_states: SavedStates | None = None):
        self.max_num_reqs = max_num_reqs
        self.cycles_per_step = cycles_per_step  # verify cycles a step of decoding requests runs at most
        self.max_num_tokens = max_num_tokens
        self.num_drafts = num_drafts
        self.lookahead = lookahead  # positions past a step's rows that it writes (the drafter's block)
        self.page_size = page_size
        self.allocator = allocator
        self.prefix_cache = allocator if isinstance(allocator, PrefixCache) else None
        self.saved_states = saved_states  # a hybrid target's: a prefix is reusable where its state was saved
        self.window_allocators = window_allocators  # one per windowed drafter cache group
        self.windows = windows  # their windows
        self.max_running = max_num_reqs  # requests admitted at most (the Engine lowers it while warming up)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))

    def pages_needed(self, num_positions: int) -> int:
        return -(-num_positions // self.page_size)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[Work]:
        """This step's work: running requests first (verify rows), then admissions; prefill
        takes what is left of the token budget."""
        while self.waiting and len(self.running) < self.max_running:
            request = next((r for r in self.waiting if self._admissible(r)), None)
            if request is None:
                break
            self.waiting.remove(request)
            request.status, request.slot = Status.RUNNING, self._free_slots.pop()
            self.running.append(request)
            if self.prefix_cache is not None and not request.params.penalized:
                # A penalized request prefills from its start: its first step counts its tokens.
                self._start_from_cached_pages(request)
        budget = self.max_num_tokens
        work: list[Work] = []
        ending: list[Request] = []  # finished by the step in flight: their pages free at its commit
        cycles = self._cycles()
        for request in list(self.running):
            if request.status is not Status.RUNNING:
                continue  # preempted while scheduling an earlier request
            if request.decoding:
                if self._tokens_left(request) <= 0:
                    ending.append(request)  # the step in flight gives its last token
                    continue
                rows = 1 + self.num_drafts
                end = self._verified_end(request, cycles)
            else:
                end = self._chunk_end(request, min(request.prefill_end, request.num_computed + budget))
                rows = end - request.num_computed
            if not 0 < rows <= budget:
                continue
            if not self._reserve(request, end + self.lookahead, ending + [w.request for w in work]):
                continue
            samples = request.decoding or end == len(request.tokens)
            work.append(Work(request, rows, request.decoding, samples, request.epoch,
                             ends_prefill=not request.decoding and end == request.prefill_end,
                             cycles=cycles if request.decoding else 1,
                             restore=-1 if request.decoding else request.restore_from,
                             save=-1 if request.decoding else self._save_slot(request, end)))
            budget -= rows
        return work

    def _tokens_left(self, request: Request) -> int:
        """Tokens the request may still get beyond the step in flight's: at most this many
        cycles are of use to it, since each cycle commits at least one."""
        flight = request.in_flight
        in_flight = flight.cycles if flight is not None and flight.samples else 0
        return request.params.max_new_tokens - request.num_generated - in_flight

    def _verified_end(self, request: Request, cycles: int) -> int:
        """The end of the positions a decoding request's next step of `cycles` cycles may
        write: its anchor is at most the step in flight's verify rows past num_computed."""
        rows, flight = 1 + self.num_drafts, request.in_flight
        in_flight = flight.cycles * rows if flight is not None and flight.verifying else 0
        return request.num_computed + in_flight + cycles * rows

    def _cycles(self) -> int:
        """Cycles for the next step: when every running request decodes, as many as the one
        with most tokens left may use (`cycles_per_step` at most), if the pages for them are
        free without preempting anyone; else one. The step ends on the device once no row
        has anything left to commit, so a cycle past every request's end is never run."""
        if self.cycles_per_step == 1 or not all(r.decoding for r in self.running):
            return 1
        going_on = [r for r in self.running if self._tokens_left(r) > 0]
        if not going_on:
            return 1
        cycles = min(self.cycles_per_step, max(map(self._tokens_left, going_on)))
        missing = sum(max(self.pages_needed(min(self._verified_end(r, cycles) + self.lookahead, self._longest(r)))
                          - len(r.pages), 0) for r in going_on)
        return cycles if missing <= self.allocator.num_free else 1

    def _boundary(self, request: Request, end: int) -> int | None:
        """A hybrid target's first saving boundary in the chunk from the request's computed
        positions to `end`; the last one a later request can start from is the prompt's last
        full page before its last position."""
        if self.saved_states is None:
            return None
        last = (request.prefill_end - 1) // self.page_size * self.page_size
        return self.saved_states.next_boundary(request.num_computed, end, last)

    def _chunk_end(self, request: Request, end: int) -> int:
        """A prefill chunk's end: `end`, or the first saving boundary before it."""
        boundary = self._boundary(request, end)
        return end if boundary is None else boundary

    def _save_slot(self, request: Request, end: int) -> int:
        """Where a chunk ending at `end` saves its state (-1: it does not end at a boundary)."""
        if self._boundary(request, end) != end:
            return -1
        pages = end // self.page_size  # the request's keys may run past `end` (admission hashed its full pages)
        keys = extend_page_keys(request.page_keys, request.tokens, self.page_size, pages)
        slot = self.saved_states.claim(keys[pages - 1])
        return -1 if slot is None else slot

    def launched(self, work: list[Work]) -> None:
        """Record that `work` is on the device: prefill chunks' rows are all computed now."""
        for w in work:
            w.request.in_flight = w
            if w.restore >= 0:  # read by this step: the saved state may be overwritten after it
                self.saved_states.unpin(w.restore)
                w.request.restore_from = -1
            if w.save >= 0:  # written by this step
                self.saved_states.unpin(w.save)
            if not w.verifying:
                w.request.num_computed += w.rows
                w.request.decoding = w.ends_prefill
                self._publish(w.request)

    def is_current(self, w: Work) -> bool:
        """Whether a launched share still counts: its request was neither finished nor
        preempted since the launch."""
        return w.request.status is not Status.FINISHED and w.request.epoch == w.epoch

    def committed(self, w: Work, num_verified: int) -> None:
        """Record a launched share's commit: `num_verified` verify rows now have K/V."""
        request = w.request
        if request.in_flight is w:
            request.in_flight = None
        request.num_computed += num_verified
        self._publish(request)
        if self.window_allocators:
            self._evict_out_of_window(request)

    def finish(self, request: Request) -> None:
        """Free the request's slot and pages now, even with a step of it in flight: steps run
        on the device in launch order (each takes the state the last one donated), so a
        later owner's writes land after that step."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
            self._free_slots.append(request.slot)
        self._free_pages(request)
        request.slot, request.in_flight = -1, None
        request.status = Status.FINISHED
        request.stats.finish_s = time.perf_counter()

    def _admissible(self, request: Request) -> bool:
        """Whether a waiting request may take a slot: unless the request it waits for is still
        to launch its last prefill chunk (whose pages it would then find cached)."""
        first = request.prefill_after
        if first is None or self.prefix_cache is None or first.status is Status.FINISHED:
            return True
        return first.status is Status.RUNNING and first.decoding

    def _start_from_cached_pages(self, request: Request) -> None:
        """Give a request just admitted the cached pages of its longest cached prefix: those
        positions count as computed. At least its last prefill position is left to compute,
        since the step that computes it gives the request its next token (or anchor)."""
        num_pages = (request.prefill_end - 1) // self.page_size
        keys = extend_page_keys(request.page_keys, request.tokens, self.page_size, num_pages)
        request.pages = self.prefix_cache.match(keys[:num_pages])
        if self.saved_states is not None:  # a hybrid target starts where a state was saved
            depth, request.restore_from = self.saved_states.deepest(keys[:len(request.pages)]) or (0, -1)
            self.prefix_cache.free(request.pages[depth:])
            request.pages = request.pages[:depth]
        request.num_published = len(request.pages)
        request.num_computed = request.num_published * self.page_size
        if not request.stats.num_preemptions:  # reported as at the first admission
            request.stats.num_cached_tokens = request.num_computed
        self.prefix_cache.stats.queries += request.prefill_end
        self.prefix_cache.stats.hits += request.num_computed

    def _publish(self, request: Request) -> None:
        """Publish the request's full pages that are computed now (by a launched step)."""
        if self.prefix_cache is None:
            return
        num_pages = request.num_computed // self.page_size
        keys = extend_page_keys(request.page_keys, request.tokens, self.page_size, num_pages)
        for index in range(request.num_published, num_pages):
            self.prefix_cache.publish(request.pages[index], keys[index])
        request.num_published = max(request.num_published, num_pages)

    def _reserve(self, request: Request, num_positions: int, protected: list[Request]) -> bool:
        """Pages for positions < num_positions, preempting the newest unscheduled others.

        Capped at what the request can ever touch (its longest sequence and one draft block
        after it), which `Engine.add_request` checked fits the cache.
        """
        num_pages = self.pages_needed(min(num_positions, self._longest(request)))
        missing = num_pages - len(request.pages)
        while missing > 0:
            try:
                request.pages += self.allocator.allocate(missing)
                break
            except OutOfPages:
                victims = [r for r in self.running if r is not request and r not in protected and r.pages]
                if not victims:
                    return False
                self._preempt(victims[-1])
        if not request.window_pages:
            request.window_pages = [[] for _ in self.window_allocators]
        for table, allocator in zip(request.window_pages, self.window_allocators):
            table += allocator.allocate(max(num_pages - len(table), 0))  # sized never to run out
        return True

    def _longest(self, request: Request) -> int:
        """Positions the request can ever touch: its longest sequence and one draft block after it."""
        return request.prompt_len + request.params.max_new_tokens + self.lookahead

    def _evict_out_of_window(self, request: Request) -> None:
        """Give back windowed-group pages no future query can see (spec section 2's window)."""
        for table, allocator, window in zip(request.window_pages, self.window_allocators, self.windows):
            # The next queries sit at positions >= num_computed and see keys >= q - (W - 1). A
            # prefill chunk in flight may still read a page freed here: steps run on the device
            # in launch order, so whoever gets the page next writes it after that chunk.
            first_visible = request.num_computed - window + 1
            for index in range(max(first_visible, 0) // self.page_size):
                if table[index] != NULL_PAGE:
                    allocator.free([table[index]])
                    table[index] = NULL_PAGE

    def _free_pages(self, request: Request) -> None:
        if request.restore_from >= 0:  # admitted, its saved state never read
            self.saved_states.unpin(request.restore_from)
            request.restore_from = -1
        self.allocator.free(request.pages)
        for table, allocator in zip(request.window_pages, self.window_allocators):
            allocator.free([page for page in table if page != NULL_PAGE])
        request.pages, request.window_pages, request.num_published = [], [], 0

    def _preempt(self, request: Request) -> None:
        self._free_pages(request)
        self.running.remove(request)
        self._free_slots.append(request.slot)
        request.slot, request.num_computed = -1, 0
        request.status, request.decoding, request.in_flight = Status.WAITING, False, None
        request.epoch += 1
        request.stats.num_preemptions += 1
        self.waiting.appendleft(request)
