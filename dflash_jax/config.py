"""Model configs (`config_types`' frozen dataclasses) parsed and validated from HF `config.json`.

Everything the models and the runtime need is resolved here, once, so that the rest of the
code never looks at a raw dict: RoPE parameters (`rope_parameters` or the older
`rope_theta` + `rope_scaling`), the drafter's `dflash_config` fields wherever a checkpoint put
them, the per-layer attention rules (causal or not, window or not) and the default target
layer ids. What the project cannot run is refused with one sentence saying why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_jax.config_types import (
    ConfigError, DFlash2Config, DrafterConfig, ExpertsConfig, GatedDeltaNetConfig, RopeConfig, TargetConfig,
)
from dflash_jax.quantization import QuantizationError, WeightQuantization, parse_quantization
from pallas_kernels.attention_mask import LayerAttention

TARGET_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM", "LlamaForCausalLM",
                        "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                        "Qwen3_5MoeForConditionalGeneration")
QWEN3_5_ARCHITECTURES = TARGET_ARCHITECTURES[4:]
VISION_LANGUAGE_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
DRAFTER_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Uniform from layer 1 to T-3 (spec section 3); the middle layer for one draft layer."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(
        round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)
    )


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; point at a folder with a HF config.json.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON ({err}); re-export the checkpoint.") from err


def parse_config(raw: dict[str, Any]) -> TargetConfig | DrafterConfig:
    """Target or drafter, chosen by `architectures`; a drafter in the speculators format too."""
    if "speculators_model_type" in raw:
        return parse_drafter_config(zlab_from_speculators(raw))
    architecture = _architecture(raw)
    if architecture in DRAFTER_ARCHITECTURES:
        return parse_drafter_config(raw)
    return parse_target_config(raw)


def parse_target_config(raw: dict[str, Any]) -> TargetConfig:
    architecture = _architecture(raw)
    if architecture not in TARGET_ARCHITECTURES:
        raise ConfigError(
            f"unsupported target architecture {architecture!r}; supported targets are "
            f"{', '.join(TARGET_ARCHITECTURES)}."
        )
    if architecture in VISION_LANGUAGE_ARCHITECTURES:  # a vision-language checkpoint: its text model
        text = raw.get("text_config", {})
        raw = {**text, "architectures": [architecture],
               "tie_word_embeddings": raw.get("tie_word_embeddings", text.get("tie_word_embeddings")),
               "quantization_config": raw.get("quantization_config", text.get("quantization_config"))}
    qwen3_5 = architecture in QWEN3_5_ARCHITECTURES
    is_qwen3 = architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") or qwen3_5
    if is_qwen3 and raw.get("use_sliding_window"):
        raise ConfigError(
            "Qwen3 targets with use_sliding_window=true are not supported; "
            "set it to false in config.json if the model was trained without it."
        )
    num_layers = _required(raw, "num_hidden_layers")
    gpt_oss = architecture == "GptOssForCausalLM"
    experts = _experts(raw, num_layers, gpt_oss) if architecture != "LlamaForCausalLM" else None
    quantization = _quantization(raw)
    if quantization is not None and quantization.hf_scale is not None and gpt_oss:
        quantization = None  # gpt-oss's stacked experts have no published 8-bit form here: read dequantized
    if raw.get("hidden_act", "silu") != "silu" and not gpt_oss:
        raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported; only 'silu' is.")
    heads = _required(raw, "num_attention_heads")
    hidden = _required(raw, "hidden_size")
    return TargetConfig(
        architecture=architecture,
        vocab_size=_required(raw, "vocab_size"),
        hidden_size=hidden,
        # a model whose every layer is sparse (Qwen3.5-MoE) may give no dense width: none is used
        intermediate_size=_required(raw, "intermediate_size") if experts is None or len(experts.layers) < num_layers
        else raw.get("intermediate_size", experts.intermediate_size),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(raw, default_theta=15e4 if gpt_oss else 1e6 if is_qwen3 else 1e4),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", gpt_oss)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=is_qwen3,
        quantization=quantization,
        experts=experts,
        attention_layers=_target_layer_attention(raw, num_layers) if gpt_oss else (),
        attention_sinks=gpt_oss,
        linear_attention=_gated_delta_net(raw, num_layers) if qwen3_5 else None,
        attention_output_gate=qwen3_5,
        zero_centered_norms=qwen3_5,
    )


def _gated_delta_net(raw: dict[str, Any], num_layers: int) -> GatedDeltaNetConfig:
    """Qwen3.5's `layer_types` (linear_attention / full_attention; by default every 4th layer
    full) and its linear-attention shapes."""
    layer_types = raw.get("layer_types") or [
        "full_attention" if (i + 1) % raw.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(num_layers)]
    if len(layer_types) != num_layers or set(layer_types) - {"full_attention", "linear_attention"}:
        raise ConfigError(f"layer_types must give linear_attention or full_attention for each of the {num_layers} "
                          f"layers, got {layer_types!r}.")
    shapes = {name: raw.get(name, default) for name, default in (
        ("linear_conv_kernel_dim", 4), ("linear_num_key_heads", 16), ("linear_num_value_heads", 32),
        ("linear_key_head_dim", 128), ("linear_value_head_dim", 128))}
    if shapes["linear_num_value_heads"] % shapes["linear_num_key_heads"]:
        raise ConfigError(f"linear_num_value_heads {shapes['linear_num_value_heads']} is not a multiple of "
                          f"linear_num_key_heads {shapes['linear_num_key_heads']}; the checkpoint's config is damaged.")
    return GatedDeltaNetConfig(*shapes.values(), layers=tuple(i for i, kind in enumerate(layer_types)
                                                              if kind == "linear_attention"))


def _target_layer_attention(raw: dict[str, Any], num_layers: int) -> tuple[LayerAttention, ...]:
    """Causal layers, the `sliding_attention` ones of `layer_types` windowed by `sliding_window`."""
    layer_types = raw.get("layer_types") or ["full_attention"] * num_layers
    if len(layer_types) != num_layers or set(layer_types) - {"full_attention", "sliding_attention"}:
        raise ConfigError(f"layer_types must give full_attention or sliding_attention for each of the {num_layers} "
                          f"layers, got {layer_types!r}.")
    return tuple(LayerAttention(causal=True, window=_positive_window(raw, "sliding_window")
                                if kind == "sliding_attention" else None) for kind in layer_types)


def _experts(raw: dict[str, Any], num_layers: int, gpt_oss: bool) -> ExpertsConfig | None:
    """Routed experts. Qwen3-MoE: layer i is sparse unless listed in `mlp_only_layers`, when
    (i + 1) is a multiple of `decoder_sparse_step` (transformers' rule); gpt-oss: every layer,
    its router and SwiGLU as `ExpertsConfig` says. None without experts."""
    num_experts = raw.get("num_experts", raw.get("num_local_experts", 0))
    if not num_experts:
        return None
    top_k, step = raw.get("num_experts_per_tok"), raw.get("decoder_sparse_step", 1)
    if not (isinstance(top_k, int) and 1 <= top_k <= num_experts):
        raise ConfigError(f"num_experts_per_tok must be an integer in [1, num_experts = {num_experts}], "
                          f"got {top_k!r}; fix config.json.")
    if not (isinstance(step, int) and step >= 1):
        raise ConfigError(f"decoder_sparse_step must be a positive integer, got {step!r}; fix config.json.")
    if gpt_oss:
        return ExpertsConfig(num_experts=int(num_experts), top_k=top_k,
                             intermediate_size=_required(raw, "intermediate_size"), norm_topk_prob=False,
                             layers=tuple(range(num_layers)), softmax_after_top_k=True, bias=True, interleaved=True,
                             swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                             swiglu_limit=float(raw.get("swiglu_limit", 7.0)))
    dense = set(raw.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    shared = raw.get("shared_expert_intermediate_size")  # Qwen3.5-MoE, whose router always renormalises
    return ExpertsConfig(num_experts=int(num_experts), top_k=top_k,
                         intermediate_size=_required(raw, "moe_intermediate_size"),
                         norm_topk_prob=bool(raw.get("norm_topk_prob", shared is not None)), layers=layers,
                         shared_intermediate_size=shared)


def _quantization(raw: dict[str, Any]) -> WeightQuantization | None:
    try:
        return parse_quantization(raw.get("quantization_config"))
    except QuantizationError as err:
        raise ConfigError(str(err)) from None


SPECULATORS_DRAFTERS = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}


def zlab_from_speculators(raw: dict[str, Any]) -> dict[str, Any]:
    """A speculators-format drafter config (what vLLM reads) as z-lab's: the draft layers' HF
    config is `transformer_layer_config`; the target layers are `aux_hidden_state_layer_ids`,
    z-lab's ids + 1 (they count the embedding output as hidden state 0); DFlash 2's fields sit
    at the top level; `draft_vocab_size` below the target's means a reduced draft head."""
    kind = raw["speculators_model_type"]
    if kind not in SPECULATORS_DRAFTERS:
        raise ConfigError(f"speculators_model_type {kind!r} is not a DFlash drafter; dflash-jax reads "
                          f"{' and '.join(map(repr, SPECULATORS_DRAFTERS))} speculators checkpoints.")
    layers, aux = raw.get("transformer_layer_config"), raw.get("aux_hidden_state_layer_ids")
    if not isinstance(layers, dict):
        raise ConfigError("a speculators drafter config needs transformer_layer_config, the draft layers' HF config.")
    if not aux or not all(isinstance(i, int) and i >= 1 for i in aux):
        raise ConfigError(f"aux_hidden_state_layer_ids must list target hidden states from 1 up, got {aux!r}.")
    if raw.get("mask_token_id") is None:
        raise ConfigError("a speculators DFlash config needs mask_token_id, the token of the block's masked slots.")
    dflash = {"target_layer_ids": [i - 1 for i in aux], "mask_token_id": raw["mask_token_id"],
              "block_size": raw.get("block_size", 16)}
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "target_hidden_size",
                 "input_embedding_scale", "output_multiplier", "final_logit_softcapping", "sample_from_anchor"):
        if raw.get(name) is not None:
            dflash[name] = raw[name]
    if raw.get("sliding_window_non_causal"):
        dflash["causal"] = False
    draft_vocab = raw.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != layers.get("vocab_size"):
        dflash["draft_vocab_size"] = draft_vocab
    config = {k: v for k, v in layers.items() if k not in ("architectures", "model_type", "auto_map", "dflash_config")}
    return {**config, "architectures": [SPECULATORS_DRAFTERS[kind]], "dflash_config": dflash}


def parse_drafter_config(raw: dict[str, Any]) -> DrafterConfig:
    architecture = _architecture(raw)
    if architecture not in DRAFTER_ARCHITECTURES:
        raise ConfigError(
            f"unsupported drafter architecture {architecture!r}; expected one of {', '.join(DRAFTER_ARCHITECTURES)}."
        )
    quantization = _quantization(raw)
    if quantization is not None and quantization.hf_scale is not None:
        raise ConfigError("published quantized drafters are not supported; give the drafter's float checkpoint "
                          "(`convert --quantize` makes an 8-bit one).")
    if quantization is not None and architecture == "DFlash2DraftModel":
        raise ConfigError("8-bit DFlash 2 drafters are not supported yet; use the float checkpoint.")
    dflash = raw.get("dflash_config") or {}

    def field(name: str, default: Any = None) -> Any:
        """dflash_config first, then the top level (checkpoints put fields in either)."""
        value = dflash.get(name)
        return raw.get(name, default) if value is None else value

    if field("sample_from_anchor", False):
        raise ConfigError(
            "sample_from_anchor=true is the DSpark variant, not DFlash; "
            "use a drafter trained without it."
        )
    if field("attention_sink_bias", False) or raw.get("add_swa_attention_sink_bias", False):
        raise ConfigError(
            "this drafter has attention sinks (attention_sink_bias: a learned logit per head, as "
            "Model-Optimizer exports write); dflash-jax's drafter attention has none yet: use a drafter "
            "without them (z-lab's gpt-oss drafters have none)."
        )
    num_layers = _required(raw, "num_hidden_layers")
    num_target_layers = field("num_target_layers")
    target_layer_ids = field("target_layer_ids")
    if target_layer_ids is None:
        if num_target_layers is None:
            raise ConfigError(
                "the drafter config has neither target_layer_ids nor num_target_layers; "
                "add one of them to dflash_config."
            )
        target_layer_ids = default_target_layer_ids(int(num_target_layers), num_layers)
    mask_token_id = field("mask_token_id")
    if mask_token_id is None:
        raise ConfigError("the drafter config has no mask_token_id; add it to dflash_config.")
    vocab_size = _required(raw, "vocab_size")
    if not 0 <= int(mask_token_id) < vocab_size:
        raise ConfigError(
            f"mask_token_id {mask_token_id} is outside the vocabulary (size {vocab_size})."
        )
    hidden = _required(raw, "hidden_size")
    heads = _required(raw, "num_attention_heads")
    softcap = field("final_logit_softcapping")
    return DrafterConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=_required(raw, "intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(raw, default_theta=1e6),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        attention_bias=bool(raw.get("attention_bias", False)),
        target_layer_ids=tuple(int(i) for i in target_layer_ids),
        target_hidden_size=int(field("target_hidden_size", hidden)),
        num_target_layers=None if num_target_layers is None else int(num_target_layers),
        mask_token_id=int(mask_token_id),
        trained_block_size=int(field("block_size", 16)),
        layers=_drafter_layer_attention(raw, dflash, num_layers),
        input_embedding_scale=float(field("input_embedding_scale", 1.0)),
        output_multiplier=float(field("output_multiplier", 1.0)),
        final_logit_softcapping=None if softcap is None or float(softcap) <= 0 else float(softcap),
        quantization=quantization,
        dflash2=parse_dflash2(field, hidden, vocab_size) if architecture == "DFlash2DraftModel" else None,
        draft_vocab_size=_draft_vocab_size(field("draft_vocab_size"), vocab_size, architecture),
    )


def _draft_vocab_size(value, vocab_size: int, architecture: str) -> int | None:
    """A reduced draft vocabulary's size, or None for the target's whole vocabulary."""
    if value is None or value == vocab_size:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < vocab_size:
        raise ConfigError(f"draft_vocab_size {value!r} must be a positive integer below the vocabulary ({vocab_size}).")
    if architecture == "DFlash2DraftModel":
        raise ConfigError(f"this DFlash 2 drafter has a reduced draft vocabulary ({value} of {vocab_size}); DFlash 2 "
                          "keeps the full vocabulary, which its selector's codebooks index: use a full-vocabulary "
                          "checkpoint.")
    return value


def parse_dflash2(field, hidden: int, vocab_size: int) -> DFlash2Config:
    """DFlash 2's four dflash_config fields (`field(name)` gives each), each a positive integer
    that fits the model."""
    values = {}
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        value = field(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"a DFlash2DraftModel needs dflash_config.{name}, a positive integer; got {value!r}.")
        values[name] = value
    if hidden % values["conv_group_size"]:
        raise ConfigError(f"conv_group_size {values['conv_group_size']} does not divide the hidden size {hidden}; "
                          "the convolution's dynamic kernels are shared by groups of that many channels.")
    if values["selector_top_k"] > vocab_size:
        raise ConfigError(f"selector_top_k {values['selector_top_k']} exceeds the vocabulary ({vocab_size} tokens).")
    return DFlash2Config(**values)


def _drafter_layer_attention(
    raw: dict[str, Any], dflash: dict[str, Any], num_layers: int
) -> tuple[LayerAttention, ...]:
    """Spec section 2: full layers non-causal, sliding layers causal and windowed.

    Overrides: top-level `is_causal`, else `dflash_config.causal`, sets causality for all
    layers; `dflash_config.use_swa` windows every layer by `swa_window_size`, non-causal
    unless one of the causality overrides says otherwise.
    """
    layer_types = raw.get("layer_types") or ["full_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise ConfigError(
            f"layer_types has {len(layer_types)} entries for {num_layers} layers; "
            "give one type per layer."
        )
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ConfigError(f"unknown layer_types {sorted(unknown)}; expected full/sliding_attention.")
    use_swa = bool(dflash.get("use_swa", False))
    causal_override = raw.get("is_causal")
    if causal_override is None:
        causal_override = dflash.get("causal")
    layers = []
    for layer_type in layer_types:
        sliding = layer_type == "sliding_attention"
        if use_swa:
            window, causal = _positive_window(dflash, "swa_window_size"), False
        elif sliding:
            window, causal = _positive_window(raw, "sliding_window"), True
        else:
            window, causal = None, False
        if causal_override is not None:
            causal = bool(causal_override)
        layers.append(LayerAttention(causal=causal, window=window))
    return tuple(layers)


def _positive_window(raw: dict[str, Any], name: str) -> int:
    window = raw.get(name)
    if not isinstance(window, int) or window < 1:
        raise ConfigError(f"{name} must be a positive integer for windowed layers, got {window!r}.")
    return window


def parse_rope(raw: dict[str, Any], *, default_theta: float) -> RopeConfig:
    """`rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older files)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.pop("rope_theta", raw.get("rope_theta", default_theta))
    rope_type = merged.pop("rope_type", merged.pop("type", "default"))
    for name in ("mrope_section", "mrope_interleaved"):  # text positions are equal on all three axes: plain RoPE
        merged.pop(name, None)
    if raw.get("partial_rotary_factor") is not None:
        merged.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"RoPE type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    if rope_type == "yarn" and "original_max_position_embeddings" not in merged:
        merged["original_max_position_embeddings"] = raw.get("max_position_embeddings")
    return RopeConfig(theta=float(theta), rope_type=rope_type, scaling=tuple(sorted(merged.items())))


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    if len(architectures) != 1:
        raise ConfigError(
            f"config.json must name exactly one architecture, got {architectures!r}; "
            "set architectures to e.g. ['Qwen3ForCausalLM'] or ['DFlashDraftModel']."
        )
    return architectures[0]


def _required(raw: dict[str, Any], name: str) -> int:
    if name not in raw:
        raise ConfigError(f"config.json has no {name!r}; the checkpoint's config is incomplete.")
    return int(raw[name])


def check_drafter_fits_target(target: TargetConfig, drafter: DrafterConfig) -> None:
    """Refuse a drafter trained for another target: the failure would otherwise be silent."""
    bad_ids = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_layers]
    if bad_ids:
        raise ConfigError(
            f"the drafter reads target layers {bad_ids}, but the target has {target.num_layers} "
            "layers; pair the drafter with the target it was trained for."
        )
    if drafter.target_hidden_size != target.hidden_size:
        raise ConfigError(
            f"the drafter's fc takes {drafter.fc_in_features} inputs = "
            f"{len(drafter.target_layer_ids)} layers x {drafter.target_hidden_size}, but the "
            f"target's hidden size is {target.hidden_size}; pair the drafter with its own target."
        )
    if drafter.hidden_size != target.hidden_size:
        raise ConfigError(
            f"the drafter's hidden size {drafter.hidden_size} differs from the target's "
            f"{target.hidden_size}, whose embedding and LM head it shares; use a matching pair."
        )
    if drafter.mask_token_id >= target.vocab_size:
        raise ConfigError(
            f"the drafter's mask_token_id {drafter.mask_token_id} is outside the target's "
            f"vocabulary (size {target.vocab_size}); use a matching pair."
        )
