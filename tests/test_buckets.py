"""The step programs' shapes: every batch the scheduler can produce runs in one of
`buckets.programs`, decode-only batches with no token padding past their rows bucket, and an
admission cap keeps batches within the compiled rows buckets. No model: the Scheduler alone."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_jax.buckets import Program, holds, program_for, programs
from dflash_jax.kv_cache import PageAllocator
from dflash_jax.requests import RequestStats, SamplingParams
from dflash_jax.scheduler import Request, Scheduler
from pallas_kernels.common import next_pow2


def test_default_engine_has_twelve_programs():
    found = programs(max_num_reqs=8, max_num_tokens=256, num_query=8)
    assert len(found) == 12
    assert found[0] == Program(1, 256, False)  # runs any batch of one request
    assert {p.tokens for p in found if p.greedy} == {8, 16, 32, 64}


@settings(max_examples=30, deadline=None)
@given(
    log_reqs=st.integers(0, 3), log_tokens_over=st.integers(0, 3), num_drafts=st.sampled_from([0, 1, 3, 4, 7]),
    requests=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 20), st.booleans()), min_size=1, max_size=10),
    accepted=st.integers(0, 7), max_running=st.sampled_from([1, 2, 8]),
)
def test_every_scheduled_batch_has_a_program(log_reqs, log_tokens_over, num_drafts, requests, accepted, max_running):
    max_num_reqs, num_query = 1 << log_reqs, 1 + num_drafts
    max_num_tokens = next_pow2(max_num_reqs * num_query) << log_tokens_over
    known = set(programs(max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens, num_query=num_query))
    s = Scheduler(max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens, num_drafts=num_drafts,
                  lookahead=num_query, page_size=4, allocator=PageAllocator(400), window_allocators=[], windows=())
    s.max_running = min(max_running, max_num_reqs)
    for i, (prompt_len, max_new, greedy) in enumerate(requests):
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0 if greedy else 1.0)
        s.add(Request(i, prompt_len, list(range(1, prompt_len + 1)), params, RequestStats()))
    for _ in range(sum(prompt_len + max_new for prompt_len, max_new, _ in requests)):  # a token a step at least
        work = s.schedule()
        if not work:
            break
        assert len(work) <= s.max_running
        greedy = all(w.request.params.temperature == 0 for w in work)
        tokens = sum(w.rows for w in work)
        program = program_for(len(work), tokens, greedy, max_num_tokens=max_num_tokens, num_query=num_query)
        assert program in known
        assert program.rows >= len(work) and program.tokens >= tokens
        if all(w.verifying for w in work):
            assert program.tokens == program.rows * num_query  # decode steps: exact
        s.launched(work)
        for w in work:  # commit as the Engine does, every verify accepting `accepted` drafts
            count = min(accepted, num_drafts) + 1 if w.verifying else 1
            count = min(count, w.request.params.max_new_tokens - w.request.num_generated)
            s.committed(w, count if w.verifying else 0)
            if w.samples:
                w.request.tokens += [7] * count
                if w.request.num_generated >= w.request.params.max_new_tokens:
                    s.finish(w.request)
    assert not s.has_unfinished()


@settings(max_examples=30, deadline=None)
@given(log_reqs=st.integers(0, 4), num_query=st.sampled_from([1, 2, 4, 5, 16]), log_tokens_over=st.integers(0, 2),
       compiled=st.integers(1, 30), batch=st.tuples(st.integers(1, 16), st.integers(1, 4096), st.booleans()))
def test_a_warming_prefix_holds_every_batch_it_admits(log_reqs, num_query, log_tokens_over, compiled, batch):
    """Programs compile in warm-up order; whatever prefix is compiled, a batch of no more
    requests than the largest compiled budget program (what a warming Engine admits) has a
    compiled program that holds it."""
    max_num_reqs = 1 << log_reqs
    max_num_tokens = next_pow2(max_num_reqs * num_query) << log_tokens_over
    prefix = programs(max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens, num_query=num_query)[:compiled]
    admitted = max(p.rows for p in prefix if not p.greedy and p.tokens == max_num_tokens)
    num_rows, greedy = min(batch[0], admitted), batch[2]
    num_tokens = min(max(batch[1], num_rows), max_num_tokens)
    assert any(holds(p, num_rows, num_tokens, greedy) for p in prefix)
