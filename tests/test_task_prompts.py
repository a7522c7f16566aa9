"""Task prompts for training: distinct, reproducible word problems and code requests, and
follow-ups built on the target's answers (a fake generate stands in for the target)."""

import types

import pytest

import dflash_jax
from dflash_jax.train.task_prompts import (
    FOLLOW_UPS, code_prompts, first_turns, follow_up_prompts, follow_ups_from_target, math_prompts, task_prompts,
)


def contents(prompts):
    return [m[-1]["content"] for m in prompts]


def test_math_prompts_are_distinct_filled_and_reproducible():
    prompts = math_prompts(300, seed=3)
    texts = contents(prompts)
    assert len(set(texts)) == 300
    assert all("{" not in t and "}" not in t for t in texts)  # every field was filled
    assert texts == contents(math_prompts(300, seed=3)) and texts != contents(math_prompts(300, seed=4))
    assert all(m == [{"role": "user", "content": t}] for m, t in zip(prompts, texts))


def test_code_prompts_refuse_more_than_exist():
    assert len(set(contents(code_prompts(960, seed=0)))) == 960
    with pytest.raises(ValueError, match="961 code prompts; there are 960"):
        code_prompts(961, seed=0)


def test_task_prompts_alternate_math_and_code():
    prompts = contents(task_prompts(7, seed=0))
    assert len(prompts) == 7
    assert prompts[0::2] == contents(math_prompts(4, seed=0)) and prompts[1::2] == contents(code_prompts(3, seed=0))


def test_large_counts_fill_with_word_problems_past_the_distinct_requests():
    tasks = contents(task_prompts(3000, seed=1))
    code = set(contents(code_prompts(960, seed=1)))
    assert len(set(tasks)) == 3000 and len(code & set(tasks)) == 960
    turns = contents(first_turns(4000, seed=1))
    assert len(set(turns)) == 4000 and len(code & set(turns)) == 960  # 1690 everyday, 960 code, the rest math


def test_follow_ups_alternate_a_second_turn_and_a_rewrite_and_skip_empty_answers():
    first = [[{"role": "user", "content": f"question {i}"}] for i in range(5)]
    answers = ["answer 0", "  ", "answer 2\n", "answer 3", "answer 4"]
    got = follow_up_prompts(list(zip(first, answers)), seed=0)
    assert len(got) == 4  # the blank answer is skipped
    turn, rewrite = got[0], got[1]
    assert [m["role"] for m in turn] == ["user", "assistant", "user"]
    assert turn[1]["content"] == "answer 0" and turn[2]["content"] in FOLLOW_UPS
    assert len(rewrite) == 1 and rewrite[0]["content"].endswith("\n\nanswer 2")  # stripped, as a passage
    assert [m["role"] for m in got[2]] == ["user", "assistant", "user"] and got[2][0]["content"] == "question 3"


def test_follow_ups_from_target_answer_each_first_turn_in_batches(monkeypatch):
    calls = []

    def generate_autoregressive(target, prompts, **kwargs):
        calls.append((len(prompts), kwargs["stop_token_ids"]))
        return types.SimpleNamespace(token_ids=[[p[0]] for p in prompts])

    monkeypatch.setattr(dflash_jax, "generate_autoregressive", generate_autoregressive)
    first = [[{"role": "user", "content": str(i)}] for i in range(5)]
    got = follow_ups_from_target(None, lambda m: [int(m[0]["content"])], lambda ids: f"reply to {ids[0]}", first,
                                 batch_size=2, stop_token_ids=[9])
    assert calls == [(2, [9]), (2, [9]), (1, [9])]
    assert got[0][1]["content"] == "reply to 0" and got[1][0]["content"].endswith("reply to 1")
    assert len(got) == 5
