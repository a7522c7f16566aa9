"""Logit bias and min_tokens under speculation: they change the target's distribution the
same way in verify blocks and single steps, so greedy DFlash with them equals greedy
autoregressive decoding with them, token for token; bad values are refused."""

import pytest

from dflash_jax.engine import Engine, SamplingParams
from test_engine import PROMPTS, models  # noqa: F401 (fixture)


def outputs(engine, params_list):
    ids = [engine.add_request(PROMPTS[i], params) for i, params in enumerate(params_list)]
    while engine.has_unfinished():
        engine.step()
    return [engine.output(i) for i in ids]


def test_bias_and_min_tokens_match_autoregressive_decoding(models):  # noqa: F811
    target, drafters, reference = models
    first = [answer[0] for answer in reference[:4]]
    params = [
        SamplingParams(max_new_tokens=12, logit_bias=((7, 100.0),)),  # 7 wins everywhere
        SamplingParams(max_new_tokens=12, logit_bias={first[1]: -100.0, 3: 2.5}),  # the first answer's token is barred
        SamplingParams(max_new_tokens=12, stop_token_ids=(first[2],), min_tokens=5),  # no stop before 5 tokens
        SamplingParams(max_new_tokens=12, stop_token_ids=(first[3],)),  # stops at once, as a control
    ]
    dflash = outputs(Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=32), params)
    plain = outputs(Engine(target, None, max_num_reqs=4, max_num_tokens=32), params)
    assert dflash == plain
    assert dflash[0] == [7] * 12
    assert dflash[1][0] != first[1]
    assert len(dflash[2]) >= 5 and first[2] not in dflash[2][:5]
    assert dflash[3] == [first[3]]


def test_sampled_rows_keep_min_tokens_then_take_the_bias(models):  # noqa: F811
    """At temperature 0.9 a stop token biased by +100 is all but certain, but not before
    min_tokens: every answer is 6 tokens and then the stop token."""
    target, drafters, _ = models
    stop = 11
    params = [SamplingParams(max_new_tokens=12, temperature=0.9, seed=i, stop_token_ids=(stop,), min_tokens=6,
                             logit_bias={stop: 100.0}) for i in range(4)]
    for answer in outputs(Engine(target, drafters["full"], max_num_reqs=4, max_num_tokens=32), params):
        assert len(answer) == 7 and answer[-1] == stop and stop not in answer[:-1]


@pytest.mark.parametrize("params, said", [
    (SamplingParams(logit_bias=((96, 1.0),)), "not an id in the vocabulary"),
    (SamplingParams(logit_bias={1: 101.0}), r"must be a number in \[-100, 100\]"),
    (SamplingParams(logit_bias={1: float("nan")}), r"must be a number in \[-100, 100\]"),
    (SamplingParams(logit_bias={i: 1.0 for i in range(65)}), "at most 64 tokens"),
    (SamplingParams(min_tokens=-1), "min_tokens must be at least 0"),
    (SamplingParams(max_new_tokens=4, min_tokens=5), "min_tokens=5 exceeds max_new_tokens=4"),
])
def test_bad_values_are_refused(models, params, said):  # noqa: F811
    target, drafters, _ = models
    engine = Engine(target, drafters["full"], max_num_reqs=2, max_num_tokens=16)
    with pytest.raises(ValueError, match=said):
        engine.add_request([1, 2], params)


@pytest.mark.parametrize("field", [dict(logprobs=0), dict(logit_bias={1: 1.0}), dict(min_tokens=1)])
def test_generate_refuses_what_only_the_engine_does(models, field):  # noqa: F811
    from dflash_jax.generate import generate

    target, drafters, _ = models
    with pytest.raises(ValueError, match=f"generate does not take {next(iter(field))}; run such requests on the Engine"):
        generate(target, drafters["full"], [PROMPTS[0]], sampling_params=SamplingParams(max_new_tokens=4, **field))
