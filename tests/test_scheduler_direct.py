"""The scheduler alone (no model, no device), beyond tests/test_scheduler.py: slot reuse and
the admission cap, pages reserved for a verify step still in flight, the reservation cap, who
may be preempted (never a request already in this step or one whose last token is in flight),
the recompute of a preempted request, and a property: an Engine-like loop over random
requests, accepted lengths and stops keeps every page and slot accounted for, gives every
launched step pages for every position it writes or reads, and finishes every request."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_jax.kv_cache import NULL_PAGE, PageAllocator
from dflash_jax.requests import RequestStats, SamplingParams
from dflash_jax.scheduler import Request, Scheduler, Status
from dflash_jax.step_inputs import StepInputs

PAGE = 4


def make_scheduler(num_pages=64, max_num_reqs=2, max_num_tokens=16, num_drafts=3, lookahead=None, page_size=PAGE,
                   windows=(), window_pages=64):
    return Scheduler(
        max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens, num_drafts=num_drafts,
        lookahead=num_drafts + 1 if lookahead is None else lookahead, page_size=page_size,
        allocator=PageAllocator(num_pages), window_allocators=[PageAllocator(window_pages) for _ in windows],
        windows=windows,
    )


def make_request(request_id, prompt_len, max_new_tokens=8):
    return Request(request_id, prompt_len, list(range(1, prompt_len + 1)),
                   SamplingParams(max_new_tokens=max_new_tokens), RequestStats())


def shape(work):
    return [(w.request.request_id, w.rows, w.verifying, w.samples) for w in work]


def commit_all(s, work, accepted):
    """The Engine's commit when every verify accepts `accepted` drafts (a token is 7)."""
    for w in work:
        s.committed(w, accepted + 1 if w.verifying else 0)
        if w.samples:
            w.request.tokens += [7] * (accepted + 1 if w.verifying else 1)


def held_pages(s):
    return sum(len(r.pages) for r in s.running)


def test_admission_respects_max_running_and_a_finished_slot_is_reused():
    s = make_scheduler(max_num_reqs=2)
    s.max_running = 1  # the Engine lowers it while warming up
    a, b, c = make_request(0, 3), make_request(1, 3), make_request(2, 3)
    for r in (a, b, c):
        s.add(r)
    work = s.schedule()
    # Free slots are handed out lowest first: a gets slot 0; b and c wait.
    assert shape(work) == [(0, 3, False, True)] and a.slot == 0
    assert b.status is Status.WAITING and c.status is Status.WAITING and b.slot == c.slot == -1
    s.launched(work)
    s.max_running = 2
    work = s.schedule()  # b is admitted into slot 1 and prefills; a's first step is in flight
    assert b.slot == 1 and c.status is Status.WAITING
    assert shape(work) == [(0, 4, True, True), (1, 3, False, True)]
    s.launched(work)
    s.finish(a)
    # a's slot 0 goes back and c, first in line, takes it; a's stale share is not current.
    work = s.schedule()
    assert c.slot == 0 and c.status is Status.RUNNING and a.slot == -1 and a.pages == []
    assert [w.request for w in work] == [b, c]
    assert s.is_current(work[0]) and s.is_current(work[1])


def test_pages_are_reserved_for_the_verify_step_in_flight():
    s = make_scheduler(max_num_reqs=1, num_drafts=3)  # lookahead 4 (the drafter's block)
    a = make_request(0, 6, max_new_tokens=20)
    s.add(a)
    prefill = s.schedule()
    s.launched(prefill)
    # Prefill writes positions 0..5 and the drafter's block 6..9: 10 positions, 3 pages.
    assert len(a.pages) == 3
    first_verify = s.schedule()  # launched before the prefill's tokens are read (async)
    assert shape(first_verify) == [(0, 4, True, True)]
    s.launched(first_verify)
    # Its anchor sits at 6: verify rows 6..9, the drafter's block up to 9 + 4 = 13: 14
    # positions, 4 pages.
    assert len(a.pages) == 4
    commit_all(s, prefill, 0)  # the prefill's first token arrives; the verify is still in flight
    assert a.num_computed == 6 and a.in_flight is first_verify[0]
    second_verify = s.schedule()
    # If the verify in flight accepts all 3 drafts, the next anchor sits at 6 + 4 = 10: rows
    # 10..13, the drafter's block up to 13 + 4 = 17: 18 positions, 5 pages.
    assert shape(second_verify) == [(0, 4, True, True)] and len(a.pages) == 5
    assert s.allocator.num_free == 63 - 5


def test_decoding_steps_run_several_cycles_with_pages_for_each():
    s = make_scheduler(max_num_reqs=2, num_drafts=3)
    s.cycles_per_step = 4
    a = make_request(0, 6, max_new_tokens=20)
    s.add(a)
    prefill = s.schedule()
    assert [w.cycles for w in prefill] == [1]
    s.launched(prefill)
    verify = s.schedule()
    # Its anchor sits at 6; four cycles of 4 rows may reach 6 + 16 - 1 = 21 and the drafter's
    # block after the last one up to 25: 26 positions, 7 pages.
    assert shape(verify) == [(0, 4, True, True)] and verify[0].cycles == 4 and len(a.pages) == 7
    s.launched(verify)
    commit_all(s, prefill, 0)
    b = make_request(1, 3, max_new_tokens=20)
    s.add(b)
    work = s.schedule()  # b prefills: one cycle for everyone
    assert [(w.request, w.cycles) for w in work] == [(a, 1), (b, 1)]


def test_cycles_stop_at_the_tokens_left_and_at_the_free_pages():
    s = make_scheduler(max_num_reqs=1, num_drafts=3)
    s.cycles_per_step = 8
    a = make_request(0, 6, max_new_tokens=4)
    s.add(a)
    s.launched(s.schedule())
    # The prefill in flight gives 1 of a's 4 tokens; each cycle gives at least one more.
    assert s.schedule()[0].cycles == 3
    tight = make_scheduler(max_num_reqs=1, num_drafts=3, num_pages=9)  # 8 usable pages
    tight.cycles_per_step = 8
    b = make_request(1, 6, max_new_tokens=30)
    tight.add(b)
    tight.launched(tight.schedule())
    # Eight cycles would need pages up to position 6 + 32 + 4 = 42 (11 pages): one cycle.
    assert tight.schedule()[0].cycles == 1


def test_reservation_is_capped_at_the_longest_sequence():
    s = make_scheduler(max_num_reqs=1, num_drafts=3)
    a = make_request(0, 6, max_new_tokens=2)
    s.add(a)
    work = s.schedule()
    s.launched(work)
    commit_all(s, work, 0)
    work = s.schedule()
    assert shape(work) == [(0, 4, True, True)]
    # Uncapped this step would reserve 6 + 4 + 4 = 14 positions (4 pages), but a ends at
    # position 6 + 2 - 1 = 7: its anchor (6) verifies at most rows 6..9 and the drafter's
    # block after it reaches 6 + 4 = 10; 6 + 2 + 4 = 12 positions, 3 pages, cover it all.
    assert len(a.pages) == 3


def test_a_request_whose_last_token_is_in_flight_is_skipped_and_kept():
    s = make_scheduler(num_pages=1 + 4, max_num_reqs=2)
    a = make_request(0, 6, max_new_tokens=1)
    s.add(a)
    prefill = s.schedule()
    s.launched(prefill)
    assert len(a.pages) == 3  # min(6 + 4, 6 + 1 + 4) positions
    b = make_request(1, 4, max_new_tokens=1)
    s.add(b)
    # a's prefill gives its one token: nothing more to schedule for a. b needs 2 pages, 1 is
    # free, and a, whose step is in flight, may not be preempted for them: b waits.
    assert s.schedule() == []
    assert a.status is Status.RUNNING and len(a.pages) == 3 and a.stats.num_preemptions == 0
    assert b.status is Status.RUNNING and b.pages == [] and s.allocator.num_free == 1
    commit_all(s, prefill, 0)
    s.finish(a)  # what the Engine does once a has its max_new_tokens
    assert s.allocator.num_free == 4
    assert shape(s.schedule()) == [(1, 4, False, True)] and len(b.pages) == 2


def test_requests_already_in_the_step_are_never_preempted():
    s = make_scheduler(num_pages=1 + 11, max_num_reqs=3, max_num_tokens=32)
    a, b, c = (make_request(i, 8, max_new_tokens=12) for i in range(3))
    for r in (a, b, c):
        s.add(r)
    work = s.schedule()
    assert [w.request for w in work] == [a, b, c]  # 3 pages each (8 + 4 positions), 2 left
    s.launched(work)
    commit_all(s, work, 0)
    work = s.schedule()
    # Each verify needs 8 + 4 + 4 = 16 positions, a 4th page: a and b get the last two; c, the
    # newest, finds only a and b to preempt, both in this step, so it waits, keeping its pages.
    assert [w.request for w in work] == [a, b]
    assert len(a.pages) == len(b.pages) == 4 and len(c.pages) == 3
    assert c.status is Status.RUNNING and c.stats.num_preemptions == 0
    assert s.allocator.num_free == 0 and held_pages(s) == 11


def test_the_newest_of_several_candidates_is_preempted():
    s = make_scheduler(num_pages=1 + 9, max_num_reqs=3, max_num_tokens=32)
    a, b, c = (make_request(i, 8, max_new_tokens=12) for i in range(3))
    for r in (a, b, c):
        s.add(r)
    work = s.schedule()
    s.launched(work)
    commit_all(s, work, 0)
    assert s.allocator.num_free == 0  # 3 pages each
    work = s.schedule()
    # a needs a 4th page; b and c could give theirs: c, admitted last, goes (its 3 pages
    # freed), then b gets its 4th page from them too.
    assert [w.request for w in work] == [a, b]
    assert c.status is Status.WAITING and c.stats.num_preemptions == 1 and list(s.waiting) == [c]
    assert b.stats.num_preemptions == 0 and len(a.pages) == len(b.pages) == 4
    assert s.allocator.num_free == 1


def test_a_preempted_request_is_recomputed_and_its_last_token_verified():
    s = make_scheduler(num_pages=1 + 7)
    a, b = make_request(0, 8, max_new_tokens=12), make_request(1, 8, max_new_tokens=12)
    s.add(a)
    s.add(b)
    for accepted in (0, 3, 3):
        work = s.schedule()
        s.launched(work)
        commit_all(s, work, accepted)
    assert b.stats.num_preemptions == 1 and b.status is Status.WAITING and b.epoch == 1
    assert b.tokens == list(range(1, 9)) + [7]  # its prompt and the one token it got
    s.finish(a)
    work = s.schedule()
    # b recomputes positions 0..7 (everything but its last token); that chunk samples
    # nothing: its last token, 7, is the anchor the next step verifies with drafts.
    assert shape(work) == [(1, 8, False, False)] and work[0].ends_prefill
    assert b.slot >= 0 and len(b.pages) == 3  # 8 + 4 positions
    inputs = StepInputs(num_rows=1, num_tokens=8, num_query=4, pages_per_req=8, max_num_reqs=2,
                        num_window_groups=0, max_stop_ids=1)
    inputs.fill(work, 4)
    # The drafter's anchor after the chunk is the next token, b's generated 7 at position 8.
    assert inputs.tokens.tolist() == list(range(1, 9)) and inputs.next_prefill.tolist() == [7]
    assert inputs.samples.tolist() == [0]
    s.launched(work)
    assert b.decoding and b.num_computed == 8
    work = s.schedule()
    assert shape(work) == [(1, 4, True, True)] and work[0].epoch == 1
    assert len(b.pages) == 4  # anchor at 8: rows 8..11, the drafter's block up to 15


# --------------------------------------------------------------------------------------
# Property: an Engine-like loop (StepInputs aside) keeps the books.
# --------------------------------------------------------------------------------------

def check_books(s, num_pages, window_totals, all_requests):
    running = s.running
    assert len(running) <= s.max_num_reqs
    slots = [r.slot for r in running]
    assert len(set(slots)) == len(slots) and all(0 <= slot < s.max_num_reqs for slot in slots)
    for r in all_requests:
        if r.status is not Status.RUNNING:
            assert r.slot == -1 and r.pages == [] and r.window_pages == []
    pages = [p for r in running for p in r.pages]
    assert NULL_PAGE not in pages and len(set(pages)) == len(pages)
    assert s.allocator.num_free + len(pages) == num_pages - 1
    for g, total in enumerate(window_totals):
        held = [p for r in running for p in (r.window_pages[g] if r.window_pages else []) if p != NULL_PAGE]
        assert len(set(held)) == len(held)
        assert s.window_allocators[g].num_free + len(held) == total - 1


def needed_positions(w, start, anchor_outcome, num_drafts, lookahead, window):
    """(highest position a step writes or reads, lowest position its windowed drafter layers
    read), from the spec: a verify step runs the target on its anchor position a .. a + N and
    the drafter's block at a + accepted + 1 .. a + accepted + D; a prefill chunk covers
    start .. start + rows - 1, its block the D positions after. Block offset j's query in a
    window W sees context keys from p + j - (W - 1), p the block's first position."""
    if w.verifying:
        anchor, accepted = anchor_outcome
        block_start = anchor + accepted + 1
        top = max(anchor + num_drafts, block_start + lookahead - 1)
    else:
        block_start = start + w.rows
        top = block_start + lookahead - 1
    low = max(block_start - (window - 1), 0) if window else None
    return top, low


@settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(num_drafts=st.integers(1, 3), extra_block=st.integers(0, 2), page=st.sampled_from([1, 2, 4]),
       max_num_reqs=st.integers(1, 3), extra_tokens=st.integers(0, 8), window=st.sampled_from([None, 2, 5]),
       spare_pages=st.integers(0, 12), async_scheduling=st.booleans(), seed=st.integers(0, 2**32 - 1),
       lengths=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 10), st.integers(0, 6)), min_size=1, max_size=5),
       cycles_per_step=st.sampled_from([1, 1, 2, 3]))
def test_engine_like_loop_keeps_the_books(num_drafts, extra_block, page, max_num_reqs, extra_tokens, window,
                                          spare_pages, async_scheduling, seed, lengths, cycles_per_step):
    rng = np.random.default_rng(seed)
    lookahead = num_drafts + 1 + extra_block  # the drafter's block, at least 1 + N
    max_num_tokens = 1 + num_drafts + extra_tokens
    # The Engine refuses a request whose longest sequence does not fit the cache.
    longest = max(-(-(p + m + lookahead) // page) for p, m, _ in lengths)
    num_pages = 1 + longest + spare_pages
    windows = (window,) if window else ()
    # The Engine's fixed pool per windowed group, "sized never to run out".
    step_span = max(max_num_tokens, 2 * cycles_per_step * (1 + num_drafts))
    window_total = 1 + max_num_reqs * -(-(window + step_span + 2 * lookahead + 2 * page) // page) if window else 0
    s = Scheduler(max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens, num_drafts=num_drafts,
                  lookahead=lookahead, page_size=page, allocator=PageAllocator(num_pages),
                  window_allocators=[PageAllocator(window_total) for _ in windows], windows=windows,
                  cycles_per_step=cycles_per_step)
    requests = [make_request(i, p, m) for i, (p, m, _) in enumerate(lengths)]
    arrivals = [arrive for _, _, arrive in lengths]
    stopped = set()
    in_flight = None  # (work, launch records) of the step not yet committed

    def commit(launch):
        work, records = launch
        for w in work:  # cycle after cycle, as the Engine commits them
            assert w.cycles == (work[0].cycles if w.verifying else 1) and 1 <= w.cycles <= cycles_per_step
        for _ in range(work[0].cycles):
            commit_cycle(work, records)

    def commit_cycle(work, records):
        for w in work:
            if not s.is_current(w):
                continue
            r = w.request
            start, num_pages_at_launch, window_table = records[id(w)]
            remaining = r.prompt_len + r.params.max_new_tokens - len(r.tokens)
            assert remaining >= 1, "a current step of a request with nothing left"
            if w.verifying:
                anchor = len(r.tokens) - 1
                assert r.num_computed == anchor  # positions before the anchor have K/V
                accepted = int(rng.integers(0, min(num_drafts, remaining - 1) + 1))
                count = accepted + 1
                outcome = (anchor, accepted)
            else:
                accepted, count, outcome = 0, 1 if w.samples else 0, None
            top, low = needed_positions(w, start, outcome, num_drafts, lookahead, window)
            assert top < num_pages_at_launch * page, "a step writes past its request's pages"
            if window:
                for index in range(low // page, top // page + 1):
                    assert window_table[index] != NULL_PAGE, "a windowed layer reads an evicted page"
            stop = count > 0 and rng.random() < 0.1
            if stop:
                count = int(rng.integers(1, count + 1))
            s.committed(w, count if w.verifying else 0)
            if w.samples:
                r.tokens += [7] * count
                if stop or r.num_generated >= r.params.max_new_tokens:
                    if stop:
                        stopped.add(r.request_id)
                    s.finish(r)

    for step in range(400):
        for r, arrive in zip(requests, arrivals):
            if arrive == step:
                s.add(r)
        if step > max(arrivals) and not s.has_unfinished() and in_flight is None:
            break
        work = s.schedule()
        check_books(s, num_pages, [window_total] * len(windows), requests)
        assert sum(w.rows for w in work) <= max_num_tokens
        assert len({id(w.request) for w in work}) == len(work)
        for w in work:
            assert w.request.status is Status.RUNNING and w.rows >= 1
            assert w.rows == 1 + num_drafts if w.verifying else True
        if not work and s.running and in_flight is None:
            raise AssertionError("nothing scheduled with nothing in flight: the Engine would raise")
        launch = None
        if work:
            records = {id(w): (w.request.num_computed, len(w.request.pages),
                               list(w.request.window_pages[0]) if windows else None) for w in work}
            s.launched(work)
            launch = (work, records)
        if async_scheduling:
            if in_flight is not None:
                commit(in_flight)
            in_flight = launch
        elif launch is not None:
            commit(launch)
        check_books(s, num_pages, [window_total] * len(windows), requests)
    else:
        raise AssertionError("requests still unfinished after 400 steps")
    for r in requests:
        assert r.status is Status.FINISHED
        assert r.request_id in stopped or r.num_generated == r.params.max_new_tokens
        assert r.num_generated <= r.params.max_new_tokens
