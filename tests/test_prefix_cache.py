"""Prefix caching: the page pool's books (references, publishing, least recently released
first), the hash chain, and the Engine: a hit restores the target's K/V and the drafter's
context, so outputs and accepted lengths do not change; usage reports the cached tokens."""

import pytest

import dflash_jax
from dflash_jax.engine import Engine, SamplingParams
from dflash_jax.kv_cache import OutOfPages
from dflash_jax.prefix_cache import PrefixCache, extend_page_keys
from test_engine import models  # noqa: F401 (fixture)

SHARED = list(range(3, 43))  # 40 tokens: 10 full pages of 4
PROMPTS = [SHARED + [50, 51, 52], SHARED + [60, 61], SHARED[:21] + [70] * 9, SHARED + [50, 51, 52]]


def test_keys_chain_every_token_before_them():
    a = extend_page_keys([], list(range(12)), 4, 3)
    b = extend_page_keys([], list(range(12)), 4, 3)
    assert a == b and len(set(a)) == 3
    changed = extend_page_keys([], [0, 1, 2, 3, 4, 99, 6, 7, 8, 9, 10, 11], 4, 3)
    assert changed[0] == a[0] and changed[1] != a[1] and changed[2] != a[2]  # page 2's tokens are equal
    keys = a[:1]
    assert extend_page_keys(keys, list(range(12)), 4, 3) is keys and keys == a  # extended in place
    with pytest.raises(ValueError, match="do not fill 4 pages"):
        extend_page_keys([], list(range(12)), 4, 4)


def test_pages_are_shared_published_and_evicted_least_recently_released_first():
    cache = PrefixCache(6)  # pages 1..5
    first = cache.allocate(3)
    for page, key in zip(first, [b"a", b"b", b"c"]):
        cache.publish(page, key)
    assert cache.match([b"a", b"b", b"x", b"c"]) == first[:2]  # the run stops at the first miss
    cache.free(first)  # a and b are still held by the match
    assert cache.num_free == 3 and cache.num_cached == 3  # two free pages, c unheld
    cache.free(first[:2])
    other = cache.allocate(2)  # the free pages first, no eviction
    assert set(other).isdisjoint(first) and cache.num_cached == 3
    (evicted,) = cache.allocate(1)  # released last, page c went first (its request let it go first)
    assert evicted == first[2] and cache.match([b"c"]) == [] and cache.match([b"a", b"b"]) == first[:2]
    with pytest.raises(OutOfPages):
        cache.allocate(1)
    dup = other[0]
    cache.publish(dup, b"a")  # a key already published keeps its page; this one stays private
    cache.free([dup])
    assert cache.match([b"a"]) == [first[0]] and cache.num_free == 1


def serve_in_turn(engine, prompts, params):
    """Each prompt served alone after the one before ends (so later ones can hit)."""
    ids = []
    for prompt in prompts:
        ids.append(engine.add_request(prompt, params))
        while engine.has_unfinished():
            engine.step()
    return ids


@pytest.mark.slow
@pytest.mark.parametrize("drafter_name, temperature", [("full", 0.0), ("sliding", 0.8)])
def test_a_hit_changes_neither_tokens_nor_acceptance(models, drafter_name, temperature):  # noqa: F811
    target, drafters, _ = models
    params = SamplingParams(max_new_tokens=14, temperature=temperature, seed=5)
    runs = {}
    for caching in (True, False):
        engine = Engine(target, drafters[drafter_name], max_num_reqs=2, max_num_tokens=16, page_size=4,
                        prefix_caching=caching)
        ids = serve_in_turn(engine, PROMPTS, params)
        runs[caching] = ([engine.output(i) for i in ids], [engine.stats(i).accepted_lengths for i in ids],
                         [engine.stats(i).num_cached_tokens for i in ids])
        pool = engine.scheduler.allocator
        assert pool.num_free == pool.num_pages - 1  # every reference released
    assert runs[True][:2] == runs[False][:2]
    # 40 shared tokens: 10 pages; the third prompt shares 5 full pages; the last is the
    # first again, whose answer's pages were cached too, but its last prompt token is computed.
    assert runs[True][2] == [0, 40, 20, 40]
    assert runs[False][2] == [0, 0, 0, 0]
    assert engine.prefix_cache_stats is None


@pytest.mark.slow
def test_hits_under_preemption_and_abort_keep_the_books(models):  # noqa: F811
    """Requests sharing a prefix, run together in a cache too small for all of them: they
    preempt one another, one is aborted; the rest decode as without caching, and every page
    comes back."""
    target, drafters, reference = models
    prompts = [SHARED + [50 + i] for i in range(4)]
    expected = dflash_jax.generate_autoregressive(target, prompts, max_new_tokens=12).token_ids
    engine = Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=16, page_size=4, num_pages=30)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=12)) for p in prompts]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 4:
            engine.abort(ids[1])
    kept = [0, 2, 3]
    assert [engine.output(ids[i]) for i in kept] == [expected[i] for i in kept]
    assert sum(engine.stats(i).num_preemptions for i in ids) > 0
    assert engine.prefix_cache_stats.hits > 0
    pool = engine.scheduler.allocator
    assert pool.num_free == pool.num_pages - 1 and not pool._refs


def test_choices_of_one_prompt_share_its_pages(models):  # noqa: F811
    """Choices added together with `prefill_after` wait for the first one's prefill and start
    from its pages; seeded samples are those of choices computed alone."""
    target, drafters, _ = models
    prompt = SHARED + [50, 51, 52]
    engine = Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=16, page_size=4)
    params = [SamplingParams(max_new_tokens=10, temperature=0.8, seed=s) for s in range(3)]
    first = engine.add_request(prompt, params[0])
    others = [engine.add_request(prompt, p, prefill_after=first) for p in params[1:]]
    while engine.has_unfinished():
        engine.step()
    assert [engine.stats(i).num_cached_tokens for i in [first, *others]] == [0, 40, 40]
    alone = Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=16, page_size=4, prefix_caching=False)
    ids = [alone.add_request(prompt, p) for p in params]
    while alone.has_unfinished():
        alone.step()
    assert [engine.output(i) for i in [first, *others]] == [alone.output(i) for i in ids]
    with pytest.raises(ValueError, match="no request with id 99"):
        engine.add_request(prompt, params[0], prefill_after=99)
