"""Read a llama.cpp GGUF file as a HF-style config plus a `TensorSource`, without torch.

GGUF keeps the config in `<architecture>.*` metadata and the weights under llama.cpp names
(`blk.N.attn_q.weight`, ...), often block-quantized. This module turns the metadata into the
`TargetConfig` the rest of the project uses (written out as a HF `config.json`) and serves
each tensor dequantized to float32 in the HF layout, so `hf_to_nnx` converts it with the same
rules and shape checks as a safetensors folder. The llama, qwen3, qwen3moe and gpt-oss
architectures are read; a qwen3moe file's stacked experts (`ffn_gate_exps`, ...) are served one
expert at a time under the names of HF's per-expert tensors, a gpt-oss file's (MXFP4 blocks,
dequantized) as HF's stacked tensors with gate and up columns interleaved.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np

from dflash_jax.config import ConfigError, ExpertsConfig, RopeConfig, TargetConfig, parse_target_config
from dflash_jax.formats.hf_config import to_hf_config
from dflash_jax.formats.hf_reader import ConversionError, TensorSource
from dflash_jax.formats.weight_map import WeightRule, target_rules
from dflash_jax.layers import rope_frequencies
from dflash_jax.quantization import GGUF_Q8_0

# llama.cpp tensor names -> HF names: whole-model tensors, then per-block ones (`blk.N.`).
MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
}
# Names a gpt-oss file gives parts that other files name as BLOCK_TENSORS does.
GPT_OSS_ALIASES = {"post_attention_norm": "ffn_norm"}
# Stacked experts [experts, out, in] -> HF's per-expert names (`mlp.experts.E.<name>`).
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# GGUF architecture -> the HF one it is read as.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                 "gpt-oss": "GptOssForCausalLM"}
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
Q8_0, Q8_0_BLOCK = 8, 32  # GGMLQuantizationType.Q8_0, and its block of input columns
_HF_TO_GGUF = {hf: gguf for gguf, hf in MODEL_TENSORS.items()}
_HF_BLOCK_TO_GGUF = {hf: gguf for gguf, hf in BLOCK_TENSORS.items()} | {"mlp.router": "ffn_gate_inp"}
# gpt-oss's stacked HF expert tensors, served under these names (`blk.N.` + name) built from the
# file's per-kind stacks; and its attention sinks, a bare HF parameter.
GPT_OSS_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
GPT_OSS_STACKS = (*EXPERT_TENSORS, "ffn_gate_up_exps")
_HF_EXPERT_TO_GGUF = {hf: gguf for gguf, hf in EXPERT_TENSORS.items()}


def is_gguf_file(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf" and not Path(path).is_dir()


def gguf_tensor_name(hf_name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`; an expert's
    `model.layers.3.mlp.experts.5.gate_proj.weight` -> `blk.3.ffn_gate_exps.5.weight` (a name
    `open_gguf` serves as one expert of the file's stacked `blk.3.ffn_gate_exps.weight`)."""
    stem, suffix = hf_name.rsplit(".", 1)
    if suffix in GPT_OSS_EXPERTS or suffix == "sinks":
        layer = stem.removeprefix("model.layers.").split(".", 1)[0]
        return f"blk.{layer}.attn_sinks.weight" if suffix == "sinks" else f"blk.{layer}.experts.{suffix}"
    if stem.startswith("model.layers."):
        layer, module = stem.removeprefix("model.layers.").split(".", 1)
        if module.startswith("mlp.experts."):
            expert, proj = module.removeprefix("mlp.experts.").split(".")
            return f"blk.{layer}.{_HF_EXPERT_TO_GGUF[proj]}.{expert}.{suffix}"
        return f"blk.{layer}.{_HF_BLOCK_TO_GGUF[module]}.{suffix}"
    return f"{_HF_TO_GGUF[stem]}.{suffix}"


def gguf_target_rules(cfg: TargetConfig) -> list[WeightRule]:
    """The HF target rules, each `hf_name` replaced by the tensor's name in a GGUF file."""
    return [dataclasses.replace(r, hf_name=gguf_tensor_name(r.hf_name)) for r in target_rules(cfg)]


def open_gguf_reader(path: str | Path):
    """A `gguf.GGUFReader`, or a ConversionError when the file is missing or unreadable.

    The last reader is kept (keyed by size and mtime): a conversion reads the file for its
    tokenizer and again for its weights, and parsing a 49k-token vocabulary takes seconds.
    """
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path} does not exist; give a .gguf file or a HF model folder.")
    stat = path.stat()
    return _gguf_reader(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _gguf_reader(path: Path, size: int, mtime_ns: int):
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise ConversionError("reading .gguf files needs the gguf extra: pip install 'dflash-jax[gguf]'.") from err
    try:
        return GGUFReader(path)
    except Exception as err:  # the reader raises ValueError, KeyError, IndexError... on bad bytes
        raise ConversionError(f"{path.name} is truncated or corrupt ({err}); download it again.") from err


def open_gguf(path: str | Path) -> tuple[dict, TensorSource]:
    """(HF config.json dict, tensors by GGUF name in HF layout, q/k rows un-permuted).

    Tensors come dequantized to float32, except where every decoder-layer projection is Q8_0:
    those stay 8-bit (int8 values, and their per-32 scales as `<name>.q8_0_scale` [out, in / 32],
    a name the file does not have), with the config saying so (`GGUF_Q8_0`)."""
    reader = open_gguf_reader(path)
    metadata = gguf_metadata(reader)
    gpt_oss = metadata.get("general.architecture") == "gpt-oss"
    tensors = {_gpt_oss_name(tensor.name) if gpt_oss else tensor.name: tensor for tensor in reader.tensors}
    rope_freqs = tensors.pop("rope_freqs.weight", None)
    embedding = tensors.get("token_embd.weight")  # GGUF shapes list the fastest axis first: [hidden, vocab]
    cfg = target_config_from_gguf(metadata, set(tensors), Path(path).name,
                                  None if rope_freqs is None else np.asarray(rope_freqs.data, np.float32),
                                  None if embedding is None else int(embedding.shape[-1]))
    # llama.cpp interleaves the q/k rows of llama files only (its `permute`)
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads} if metadata["general.architecture"] == "llama" else {}
    projections = [f"blk.{i}.{kind}.weight" for i in range(cfg.num_layers) for kind in PROJECTIONS]
    eight_bit = cfg.experts is None and all(tensors[name].tensor_type == Q8_0
                                            for name in projections if name in tensors)
    scales = {name.removesuffix("weight") + GGUF_Q8_0.hf_scale: name for name in projections} if eight_bit else {}
    experts = {}  # `blk.N.ffn_gate_exps.E.weight` -> (the stacked tensor's name, E)
    for name, tensor in tensors.items():
        block, layer, kind, suffix = (name.split(".") + [""] * 4)[:4]
        if kind in EXPERT_TENSORS and not gpt_oss:
            experts.update({f"{block}.{layer}.{kind}.{e}.{suffix}": (name, e) for e in range(int(tensor.shape[-1]))})

    def dequantized(name: str) -> np.ndarray:
        from gguf import dequantize

        try:
            return dequantize(tensors[name].data, tensors[name].tensor_type)
        except NotImplementedError as err:
            raise ConversionError(f"cannot dequantize {name!r} ({tensors[name].tensor_type.name}): {err}") from err

    stacked_experts = functools.lru_cache(maxsize=len(EXPERT_TENSORS))(dequantized)  # a layer's experts, in turn
    shapes = {name: tuple(int(d) for d in reversed(t.shape.tolist())) for name, t in tensors.items()}
    stacked_hf = _gpt_oss_experts(cfg.num_layers, shapes, dequantized) if gpt_oss else {}

    def get(name: str) -> np.ndarray:
        if name in stacked_hf:
            return stacked_hf[name][1]()
        if name in experts:
            stacked, expert = experts[name]
            return stacked_experts(stacked)[expert]
        stored = scales.get(name, name)
        array = q8_0_parts(tensors[stored].data)[name in scales] if eight_bit and stored in projections else \
            dequantized(stored)
        kind = name.split(".")[2] if name.startswith("blk.") else None
        return unpermute_rows(array, heads[kind]) if kind in heads else array

    if gpt_oss:  # the per-kind stacks are read only through `stacked_hf`
        shapes = {name: shape for name, shape in shapes.items() if _kind(name) not in GPT_OSS_STACKS}
    shapes.update({name: shape for name, (shape, _) in stacked_hf.items()})
    shapes.update({name: shapes[stacked][1:] for name, (stacked, _) in experts.items()})
    for stacked in {stacked for stacked, _ in experts.values()}:
        del shapes[stacked]
    shapes.update({scale: (shapes[weight][0], shapes[weight][1] // Q8_0_BLOCK) for scale, weight in scales.items()
                   if weight in shapes})
    if eight_bit:
        cfg = dataclasses.replace(cfg, quantization=GGUF_Q8_0)
    return to_hf_config(cfg), TensorSource(shapes, get)


def _kind(name: str) -> str:
    """`blk.N.<kind>.<suffix>` -> kind; '' for whole-model tensors."""
    parts = name.split(".")
    return parts[2] if name.startswith("blk.") and len(parts) > 3 else ""


def _gpt_oss_name(name: str) -> str:
    """A gpt-oss file's tensor name as other files name the same part."""
    block, layer, kind, suffix = (name.split(".", 3) + [""] * 4)[:4]
    return f"{block}.{layer}.{GPT_OSS_ALIASES[kind]}.{suffix}" if kind in GPT_OSS_ALIASES else name


def _gpt_oss_experts(num_layers: int, shapes: dict, dequantized) -> dict[str, tuple[tuple, object]]:
    """`blk.N.experts.<HF name>` -> (shape, loader) of gpt-oss's stacked HF expert tensors, from
    the file's gate, up and down stacks ([E, I, D], [E, I, D], [E, D, I]; llama.cpp may fuse gate
    and up into `ffn_gate_up_exps` [E, 2I, D], gate rows first) and their biases. HF interleaves
    gate and up columns (`gate_up_proj` [E, D, 2I]) and stores down as [E, I, D]."""

    def interleaved(blk: str, suffix: str) -> np.ndarray:  # gate and up rows alternating: [E, 2I, ...]
        if f"{blk}.ffn_gate_up_exps.weight" in shapes:
            gate, up = np.split(dequantized(f"{blk}.ffn_gate_up_exps.{suffix}"), 2, axis=1)
        else:
            gate, up = dequantized(f"{blk}.ffn_gate_exps.{suffix}"), dequantized(f"{blk}.ffn_up_exps.{suffix}")
        return np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, *gate.shape[2:])

    loaders = {
        "gate_up_proj": lambda blk: interleaved(blk, "weight").transpose(0, 2, 1),
        "gate_up_proj_bias": lambda blk: interleaved(blk, "bias"),
        "down_proj": lambda blk: dequantized(f"{blk}.ffn_down_exps.weight").transpose(0, 2, 1),
        "down_proj_bias": lambda blk: dequantized(f"{blk}.ffn_down_exps.bias"),
    }
    out = {}
    for i in range(num_layers):
        blk = f"blk.{i}"
        if f"{blk}.ffn_down_exps.weight" not in shapes:
            raise ConversionError(f"the gpt-oss file has no {blk}.ffn_down_exps.weight; the file is incomplete.")
        experts, hidden, inter = shapes[f"{blk}.ffn_down_exps.weight"]
        hf_shapes = {"gate_up_proj": (experts, hidden, 2 * inter), "gate_up_proj_bias": (experts, 2 * inter),
                     "down_proj": (experts, inter, hidden), "down_proj_bias": (experts, hidden)}
        out.update({f"{blk}.experts.{name}": (shape, functools.partial(loaders[name], blk))
                    for name, shape in hf_shapes.items()})
    return out


def q8_0_parts(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 values [out, in], float32 scales [out, in / 32]) of a Q8_0 tensor's raw rows: each
    block of 32 is a float16 scale, then 32 int8 values."""
    blocks = data.reshape(data.shape[0], -1, 2 + Q8_0_BLOCK)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    return blocks[..., 2:].copy().view(np.int8).reshape(data.shape[0], -1), scales


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (its `permute` in convert_hf_to_gguf.py) for `[out, ...]`.

    llama.cpp stores each head's rows interleaved (GPT-J style rotation: pairs 0,1 / 2,3 ...);
    HF rotates halves (neox style: pairs i, i + head_dim/2). Per head, row 2j+k of the file is
    HF row k*head_dim/2 + j, so view rows as [head, j, k] and swap to [head, k, j].
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_metadata(reader) -> dict:
    """Metadata key -> Python value (str, number, bool or list), without the GGUF.* header keys."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def target_config_from_gguf(metadata: dict, tensor_names: set[str], file_name: str,
                            rope_freqs: np.ndarray | None = None, embedding_rows: int | None = None) -> TargetConfig:
    """`<architecture>.*` metadata -> TargetConfig; vocabulary from the token list, else the
    `vocab_size` metadata, else the embedding's `embedding_rows`; `rope_freqs`: the file's
    `rope_freqs.weight` (Llama 3.1's per-frequency RoPE factors), read back as the llama3
    scaling that made them."""
    architecture = metadata.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise ConversionError(f"{file_name} holds a {architecture!r} model; supported GGUF architectures are "
                              f"{', '.join(ARCHITECTURES)}.")
    if architecture in ("llama", "qwen3") and any("_exps." in name for name in tensor_names):
        raise ConversionError(f"{file_name} is a {architecture}-architecture mixture of experts (Mixtral-style "
                              "expert tensors); GGUF experts are read for qwen3moe and gpt-oss files only.")
    if "rope_freqs.weight" in tensor_names and rope_freqs is None:
        raise ConversionError(f"{file_name} stores per-frequency RoPE factors (rope_freqs.weight); pass their "
                              "values to read them.")

    def field(key: str, default=None):
        value = metadata.get(f"{architecture}.{key}", default)
        if value is None:
            raise ConversionError(f"{file_name} has no {architecture}.{key} metadata; the file is incomplete.")
        return value

    hidden, heads = int(field("embedding_length")), int(field("attention.head_count"))
    head_dim = int(field("attention.key_length", hidden // heads))
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens else metadata.get(f"{architecture}.vocab_size", embedding_rows)
    if vocab_size is None:
        raise ConversionError(f"{file_name} has neither a token list, {architecture}.vocab_size metadata nor a "
                              "token_embd.weight tensor; the file is incomplete.")
    layers = int(field("block_count"))
    if architecture == "gpt-oss":
        return _gpt_oss_config(field, int(vocab_size), layers, "output.weight" not in tensor_names, file_name)
    experts = None
    if architecture == "qwen3moe":  # every layer sparse; llama.cpp renormalises the chosen experts' weights
        experts = ExpertsConfig(num_experts=int(field("expert_count")), top_k=int(field("expert_used_count")),
                                intermediate_size=int(field("expert_feed_forward_length")), norm_topk_prob=True,
                                layers=tuple(range(layers)))
    return TargetConfig(
        architecture=ARCHITECTURES[architecture],
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(field("feed_forward_length", 0) if experts else field("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(field("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon")),
        rope=(_rope_config(metadata, architecture, file_name) if rope_freqs is None else
              _llama3_rope(rope_freqs, float(metadata.get(f"{architecture}.rope.freq_base", 1e4)), head_dim,
                           file_name)),
        max_position_embeddings=int(field("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        qk_norm=architecture != "llama",
        experts=experts,
    )


def _gpt_oss_config(field, vocab_size: int, layers: int, tied: bool, file_name: str) -> TargetConfig:
    """gpt-oss as its HF config.json says it, parsed by the same rules. llama.cpp stores none of
    what the architecture fixes: windows on even layers, YaRN without truncated ramp ends, the
    clamped SwiGLU's constants."""
    rope = {"rope_type": "yarn", "rope_theta": float(field("rope.freq_base")),
            "factor": float(field("rope.scaling.factor")),
            "original_max_position_embeddings": int(field("rope.scaling.original_context_length")),
            "beta_fast": float(field("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(field("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
    heads = int(field("attention.head_count"))
    raw = {
        "architectures": ["GptOssForCausalLM"], "vocab_size": vocab_size, "num_hidden_layers": layers,
        "hidden_size": int(field("embedding_length")), "num_attention_heads": heads,
        "num_key_value_heads": int(field("attention.head_count_kv", heads)),
        "head_dim": int(field("attention.key_length")),
        "intermediate_size": int(field("expert_feed_forward_length", field("feed_forward_length", 0))),
        "num_local_experts": int(field("expert_count")), "num_experts_per_tok": int(field("expert_used_count")),
        "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(field("context_length")), "tie_word_embeddings": tied,
        "sliding_window": int(field("attention.sliding_window")),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "rope_parameters": rope,
    }
    try:
        return parse_target_config(raw)
    except ConfigError as err:
        raise ConversionError(f"{file_name}: {err}") from err


def _llama3_rope(factors: np.ndarray, theta: float, head_dim: int, file_name: str) -> RopeConfig:
    """The llama3 RoPE scaling whose per-frequency factors llama.cpp stored (frequencies divided
    by them): `factor` the largest, the ramp between the low and high frequency factors 1 and 4
    (Llama 3.1 and 3.2's) placing `original_max_position_embeddings`. Checked by recomputing
    every factor; factors of any other shape are refused."""
    factors = np.asarray(factors, np.float64).reshape(-1)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen, factor = 2 * np.pi / inv_freq, float(factors.max())
    ramp = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    if factors.shape != inv_freq.shape or factor <= 1 or not ramp.any():
        raise ConversionError(f"{file_name} stores per-frequency RoPE factors (rope_freqs.weight) that are not "
                              "Llama 3's scaling; convert the HF checkpoint instead.")
    smooth = (1 / factors[ramp] - 1 / factor) / (1 - 1 / factor)
    original = int(round(float(np.mean((3 * smooth + 1) * wavelen[ramp]))))
    rope = RopeConfig(theta=theta, rope_type="llama3", scaling=tuple(sorted(
        {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": original}.items())))
    scaled, _ = rope_frequencies(rope, head_dim)
    if not np.allclose(scaled, inv_freq / factors, rtol=1e-4):
        raise ConversionError(f"{file_name} stores per-frequency RoPE factors (rope_freqs.weight) that are not "
                              "Llama 3's scaling; convert the HF checkpoint instead.")
    return rope


def _rope_config(metadata: dict, architecture: str, file_name: str) -> RopeConfig:
    """`<architecture>.rope.*`: base frequency and the scaling llama.cpp records (none, linear or yarn)."""
    theta = float(metadata.get(f"{architecture}.rope.freq_base", 1e4))
    scaling_type = metadata.get(f"{architecture}.rope.scaling.type", "none")
    factor = metadata.get(f"{architecture}.rope.scaling.factor")
    if scaling_type == "none" or factor in (None, 0.0, 1.0):
        return RopeConfig(theta=theta)
    if scaling_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", scaling=(("factor", float(factor)),))
    if scaling_type == "yarn":
        original = int(metadata.get(f"{architecture}.rope.scaling.original_context_length",
                                    metadata[f"{architecture}.context_length"]))
        scaling = (("factor", float(factor)), ("original_max_position_embeddings", original))
        return RopeConfig(theta=theta, rope_type="yarn", scaling=scaling)
    raise ConversionError(f"{file_name} uses RoPE scaling {scaling_type!r}; supported: none, linear, yarn.")
