"""Self-instruct prompts: parsing the target's list continuations, and the collection loop
(distinct requests, exclusions, a clear error when the target writes too few), with a fake
generate standing in for the target."""

import types

import pytest

import dflash_jax
from dflash_jax.train.self_instruct import clean_request, requests_in_reply, self_instruct_prompts


def test_reply_items_stop_at_the_first_unnumbered_line():
    reply = " How do bees fly?\n5. Tell me a joke about cats.\n6) Write a poem about rain.\nassistant\n7. Not this one.\n"
    assert requests_in_reply(reply) == ["How do bees fly?", "Tell me a joke about cats.", "Write a poem about rain."]


def test_a_line_cut_by_the_token_limit_is_dropped():
    assert requests_in_reply(" How do bees fly?\n5. Write a story about") == ["How do bees fly?"]
    assert requests_in_reply(" How do bees") == []


@pytest.mark.parametrize("text, want", [
    ('  "What causes the tides?"  ', "What causes the tides?"),
    ("Hi.", None),                        # too short
    ("one two", None),                    # fewer than three words
    ("1234 5678 9012 3456 !!!!", None),   # mostly not letters
    ("word " * 80, None),                 # too long
])
def test_clean_request(text, want):
    assert clean_request(text) == want


def fake_target(monkeypatch, replies):
    """generate_autoregressive returns, for prompt i of each call, the ids [k] of reply k
    (k counting across calls); decode maps [k] back to replies[k % len(replies)]."""
    calls = []

    def generate_autoregressive(target, prompts, **kwargs):
        start = sum(len(c) for c in calls)
        calls.append(prompts)
        return types.SimpleNamespace(token_ids=[[start + i] for i in range(len(prompts))])

    monkeypatch.setattr(dflash_jax, "generate_autoregressive", generate_autoregressive)
    return calls, (lambda text: [0] * len(text.split())), (lambda ids: replies[ids[0] % len(replies)])


def test_collects_distinct_requests_and_skips_excluded_ones(monkeypatch):
    replies = [
        " How do bees fly?\n5. What causes the tides?\n",
        " how do  BEES fly?\n",                               # a duplicate, up to case and spaces
        " Tell me about the held-out question please\n",      # excluded
        " Write a haiku about the moon.\n",                   # a template request: excluded too
        " x\n",                                               # junk
        " Describe a quiet morning in a village.\n",
    ]
    calls, encode, decode = fake_target(monkeypatch, replies)
    got = self_instruct_prompts(None, encode, decode, 3, exclude=["Tell me about the HELD-OUT question please"],
                                batch_size=4, max_rounds=3)
    assert [m[0]["content"] for m in got] == [
        "How do bees fly?", "What causes the tides?", "Describe a quiet morning in a village."]
    assert all(m[0]["role"] == "user" for m in got)
    assert len(calls) == 2 and all(len(c) == 4 for c in calls)  # the third request came in round two


def test_too_few_requests_is_a_clear_error(monkeypatch):
    _, encode, decode = fake_target(monkeypatch, [" How do bees fly?\n"])
    with pytest.raises(ValueError, match="wrote 1 usable distinct requests in 2 rounds"):
        self_instruct_prompts(None, encode, decode, 5, batch_size=3, max_rounds=2)


def test_runs_on_the_real_runtime():
    """The same loop through this project's generate_autoregressive on a tiny random target
    (its replies are random ids, spelled here as words on one line)."""
    from test_train_forward import tiny_pair

    target, _ = tiny_pair()
    decode = lambda ids: " ".join(f"word{i}" for i in ids[:6]) + "\n"  # noqa: E731
    got = self_instruct_prompts(target, lambda text: [1, 2, 3, 4], decode, 2, batch_size=2, max_new_tokens=6)
    assert len(got) == 2 and got[0] != got[1]
    assert all(len(m[0]["content"].split()) == 6 for m in got)
