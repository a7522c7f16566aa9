"""The Engine's scheduling alone, with no model: admission, token budget, page reservation,
preemption, window eviction and finishing, driven by hand-made commits."""

from __future__ import annotations

from dflash_jax.kv_cache import NULL_PAGE, PageAllocator
from dflash_jax.requests import RequestStats, SamplingParams
from dflash_jax.scheduler import Request, Scheduler, Status

PAGE = 4


def scheduler(num_pages=64, max_num_reqs=2, max_num_tokens=16, num_drafts=3, windows=()):
    return Scheduler(
        max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens, num_drafts=num_drafts, lookahead=num_drafts + 1,
        page_size=PAGE, allocator=PageAllocator(num_pages),
        window_allocators=[PageAllocator(64) for _ in windows], windows=windows,
    )


def request(request_id, prompt_len, max_new_tokens=8):
    return Request(request_id, prompt_len, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new_tokens),
                   RequestStats())


def commit(s: Scheduler, work, accepted: int) -> None:
    """What the Engine does with a step's results when every verify accepts `accepted`."""
    for w in work:
        s.committed(w, accepted + 1 if w.verifying else 0)
        if w.samples:
            w.request.tokens += [7] * (accepted + 1 if w.verifying else 1)


def test_admits_into_free_slots_and_splits_prefill_by_the_budget():
    s = scheduler()
    a, b, c = request(0, 10), request(1, 10), request(2, 3)
    for r in (a, b, c):
        s.add(r)
    work = s.schedule()
    # Two slots: a and b admitted, c waits; a's prefill takes 10 of 16 tokens, b the other 6.
    assert [(w.request.request_id, w.rows, w.verifying, w.samples) for w in work] == [(0, 10, False, True),
                                                                                         (1, 6, False, False)]
    assert {a.slot, b.slot} == {0, 1} and c.status is Status.WAITING
    s.launched(work)
    commit(s, work, 0)
    assert a.decoding and not b.decoding and a.num_computed == 10 and b.num_computed == 6
    work = s.schedule()
    # a verifies 1 + 3 rows; b's remaining 4 prompt tokens and its first token.
    assert [(w.request.request_id, w.rows, w.verifying, w.samples) for w in work] == [(0, 4, True, True),
                                                                                         (1, 4, False, True)]


def test_pages_cover_every_position_a_step_writes():
    s = scheduler()
    a = request(0, 6)
    s.add(a)
    s.launched(s.schedule())
    # Prefill of 6 positions plus a drafter block of 4 past them: 10 positions, 3 pages.
    assert len(a.pages) == 3 and NULL_PAGE not in a.pages


def test_preempts_the_newest_request_when_pages_run_out_and_recomputes_it():
    s = scheduler(num_pages=1 + 7)  # 7 usable pages
    a, b = request(0, 8, max_new_tokens=12), request(1, 8, max_new_tokens=12)
    s.add(a)
    s.add(b)
    work = s.schedule()
    assert [w.request for w in work] == [a, b]  # 3 pages each (8 + 4 positions)
    s.launched(work)
    commit(s, work, 0)
    for _ in range(3):  # a grows by 4 a cycle and needs pages b holds
        work = s.schedule()
        s.launched(work)
        commit(s, work, 3)
    # b was preempted (its pages freed, to be recomputed from its tokens) and, readmitted
    # into its free slot, waits for pages: the last step ran a alone.
    assert b.stats.num_preemptions == 1 and b.epoch == 1 and b.pages == [] and b.num_computed == 0
    assert [w.request for w in work] == [a] and b.tokens == list(range(1, 9)) + [7]
    assert a.status is Status.RUNNING and a.num_computed == 8 + 4 * 3


def test_finish_frees_slot_and_pages_and_drops_stale_work():
    s = scheduler()
    a = request(0, 5)
    s.add(a)
    work = s.schedule()
    s.launched(work)
    free = s.allocator.num_free
    pages = len(a.pages)
    s.finish(a)
    assert a.status is Status.FINISHED and a.slot == -1 and s.allocator.num_free == free + pages
    assert not s.is_current(work[0]) and not s.has_unfinished()


def test_window_pages_out_of_sight_go_back():
    s = scheduler(windows=(4,), max_num_reqs=1)
    a = request(0, 12, max_new_tokens=16)
    s.add(a)
    work = s.schedule()
    s.launched(work)
    allocator = s.window_allocators[0]
    before = allocator.num_free
    commit(s, work, 0)
    # Next queries sit at positions >= 12 and see keys >= 9: pages 0 and 1 (positions 0..7) go.
    assert a.window_pages[0][:2] == [NULL_PAGE, NULL_PAGE] and NULL_PAGE not in a.window_pages[0][2:]
    assert allocator.num_free == before + 2
