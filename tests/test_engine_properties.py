"""A property test over Engine workloads: random mixes of prompts, greedy and seeded sampled
requests, cache sizes that force preemption, aborts at random steps and malformed requests,
up to three verify cycles per step.
Every valid request's output equals its output in an ample cache (one cycle per step) with no companions' aborts
(greedy: `generate_autoregressive`'s in float32); malformed ones are refused at
`add_request`; nothing hangs."""

from __future__ import annotations


import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import dflash_jax
from conftest import drafter_config_dict, make_zlab_drafter, save_hf
from dflash_jax import Engine, SamplingParams
from test_generate import biased_target

MALFORMED = [
    SamplingParams(stop_token_ids=5), SamplingParams(max_new_tokens=3.5), SamplingParams(max_new_tokens=True),
    SamplingParams(temperature=float("nan")), SamplingParams(top_p=0.0), SamplingParams(seed="1"),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine_properties")
    hf = biased_target(seed=4)
    target = dflash_jax.load_target(save_hf(hf, tmp / "target"))
    config = drafter_config_dict(hf.config.to_dict(), dflash_config={"mask_token_id": 95, "block_size": 4})
    drafter = dflash_jax.load_drafter(save_hf(make_zlab_drafter(config, seed=5), tmp / "drafter", config))
    return target, drafter


request = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(1, 94), min_size=1, max_size=14),
    "max_new_tokens": st.integers(1, 12),
    "temperature": st.sampled_from([0.0, 0.0, 0.8]),
    "seed": st.integers(0, 3),
    "stop": st.sampled_from([(), (20,), (7, 30)]),
    "abort_at": st.one_of(st.none(), st.integers(1, 6)),
    "malformed": st.one_of(st.none(), st.sampled_from(range(len(MALFORMED)))),
})


def run(engine, requests):
    """Outputs of the valid requests, the aborted ones among them and the requests' ids (by
    index), stepping until none is left."""
    ids = {}
    for i, r in enumerate(requests):
        if r["malformed"] is not None:
            with pytest.raises((ValueError, TypeError)):
                engine.add_request(r["prompt"], MALFORMED[r["malformed"]])
            continue
        params = SamplingParams(max_new_tokens=r["max_new_tokens"], temperature=r["temperature"], seed=r["seed"],
                                stop_token_ids=r["stop"])
        ids[i] = engine.add_request(r["prompt"], params)
    steps, aborted = 0, set()
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < 400, "the engine stopped making progress"
        for i, request_id in ids.items():
            if requests[i]["abort_at"] == steps:
                engine.abort(request_id)
                aborted.add(i)
    return {i: engine.output(request_id) for i, request_id in ids.items()}, aborted, ids


def plain(prompt, max_new_tokens, temperature=0.0):
    """A valid request of the strategy's shape, with seed 0 and no stops or aborts."""
    return dict(prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=0, stop=(), abort_at=None,
                malformed=None)


# The sampled request is preempted after its first token; resumed, it drafts its next block
# in a recomputed chunk that commits nothing, across the whole block as if never stopped.
PREEMPTED_AFTER_ITS_FIRST_TOKEN = [plain([1], 1), plain([1], 12), plain([1] * 6, 3), plain([28, 1], 3, temperature=0.8)]


def test_a_sampled_request_preempted_after_its_first_token_draws_the_same_tokens(pair):
    target, drafter = pair
    outputs, preemptions = [], []
    for num_pages in (None, 12):
        engine = Engine(target, drafter, max_num_reqs=4, max_num_tokens=32, page_size=4, num_pages=num_pages)
        tokens, _, ids = run(engine, PREEMPTED_AFTER_ITS_FIRST_TOKEN)
        outputs.append(tokens[3])
        preemptions.append(engine.stats(ids[3]).num_preemptions)
    assert preemptions == [0, 1]
    assert outputs[1] == outputs[0]


@pytest.mark.slow
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request, min_size=1, max_size=5))
@example(requests=PREEMPTED_AFTER_ITS_FIRST_TOKEN)
def test_each_request_is_what_it_would_be_alone(pair, requests):
    target, drafter = pair
    tight = Engine(target, drafter, max_num_reqs=4, max_num_tokens=32, page_size=4, num_pages=12, cycles_per_step=3)
    outputs, aborted, _ = run(tight, requests)
    ample = Engine(target, drafter, max_num_reqs=4, max_num_tokens=32, page_size=4)
    expected, _, _ = run(ample, [dict(r, abort_at=None) for r in requests])
    for i, tokens in outputs.items():
        if i in aborted:
            assert tokens == expected[i][: len(tokens)]  # a prefix of what it would have said
        else:
            assert tokens == expected[i]
        r = requests[i]
        if r["temperature"] == 0 and i not in aborted:
            alone = dflash_jax.generate_autoregressive(target, [r["prompt"]], max_new_tokens=r["max_new_tokens"],
                                                       stop_token_ids=list(r["stop"]))
            assert tokens == alone.token_ids[0]
