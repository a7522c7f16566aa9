"""Log-probabilities under speculation: each committed token's log-probability (and the top
alternatives) equals the target's own log-softmax at that position, whether the token was an
accepted draft, the target's token of a verify block, or the first token after prefill; a
request asking for none gets none, and asking changes no token."""

import jax
import numpy as np
import pytest

from dflash_jax.dense import target_forward
from dflash_jax.engine import Engine, SamplingParams
from test_engine import PROMPTS, models  # noqa: F401 (fixture)


def dense_logprobs(target, prompt, output):
    """log_softmax of the target's logits along prompt + output, at the positions that give each output token."""
    logits, _ = target_forward(target, list(prompt) + list(output))
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))[len(prompt) - 1 : len(prompt) + len(output) - 1]


@pytest.mark.parametrize("drafter_name, temperature", [("full", 0.9), pytest.param(None, 0.0, marks=pytest.mark.slow)])
def test_logprobs_are_the_targets_own(models, drafter_name, temperature):  # noqa: F811
    target, drafters, _ = models
    engine = Engine(target, drafters.get(drafter_name), max_num_reqs=4, max_num_tokens=32)
    asked = [SamplingParams(max_new_tokens=12, temperature=temperature, seed=i, logprobs=k)
             for i, k in enumerate([3, 0, None, 20])]
    ids = [engine.add_request(PROMPTS[i], params) for i, params in enumerate(asked)]
    streamed = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.new_token_ids)
                streamed[out.request_id] += out.logprobs
            else:
                assert asked[ids.index(out.request_id)].logprobs is None
    plain = Engine(target, drafters.get(drafter_name), max_num_reqs=4, max_num_tokens=32)
    plain_ids = [plain.add_request(PROMPTS[i], SamplingParams(max_new_tokens=12, temperature=temperature, seed=i))
                 for i in range(4)]
    while plain.has_unfinished():
        plain.step()
    for i, request_id in enumerate(ids):
        output = engine.output(request_id)
        assert output == plain.output(plain_ids[i])  # asking changes no token
        if asked[i].logprobs is None:
            assert streamed[request_id] == []
            continue
        reference = dense_logprobs(target, PROMPTS[i], output)
        got = streamed[request_id]
        assert len(got) == len(output)
        np.testing.assert_allclose([t.logprob for t in got], reference[np.arange(len(output)), output],
                                   rtol=1e-4, atol=1e-4)
        for token, row in zip(got, reference):
            assert len(token.top) == asked[i].logprobs
            top_ids = [t for t, _ in token.top]
            np.testing.assert_allclose([lp for _, lp in token.top], row[top_ids], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(sorted(row)[::-1][: len(top_ids)], [lp for _, lp in token.top],
                                       rtol=1e-4, atol=1e-4)


def test_bad_logprobs_are_refused(models):  # noqa: F811
    target, drafters, _ = models
    engine = Engine(target, drafters["full"], max_num_reqs=2, max_num_tokens=16)
    for bad in (-1, 21, 2.0, True):
        with pytest.raises(ValueError, match="logprobs must be None or an integer in"):
            engine.add_request([1, 2], SamplingParams(logprobs=bad))
