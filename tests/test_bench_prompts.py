"""The diverse held-out prompt set and `bench/batch1_speed.py` on tiny models, so the H200
sweep cannot rot between device sessions."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import batch1_speed  # noqa: E402
import prompt_sets  # noqa: E402

from dflash_jax.demo import QUESTIONS  # noqa: E402
from dflash_jax.tokenizer import ChatTokenizer  # noqa: E402
from dflash_jax.train.prompts import INSTRUCTIONS, template_requests  # noqa: E402
from dflash_jax.train.task_prompts import FOLLOW_UPS, REWRITES, code_prompts, math_prompts  # noqa: E402
from test_cli_generate import models_dir  # noqa: E402, F401 (a fixture)

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
    rows = json.loads(out.read_text())["results"]
    settings = [(r["temperature"], r["block_size"], r["draft_sampling"]) for r in rows]
    assert settings == [(0.0, None, None), (0.0, 3, "argmax"), (0.8, None, None), (0.8, 3, "argmax"),
                        (0.8, 3, "sample")]
    assert all(r["tokens_per_s"] > 0 and set(r["tau_per_category"]) == {"a", "b"} for r in rows)
    batch1_speed.main(common + ["--temperatures", "0.8", "--draft-sampling", "argmax", "--acceptance-only",
                                "--out", str(out)])
    (tau_only,) = json.loads(out.read_text())["results"]
    assert tau_only["tau_per_category"] == rows[3]["tau_per_category"]  # batched or not, the same tokens
