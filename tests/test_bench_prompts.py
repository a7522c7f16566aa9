"""The diverse held-out prompt set, `bench.decode.batch1_speed` and `bench.acceptance.oracle`
on tiny models, so the H200 sweeps cannot rot between device sessions."""

import json

import pytest

from bench.acceptance import oracle as oracle_acceptance
from bench.acceptance import prompt_sets
from bench.decode import batch1_speed
from dflash_jax.demo import QUESTIONS
from dflash_jax.tokenizer import ChatTokenizer
from dflash_jax.train.prompts import INSTRUCTIONS, template_requests
from dflash_jax.train.task_prompts import FOLLOW_UPS, REWRITES, code_prompts, math_prompts
from test_cli_generate import models_dir  # noqa: F401 (a fixture)

CATEGORIES = ("everyday", "math", "code", "rewrite", "multi-turn")


def test_diverse_set_is_varied_and_unseen_in_training():
    messages, categories = prompt_sets.load_prompt_set("diverse")
    assert len(messages) >= 64 and set(categories) == set(CATEGORIES)
    assert all(categories.count(c) >= 13 for c in CATEGORIES)
    texts = [m["content"] for turns in messages for m in turns if m["role"] == "user"]
    assert len(set(texts)) == len(texts)
    training = {t.lower() for t in template_requests()} | {q.lower() for q in QUESTIONS}
    assert not training & {t.lower() for t in texts}
    assert not any(t.startswith(i.split("{")[0]) for t in texts for i in INSTRUCTIONS + REWRITES)
    tasks = {m[0]["content"].lower() for m in math_prompts(5000, seed=0) + code_prompts(960, seed=0)}
    assert not (tasks | {f.lower() for f in FOLLOW_UPS}) & {t.lower() for t in texts}
    for turns, category in zip(messages, categories):
        roles = [m["role"] for m in turns]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
        assert (len(roles) >= 3) == (category == "multi-turn")


@pytest.mark.slow
def test_sweep_reports_speed_and_tau_per_category(models_dir, tmp_path):  # noqa: F811
    prompts = tmp_path / "prompts.jsonl"
    turns = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "how are you"},
             {"role": "user", "content": "hello"}]
    assert ChatTokenizer(models_dir / "target").encode(turns) == [2, 4, 5, 3, 6, 7, 8, 2, 4, 3]  # every turn
    # Both prompts in one length bucket: one compiled program per setting.
    single = [{"role": "user", "content": "hello there how are you hello there how"}]
    prompts.write_text("\n".join(json.dumps(row) for row in [
        {"category": "a", "messages": single}, {"category": "b", "messages": turns}]))
    common = ["--target-dir", str(models_dir / "target"), "--drafter", str(models_dir / "drafter"), "--prompts",
              str(prompts), "--dtypes", "float32", "--block-sizes", "3", "--max-new-tokens", "4"]
    out = tmp_path / "speed.json"
    batch1_speed.main(common + ["--temperatures", "0,0.8", "--draft-sampling", "argmax,sample", "--rounds", "1",
                                "--out", str(out)])
    rows = json.loads(out.read_text())["results"]["rows"]
    settings = [(r["temperature"], r["block_size"], r["draft_sampling"]) for r in rows]
    assert settings == [(0.0, None, None), (0.0, 3, "argmax"), (0.8, None, None), (0.8, 3, "argmax"),
                        (0.8, 3, "sample")]
    assert all(r["tokens_per_s"] > 0 and set(r["tau_per_category"]) == {"a", "b"} for r in rows)
    batch1_speed.main(common + ["--temperatures", "0.8", "--draft-sampling", "argmax", "--acceptance-only",
                                "--out", str(out)])
    (tau_only,) = json.loads(out.read_text())["results"]["rows"]
    assert tau_only["tau_per_category"] == rows[3]["tau_per_category"]  # batched or not, the same tokens


def test_oracle_cycles_run_while_tokens_are_argmaxes():
    assert oracle_acceptance.oracle_cycles([True] * 10, 4) == [4, 4, 2]  # 3 drafts + the bonus; the end cuts
    # A miss ends its cycle (the residual's draw); a full run ends on the bonus whatever it is.
    assert oracle_acceptance.oracle_cycles([False, True, True, True, False, False], 4) == [1, 4, 1]
    assert oracle_acceptance.oracle_cycles([], 4) == []


@pytest.mark.slow
def test_oracle_reads_greedy_answers_as_all_argmax(models_dir, tmp_path):  # noqa: F811
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"category": "a", "messages": [{"role": "user", "content": "hello there"}]}))
    out = tmp_path / "oracle.json"
    oracle_acceptance.main(["--target-dir", str(models_dir / "target"), "--prompts", str(prompts), "--temperatures",
                            "0,0.8", "--block-size", "3", "--max-new-tokens", "8", "--out", str(out)])
    greedy, sampled = json.loads(out.read_text())["results"]["rows"]
    assert greedy["argmax_share"] == 1.0  # the dense forward's argmax is the decoder's, token for token
    assert 1.0 <= sampled["oracle_tau"] <= greedy["oracle_tau"] <= 3.0
