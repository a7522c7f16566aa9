"""The HF `config.json` a parsed config is written back as: what export and the GGUF reader
write, and what `config.parse_config` reads back to the same config (z-lab's DFlash-1 or
DFlash 2 layout for drafters)."""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_jax.config import ConfigError, DrafterConfig, TargetConfig, parse_drafter_config


def to_hf_config(cfg: TargetConfig | DrafterConfig) -> dict[str, Any]:
    """The HF `config.json` dict that parses back to `cfg` (z-lab's DFlash-1 or DFlash 2 layout
    for drafters)."""
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": cfg.rope.rope_type, "rope_theta": cfg.rope.theta, **dict(cfg.rope.scaling)},
        max_position_embeddings=cfg.max_position_embeddings,
        attention_bias=cfg.attention_bias,
    )
    if isinstance(cfg, TargetConfig):
        raw = dict(
            architectures=[cfg.architecture],
            model_type="qwen3" if cfg.qk_norm else "llama",
            tie_word_embeddings=cfg.tie_word_embeddings,
            mlp_bias=cfg.mlp_bias,
            **common,
        )
        if cfg.attention_sinks:  # gpt-oss
            moe, windows = cfg.experts, {layer.window for layer in cfg.attention_layers} - {None}
            raw.update(model_type="gpt_oss", num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                       swiglu_alpha=moe.swiglu_alpha, swiglu_limit=moe.swiglu_limit,
                       layer_types=["sliding_attention" if layer.window else "full_attention"
                                    for layer in cfg.attention_layers], sliding_window=max(windows, default=None))
        if cfg.linear_attention is not None:  # Qwen3.5, and its MoE variant below
            la = cfg.linear_attention
            raw.update(model_type="qwen3_5_moe_text" if cfg.experts else "qwen3_5_text", layer_types=[
                "linear_attention" if cfg.is_linear_attention(i) else "full_attention" for i in range(cfg.num_layers)],
                linear_conv_kernel_dim=la.conv_kernel_size, linear_num_key_heads=la.num_key_heads,
                linear_num_value_heads=la.num_value_heads, linear_key_head_dim=la.key_head_dim,
                linear_value_head_dim=la.value_head_dim)
        if cfg.experts is not None and cfg.linear_attention is not None:
            raw.update(num_experts=cfg.experts.num_experts, num_experts_per_tok=cfg.experts.top_k,
                       moe_intermediate_size=cfg.experts.intermediate_size,
                       shared_expert_intermediate_size=cfg.experts.shared_intermediate_size)
        elif cfg.experts is not None and not cfg.attention_sinks:
            moe = cfg.experts
            raw.update(model_type="qwen3_moe", num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                       moe_intermediate_size=moe.intermediate_size, norm_topk_prob=moe.norm_topk_prob,
                       decoder_sparse_step=1,
                       mlp_only_layers=[i for i in range(cfg.num_layers) if i not in moe.layers])
    else:
        raw = dict(architectures=["DFlash2DraftModel" if cfg.dflash2 else "DFlashDraftModel"], model_type="qwen3",
                   **common)
        raw["dflash_config"] = dict(
            mask_token_id=cfg.mask_token_id,
            target_layer_ids=list(cfg.target_layer_ids),
            target_hidden_size=cfg.target_hidden_size,
            block_size=cfg.trained_block_size,
            input_embedding_scale=cfg.input_embedding_scale,
            output_multiplier=cfg.output_multiplier,
            final_logit_softcapping=cfg.final_logit_softcapping,
            **(dataclasses.asdict(cfg.dflash2) if cfg.dflash2 else {}),
            **({"draft_vocab_size": cfg.draft_vocab_size} if cfg.draft_vocab_size else {}),
        )
        # z-lab's loader reads num_target_layers even when the ids are explicit.
        raw["num_target_layers"] = cfg.num_target_layers or max(cfg.target_layer_ids) + 1
        raw["layer_types"] = [
            "sliding_attention" if layer.window is not None else "full_attention" for layer in cfg.layers
        ]
        windows = {layer.window for layer in cfg.layers} - {None}
        if len(windows) > 1:
            raise ConfigError(f"layers use different windows {sorted(windows)}; HF configs hold one.")
        if windows:
            raw["sliding_window"] = windows.pop()
            raw["use_sliding_window"] = True  # transformers' Qwen3Config drops the window without it
            if not any(layer.causal for layer in cfg.layers):
                raw["dflash_config"].update(use_swa=True, swa_window_size=raw["sliding_window"])
        if parse_drafter_config(raw).layers != cfg.layers:
            raw["is_causal"] = cfg.layers[0].causal
        if parse_drafter_config(raw).layers != cfg.layers:
            raise ConfigError("these per-layer attention rules cannot be written as a HF config.")
    if cfg.quantization is not None:
        raw["quantization_config"] = cfg.quantization.to_config()
    return raw
