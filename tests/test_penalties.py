"""Presence, frequency and repetition penalties under speculation: verify row j is penalized
for the anchor and drafts 0 .. j - 1 as a single step would be for the tokens before it, so
greedy DFlash with penalties equals greedy decoding with them, which equals a numpy
reference of vLLM's rule over the dense target; sampled rows draw from the penalized
distribution; preemption recounts; bad values are refused."""

import numpy as np
import pytest

from dflash_jax.dense import target_forward
from dflash_jax.engine import Engine, SamplingParams
from test_engine import PROMPTS, models  # noqa: F401 (fixture)

PENALTIES = [dict(repetition_penalty=3.0), dict(frequency_penalty=2.0), dict(presence_penalty=2.0),
             dict(presence_penalty=-1.0, frequency_penalty=1.0, repetition_penalty=0.5)]


def reference_greedy(target, prompt, num_tokens, presence_penalty=0.0, frequency_penalty=0.0,
                     repetition_penalty=1.0):
    """vLLM's penalties applied to the dense target's logits, one greedy token at a time."""
    out = []
    for _ in range(num_tokens):
        logits, _ = target_forward(target, list(prompt) + out)
        row = np.asarray(logits[-1], np.float64)
        counts = np.bincount(out, minlength=row.size)
        seen = (counts > 0) | (np.bincount(prompt, minlength=row.size) > 0)
        row = np.where(seen, np.where(row > 0, row / repetition_penalty, row * repetition_penalty), row)
        row = row - frequency_penalty * counts - presence_penalty * (counts > 0)
        out.append(int(np.argmax(row)))
    return out


def run(engine, params_list):
    ids = [engine.add_request(PROMPTS[i % len(PROMPTS)], p) for i, p in enumerate(params_list)]
    while engine.has_unfinished():
        engine.step()
    return [engine.output(i) for i in ids]


def test_greedy_penalties_match_the_reference(models):  # noqa: F811
    target, drafters, reference = models
    params = [SamplingParams(max_new_tokens=10, **p) for p in PENALTIES]
    dflash = run(Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=32), params)
    for i, (answer, penalty) in enumerate(zip(dflash, PENALTIES)):
        assert answer == reference_greedy(target, PROMPTS[i], 10, **penalty), penalty
    assert sum(answer != reference[i][:10] for i, answer in enumerate(dflash)) >= 2  # the penalties bite


@pytest.mark.slow
def test_penalties_survive_preemption_and_prefix_hits(models):  # noqa: F811
    """A cache too small for all: requests are preempted and recomputed, and a penalized
    request shares its prompt with an earlier one (it must not take the cached pages, whose
    tokens its counts would miss); answers stay the autoregressive engine's."""
    target, drafters, _ = models
    params = [SamplingParams(max_new_tokens=16, **PENALTIES[i % 4]) for i in range(5)]
    tight = Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=16, page_size=4, num_pages=40)
    ids = [tight.add_request(PROMPTS[2], SamplingParams(max_new_tokens=4))]  # caches PROMPTS[2]'s pages
    while tight.has_unfinished():
        tight.step()
    got = run(tight, params)
    assert sum(tight.stats(i).num_preemptions for i in range(1, 6)) > 0
    assert tight.stats(ids[0] + 3).num_cached_tokens == 0  # PROMPTS[2], penalized: no hit
    assert got == run(Engine(target, None, max_num_reqs=4, max_num_tokens=32), params)


@pytest.mark.slow
def test_sampled_penalized_rows_follow_the_penalized_distribution(models):  # noqa: F811
    """A frequency penalty of 2 at temperature 1: DFlash and plain decoding repeat tokens
    equally rarely (the same law), far less than without the penalty."""
    target, drafters, _ = models

    def repeats(drafter, penalty):
        params = [SamplingParams(max_new_tokens=24, temperature=1.0, seed=s, frequency_penalty=penalty)
                  for s in range(8)]
        answers = run(Engine(target, drafter, max_num_reqs=4, max_num_tokens=32), params)
        return np.mean([1 - len(set(a)) / len(a) for a in answers])

    penalized = [repeats(drafters["full"], 2.0), repeats(None, 2.0)]
    assert abs(penalized[0] - penalized[1]) < 0.1
    assert max(penalized) < repeats(None, 0.0)


@pytest.mark.parametrize("params, said", [
    (SamplingParams(presence_penalty=2.5), r"presence_penalty must be a number in \[-2, 2\]"),
    (SamplingParams(frequency_penalty=float("nan")), r"frequency_penalty must be a number in \[-2, 2\]"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (SamplingParams(repetition_penalty=True), "repetition_penalty must be a finite number > 0"),
])
def test_bad_penalties_are_refused(models, params, said):  # noqa: F811
    target, drafters, _ = models
    engine = Engine(target, drafters["full"], max_num_reqs=2, max_num_tokens=16)
    with pytest.raises(ValueError, match=said):
        engine.add_request([1, 2], params)
