"""Engine: continuous batching with chunked prefill, preemption and abort, token for token
equal to autoregressive decoding; no compilation after precompile(); bad input refused."""

import numpy as np
import pytest

import dflash_jax
from conftest import drafter_config_dict, make_zlab_drafter, save_hf
from dflash_jax.engine import Engine, SamplingParams
from dflash_jax.generate import generate, generate_autoregressive
from test_generate import biased_target

PROMPTS = [[5, 6, 7], list(range(20, 37)), list(range(1, 90)), [9] * 40, list(range(50, 61))]
SLIDING = dict(
    num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=6, use_sliding_window=True
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    hf = biased_target(seed=2)
    target = dflash_jax.load_target(save_hf(hf, tmp / "target"))
    drafters = {}
    for name, extra in {"full": {}, "sliding": SLIDING}.items():
        config = drafter_config_dict(hf.config.to_dict(), dflash_config={"mask_token_id": 95, "block_size": 4}, **extra)
        drafters[name] = dflash_jax.load_drafter(save_hf(make_zlab_drafter(config, seed=3), tmp / name, config))
    reference = generate_autoregressive(target, PROMPTS, max_new_tokens=20).token_ids
    return target, drafters, reference


def run(engine, prompts, params, arrive_late=(), abort=None):
    """Add requests (some after a few steps), step until done; returns ids in prompt order.
    What `step()` returned adds up to each request's output, finished once (unless aborted)."""
    ids = {i: engine.add_request(p, params) for i, p in enumerate(prompts) if i not in arrive_late}
    steps = 0
    streamed, finished = {}, []
    while engine.has_unfinished():
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            finished += [out.request_id] * out.finished
        steps += 1
        if steps == 3:
            ids.update({i: engine.add_request(prompts[i], params) for i in arrive_late})
        if abort is not None and steps == 2:
            engine.abort(ids[abort])
    assert {i: streamed.get(i, []) for i in ids.values()} == {i: engine.output(i) for i in ids.values()}
    assert sorted(finished) == sorted(i for k, i in ids.items() if k != abort)
    return [ids[i] for i in range(len(prompts))]


@pytest.mark.slow
def test_parameters_changed_after_construction_are_used(tmp_path):
    """An engine reads its models' current parameters at every step: after two tokens'
    LM-head columns are swapped, it decodes what `generate` does with the swap."""
    target = dflash_jax.load_target(save_hf(biased_target(seed=3), tmp_path / "target"))
    engine = Engine(target, None, max_num_reqs=2, max_num_tokens=32)
    before = generate_autoregressive(target, PROMPTS[:2], max_new_tokens=12).token_ids
    columns = np.arange(target.cfg.vocab_size)
    columns[[10, 20]] = [20, 10]
    target.lm_head.kernel[...] = target.lm_head.kernel[...][:, columns]
    after = generate_autoregressive(target, PROMPTS[:2], max_new_tokens=12).token_ids
    assert after != before
    ids = run(engine, PROMPTS[:2], SamplingParams(max_new_tokens=12))
    assert [engine.output(i) for i in ids] == after


@pytest.mark.parametrize("drafter_name, block_size, async_scheduling, cycles_per_step", [
    ("full", 4, True, 1), ("full", 4, False, 1), pytest.param("full", 2, True, 1, marks=pytest.mark.slow),
    pytest.param("sliding", 4, True, 1, marks=pytest.mark.slow), (None, None, True, 1), (None, None, False, 1),
    ("full", 4, True, 3), pytest.param("sliding", 4, False, 3, marks=pytest.mark.slow),
    pytest.param(None, None, True, 3, marks=pytest.mark.slow),
])
def test_engine_equals_autoregressive(models, drafter_name, block_size, async_scheduling, cycles_per_step):
    target, drafters, reference = models
    drafter = drafters.get(drafter_name)
    engine = Engine(target, drafter, max_num_reqs=4, max_num_tokens=32, block_size=block_size,
                    async_scheduling=async_scheduling, cycles_per_step=cycles_per_step)
    ids = run(engine, PROMPTS, SamplingParams(max_new_tokens=20), arrive_late=(3, 4))
    assert [engine.output(i) for i in ids] == reference
    if drafter is not None:
        assert all(sum(engine.stats(i).accepted_lengths) == 19 for i in ids)
        counts = engine.draft_counts  # each cycle commits its accepted drafts and one token of the target's
        assert counts.num_accepted_tokens == sum(19 - len(engine.stats(i).accepted_lengths) for i in ids)
        assert sum(counts.accepted_per_position) == counts.num_accepted_tokens
        assert counts.num_draft_tokens <= (block_size - 1) * counts.num_drafts


@pytest.mark.slow
def test_stop_tokens_and_abort(models):
    target, drafters, reference = models
    stop = reference[1][5]
    params = SamplingParams(max_new_tokens=20, stop_token_ids=(stop,))
    expected = generate_autoregressive(target, PROMPTS, max_new_tokens=20, stop_token_ids=[stop]).token_ids
    engine = Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=32)
    ids = run(engine, PROMPTS, params, abort=0)
    outputs = [engine.output(i) for i in ids]
    assert outputs[1:] == expected[1:]
    assert outputs[1][-1] == stop and len(outputs[0]) < 20


@pytest.mark.parametrize("drafter_name", ["full", None])
def test_async_scheduling_returns_each_step_one_call_later(models, drafter_name):
    """Asynchronous scheduling returns what synchronous returns, one `step()` later; the
    step a request runs after its stop token (launched before the host saw it) adds nothing."""
    target, drafters, reference = models
    stop = reference[2][9]
    params = SamplingParams(max_new_tokens=20, stop_token_ids=(stop,))
    returned = {}
    for async_scheduling in (False, True):
        engine = Engine(target, drafters.get(drafter_name), max_num_reqs=4, max_num_tokens=32,
                        async_scheduling=async_scheduling)
        engine.add_request(PROMPTS[2], params)
        returned[async_scheduling] = []
        while engine.has_unfinished():
            returned[async_scheduling].append(engine.step())
    assert returned[False][-1][0].finish_reason == "stop"
    assert returned[True] == [[]] + returned[False]


@pytest.mark.parametrize("drafter_name", ["full", None])
def test_cycles_per_step_change_the_steps_not_the_tokens(models, drafter_name):
    """Several verify cycles per step give every request the tokens, accepted lengths and
    finish reasons of one cycle per step (seeded sampling, a stop token, lengths that end
    inside a step), in fewer steps."""
    target, drafters, reference = models
    stop = reference[2][9]
    params = [SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=7, temperature=0.9, seed=3),
              SamplingParams(max_new_tokens=20, stop_token_ids=(stop,)),
              SamplingParams(max_new_tokens=13, temperature=1.2, top_k=20, seed=5)]
    results = {}
    for cycles_per_step in (1, 4):
        engine = Engine(target, drafters.get(drafter_name), max_num_reqs=4, max_num_tokens=32,
                        cycles_per_step=cycles_per_step)
        ids = [engine.add_request(p, q) for p, q in zip(PROMPTS[:4], params)]
        steps, reasons = 0, {}
        while engine.has_unfinished():
            reasons.update({out.request_id: out.finish_reason for out in engine.step() if out.finished})
            steps += 1
        results[cycles_per_step] = ([engine.output(i) for i in ids], [engine.stats(i).accepted_lengths for i in ids],
                                    [reasons[i] for i in ids], steps)
    assert results[4][:3] == results[1][:3]
    assert results[1][2] == ["length", "length", "stop", "length"]
    assert results[4][3] < results[1][3]


@pytest.mark.slow
def test_preemption_recomputes_and_stays_exact(models):
    target, drafters, reference = models
    # 16 usable pages of 8 tokens: not enough for all five requests at once.
    engine = Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=32, num_pages=17, page_size=8)
    ids = run(engine, PROMPTS, SamplingParams(max_new_tokens=20))
    assert [engine.output(i) for i in ids] == reference
    assert sum(engine.stats(i).num_preemptions for i in ids) > 0
    assert engine.scheduler.allocator.num_free == 16


@pytest.mark.slow
@pytest.mark.parametrize("draft_sampling", ["sample", "argmax"])
def test_sampled_request_is_the_same_alone_or_in_a_batch(models, draft_sampling):
    """... and the same as generate's, with either kind of drafts."""
    target, drafters, _ = models
    params = SamplingParams(max_new_tokens=16, temperature=1.3, top_k=30, top_p=0.95, seed=11)
    alone = Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=32, draft_sampling=draft_sampling)
    (only,) = run(alone, [PROMPTS[1]], params)
    crowd = Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=32, draft_sampling=draft_sampling)
    ids = run(crowd, PROMPTS, params)
    assert crowd.output(ids[1]) == alone.output(only)
    static = generate(target, drafters["full"], [PROMPTS[1]], sampling_params=params, draft_sampling=draft_sampling)
    assert static.token_ids[0] == alone.output(only)


@pytest.mark.slow
def test_each_launching_step_records_its_launch_time(models):
    """The benchmarks' door: `last_launch_s`, the host time of the last step's launch."""
    target, _, _ = models
    engine = Engine(target, None, max_num_reqs=2, max_num_tokens=32, async_scheduling=False)
    assert engine.last_launch_s is None
    engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=2))
    engine.step()
    first = engine.last_launch_s
    engine.step()
    assert 0 < first and 0 < engine.last_launch_s != first


@pytest.mark.slow
def test_no_compilation_after_precompile(models):
    target, drafters, _ = models
    engine = Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=32)
    assert engine.precompile() > 0
    traces = Engine.num_traces()
    rng = np.random.default_rng(0)
    live, generated = set(), 0
    for step in range(200):
        if rng.random() < 0.3 and len(live) < 6:
            prompt = rng.integers(0, 95, size=int(rng.integers(1, 50))).tolist()
            temperature = float(rng.choice([0.0, 1.0]))
            live.add(engine.add_request(prompt, SamplingParams(max_new_tokens=int(rng.integers(1, 12)), temperature=temperature, seed=step)))
        if live and rng.random() < 0.05:
            engine.abort(live.pop())
        for out in engine.step():
            generated += len(out.new_token_ids)
            if out.finished:
                live.discard(out.request_id)
    assert Engine.num_traces() == traces
    assert generated > 100  # the engine did serve requests meanwhile

    # Another engine of the same models and shape runs the programs already compiled, and
    # finds them by the first engine's key object (no leaf-by-leaf comparison per step).
    again = Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=32)
    assert again._argument_shapes_key is engine._argument_shapes_key
    run(again, PROMPTS, SamplingParams(max_new_tokens=8))
    assert Engine.num_traces() == traces


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "prompt_ids is empty"),
        ([1, 96], SamplingParams(), "outside the vocabulary"),
        ([1] * 200, SamplingParams(max_new_tokens=100), "exceeds the model.s max length 256"),
        ([1], SamplingParams(temperature=-0.5), "temperature must be >= 0"),
        ([1], SamplingParams(top_p=2.0), r"top_p must lie in \(0, 1\]"),
        ([1], SamplingParams(top_k=-1), "top_k must be a non-negative integer"),
        ([1], SamplingParams(max_new_tokens=0), "max_new_tokens must be at least 1"),
        ([1] * 100, SamplingParams(max_new_tokens=100), "needs up to .* KV pages but the cache has 8"),
    ],
)
def test_bad_requests_are_refused_and_harm_nobody(models, prompt, params, message):
    target, drafters, reference = models
    engine = Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=32, num_pages=9)
    good = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    assert engine.output(good) == reference[0]


def test_sizes_need_not_be_powers_of_two(models):
    """3 requests at a time and a 20-token budget: programs pad to powers of two, the
    scheduler keeps the sizes given."""
    target, drafters, reference = models
    engine = Engine(target, drafters["full"], max_num_reqs=3, max_num_tokens=20)
    seen = []
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=20)) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
        seen.append(engine.num_running)
    assert [engine.output(i) for i in ids] == reference
    assert max(seen) == 3


def test_bad_engine_settings_are_refused(models):
    target, drafters, _ = models
    with pytest.raises(ValueError, match="max_num_tokens must be at least 1"):
        Engine(target, drafters["full"], max_num_tokens=0)
    with pytest.raises(ValueError, match=r"block_size must lie in \[2, 4\]"):
        Engine(target, drafters["full"], block_size=5)
    with pytest.raises(ValueError, match="cannot hold 8 requests x 4 verify rows"):
        Engine(target, drafters["full"], max_num_reqs=8, max_num_tokens=16)
    with pytest.raises(ValueError, match="draft_sampling must be one of 'sample', 'argmax'"):
        Engine(target, drafters["full"], draft_sampling="greedy")


@pytest.mark.slow
def test_sliding_window_pages_are_evicted_without_changing_drafts(models):
    """The windowed drafter group gives back pages that left the window; the drafts (hence
    the accepted lengths) stay those of generate(), which keeps every page."""
    target, drafters, reference = models
    drafter = drafters["sliding"]
    engine = Engine(target, drafter, max_num_reqs=4, max_num_tokens=32, page_size=4, prefix_caching=False)
    (window_pool,) = engine.scheduler.window_allocators
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=20)) for p in PROMPTS[:4]]
    most_in_use = 0
    while engine.has_unfinished():
        engine.step()
        most_in_use = max(most_in_use, window_pool.num_pages - 1 - window_pool.num_free)
    expected = dflash_jax.generate(target, drafter, PROMPTS[:4], max_new_tokens=20)
    assert [engine.output(i) for i in ids] == reference[:4]
    assert [engine.stats(i).accepted_lengths for i in ids] == expected.accepted_lengths
    all_positions = sum(len(p) + 20 for p in PROMPTS[:4])
    assert most_in_use * 4 < all_positions / 2  # far fewer pages than keeping every position
    assert window_pool.num_free == window_pool.num_pages - 1


@pytest.mark.slow
@pytest.mark.parametrize("drafter_name, block_size, draft_block_size", [
    ("sliding", None, None),  # windowed pages evicted along the way
    ("full", 3, None),  # verify 2 drafts of the drafter's own (trained) block
    ("full", 3, 3),  # draft only the verified block
])
def test_drafts_match_the_dense_drafter(models, drafter_name, block_size, draft_block_size):
    """After every step, the drafter's distribution q held on the device for the next block
    equals the dense, uncached drafter over the full context, with a block of the Engine's
    draft_block_size (its first N rows), or near the request's end one of the anchor and the
    tokens it may still commit: eviction loses nothing in view, and the block size the
    drafter runs at is the one asked for."""
    from dflash_jax import sampling

    target, drafters, _ = models
    drafter = drafters[drafter_name]
    engine = Engine(target, drafter, max_num_reqs=4, max_num_tokens=32, page_size=4,
                    block_size=block_size, draft_block_size=draft_block_size, async_scheduling=False)
    request_id = engine.add_request(PROMPTS[2][:30], SamplingParams(max_new_tokens=24, temperature=1.0, seed=5))
    checked, other_block_differs = 0, False
    while engine.has_unfinished():
        engine.step()
        request = engine._requests[request_id]
        if not engine.has_unfinished() or not request.decoding:
            continue
        tokens = request.tokens
        _, features = dflash_jax.target_forward(target, tokens[:-1], layer_ids=drafter.cfg.target_layer_ids)

        def dense_q(size):
            block = [tokens[-1]] + [drafter.cfg.mask_token_id] * (size - 1)
            logits = dflash_jax.draft_logits(target, drafter, features, block)[: engine.num_drafts]
            return sampling.processed_probs(logits, 1.0, 0, 1.0)

        remaining = 24 - (len(tokens) - 30)
        size = min(engine.draft_block_size, remaining + 1)
        expected = dense_q(size)[: size - 1]  # drafts past the request's end are never verified
        np.testing.assert_allclose(engine._state.draft_probs_SNV[request.slot][: size - 1], expected, atol=2e-5)
        if engine.draft_block_size != 1 + engine.num_drafts and size == engine.draft_block_size:
            other_block_differs |= not np.allclose(dense_q(1 + engine.num_drafts), expected, atol=1e-3)
        checked += 1
    assert checked >= 5
    if engine.draft_block_size != 1 + engine.num_drafts:
        assert other_block_differs  # the test can tell the two block sizes apart


@pytest.mark.slow
def test_tight_cache_serves_to_the_end(models):
    """A cache exactly as large as add_request demands still serves the request to its end."""
    target, drafters, reference = models
    engine = Engine(target, drafters["full"], max_num_reqs=1, max_num_tokens=4, page_size=4, num_pages=6)
    request_id = engine.add_request(PROMPTS[0] + [8, 9], SamplingParams(max_new_tokens=11))
    for _ in range(40):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    expected = generate_autoregressive(target, [PROMPTS[0] + [8, 9]], max_new_tokens=11).token_ids[0]
    assert engine.output(request_id) == expected


@pytest.mark.slow
def test_warming_engine_admits_within_its_compiled_programs(models):
    """While the rest compile elsewhere (a server warming up), an engine with only its first
    program (one request at the token budget, sampling) runs requests one at a time, decode
    and greedy steps on that program too: no step compiles, and the answers are exact."""
    target, drafters, reference = models
    engine = Engine(target, drafters["full"], max_num_reqs=2, max_num_tokens=64)
    assert engine.precompile(programs=engine.programs[:1]) == 1 and engine.num_compiled() == 1
    engine.admit_within_compiled = True
    traces = Engine.num_traces()
    ids = run(engine, PROMPTS[:3], SamplingParams(max_new_tokens=20))
    assert [engine.output(i) for i in ids] == reference[:3]
    assert Engine.num_traces() == traces and engine.num_compiled() == 1


@pytest.mark.slow
def test_precompile_covers_budgets_below_eight_tokens(models):
    target, drafters, _ = models
    engine = Engine(target, drafters["full"], max_num_reqs=1, max_num_tokens=4)
    assert engine.precompile() == len(engine.programs) == 2
    traces = Engine.num_traces()
    engine.add_request(PROMPTS[1], SamplingParams(max_new_tokens=6))
    while engine.has_unfinished():
        engine.step()
    assert Engine.num_traces() == traces


def test_more_refusals(models):
    target, drafters, _ = models
    engine = Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=32)
    with pytest.raises(ValueError, match="seed must be an integer"):
        engine.add_request([1], SamplingParams(seed=2**31))
    with pytest.raises(ValueError, match="no request with id 7"):
        engine.output(7)
    with pytest.raises(AttributeError):  # switching modes with a step in flight would lose it
        engine.async_scheduling = False
    with pytest.raises(ValueError, match="need a drafter"):
        Engine(target, None, block_size=4)
    with pytest.raises(ValueError, match="not both"):
        Engine(target, drafters["full"], num_pages=10, kv_cache_memory_bytes=10**6)
    with pytest.raises(ValueError, match=r"max_model_len must lie in \[1, 256\]"):
        Engine(target, drafters["full"], max_model_len=1000)
    with pytest.raises(ValueError, match="seed must be an integer"):
        dflash_jax.generate(target, drafters["full"], [[1]], max_new_tokens=2, seed=2**40)


MALFORMED = [
    (SamplingParams(stop_token_ids=5), "stop_token_ids must be a list"),
    (SamplingParams(stop_token_ids=[2.0]), "not an integer"),
    (SamplingParams(max_new_tokens=3.5), "max_new_tokens must be an integer"),
    (SamplingParams(max_new_tokens=True), "max_new_tokens must be an integer"),
    (SamplingParams(temperature=float("inf")), "temperature"),
    (SamplingParams(seed=1.5), "seed must be an integer"),
    (SamplingParams(stop_token_ids=list(range(20))), "at most 16 distinct stop token ids"),
]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_malformed_requests_are_refused_and_others_keep_their_tokens(models, async_scheduling):
    target, drafters, reference = models
    engine = Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=32, async_scheduling=async_scheduling)
    good = engine.add_request(PROMPTS[1], SamplingParams(max_new_tokens=20))
    engine.step()
    for params, message in MALFORMED:  # refused while the good one runs
        with pytest.raises(ValueError, match=message):
            engine.add_request(PROMPTS[0], params)
    with pytest.raises(TypeError, match="must be a SamplingParams"):
        engine.add_request(PROMPTS[0], {"max_new_tokens": 4})
    while engine.has_unfinished():
        engine.step()
    assert engine.output(good) == reference[1]


def test_a_failing_request_ends_alone(models, monkeypatch):
    """A request whose commit raises ends with finish reason "error"; the batch's others keep
    exactly their tokens."""
    target, drafters, reference = models
    engine = Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=32)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=20)) for p in PROMPTS[:3]]
    committed = engine.scheduler.committed

    def flaky(w, num_verified):
        if w.request.request_id == ids[1] and w.request.num_generated >= 3:
            raise RuntimeError("injected")
        committed(w, num_verified)

    monkeypatch.setattr(engine.scheduler, "committed", flaky)
    reasons = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert reasons == {ids[0]: "length", ids[1]: "error", ids[2]: "length"}
    assert "injected" in engine.stats(ids[1]).error
    assert [engine.output(ids[0]), engine.output(ids[2])] == [reference[0], reference[2]]
    engine.release(ids[1])
    with pytest.raises(ValueError, match="no request with id"):
        engine.output(ids[1])


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_seeded_sampled_tokens_do_not_depend_on_preemption(models, async_scheduling):
    """Sampled requests (temperature 0.8, fixed seeds, sampled drafts) in a cache tight
    enough to preempt them produce the tokens they produce in an ample one. (Argmax drafts:
    `test_sampled_request_is_the_same_alone_or_in_a_batch`.)"""
    target, drafters, _ = models
    outputs, preemptions = [], []
    for num_pages in (None, 16):
        engine = Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=32, page_size=4,
                        num_pages=num_pages, async_scheduling=async_scheduling)
        params = [SamplingParams(max_new_tokens=24, temperature=0.8, seed=s) for s in (1, 2, 3, 4)]
        ids = [engine.add_request(p[:12], q) for p, q in zip(PROMPTS[:4], params)]
        while engine.has_unfinished():
            engine.step()
        outputs.append([engine.output(i) for i in ids])
        preemptions.append(sum(engine.stats(i).num_preemptions for i in ids))
    assert preemptions[0] == 0 and preemptions[1] > 0
    assert outputs[1] == outputs[0]
