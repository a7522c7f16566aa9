"""The model shapes benchmarks build random models of, as HF config.json dicts
(`dflash_jax.config.parse_config` reads them): each target with a drafter of its form.

Qwen3-8B and its DFlash-b16 drafter (5 layers, block 16, target layers [1, 9, 17, 25, 33],
mask 151669); Qwen3-32B with a drafter of the same form at its sizes (target layers spread
from 1 to 61 as the 8B's from 1 to 33: config.default_target_layer_ids); SmolLM2-135M-Instruct
(Llama, tied head) with a drafter shaped like the shipped one
(dflash_jax/assets/smollm2-135m-drafter), the launch-bound end; and SMALL, the same structure
tiny, for CPU smoke tests (`--small`). A new architecture's shapes go here.
"""

from __future__ import annotations

import dataclasses

QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
    rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False,
)
QWEN3_8B_DRAFTER = dict(
    architectures=["DFlashDraftModel"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
    num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
    rope_theta=1e6, max_position_embeddings=40960, num_target_layers=36,
    dflash_config=dict(mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33], block_size=16),
)
QWEN3_32B = dict(QWEN3_8B, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64)
QWEN3_32B_DRAFTER = dict(
    QWEN3_8B_DRAFTER, hidden_size=5120, intermediate_size=25600, num_attention_heads=64, num_target_layers=64,
    dflash_config=dict(mask_token_id=151669, target_layer_ids=[1, 16, 31, 46, 61], block_size=16),
)
SMOLLM2_135M = dict(
    architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
    rope_theta=1e5, max_position_embeddings=8192, tie_word_embeddings=True,
)
SMOLLM2_135M_DRAFTER = dict(
    QWEN3_8B_DRAFTER, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=5,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
    max_position_embeddings=8192, num_target_layers=30,
    dflash_config=dict(mask_token_id=16, target_layer_ids=[1, 8, 14, 20, 27], block_size=16),
)
# Mixture-of-experts targets (issue 34): Qwen3-30B-A3B (128 experts, top 8, every layer
# sparse) and gpt-oss-20b (32 experts, top 4; sliding-window layers of 128 every other layer,
# attention sinks), with DFlash-1 drafters of the 8B drafter's form at their widths.
QWEN3_30B_A3B = dict(
    QWEN3_8B, architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
)
QWEN3_30B_A3B_DRAFTER = dict(
    QWEN3_8B_DRAFTER, hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
    num_target_layers=48, dflash_config=dict(mask_token_id=151669, target_layer_ids=[1, 12, 23, 34, 45], block_size=16),
)
# Its first 24 layers (half the bytes): a profile of the step's per-layer kernels fits 80 GB.
QWEN3_30B_A3B_HALF = dict(QWEN3_30B_A3B, num_hidden_layers=24)
QWEN3_30B_A3B_HALF_DRAFTER = dict(QWEN3_30B_A3B_DRAFTER, num_target_layers=24,
                                  dflash_config=dict(QWEN3_30B_A3B_DRAFTER["dflash_config"],
                                                     target_layer_ids=[1, 6, 11, 17, 22]))
GPT_OSS_20B = dict(
    architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880, intermediate_size=2880,
    num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
    num_experts_per_tok=4, sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12,
    rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False, attention_bias=True,
    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                         original_max_position_embeddings=4096, truncate=False),
)
GPT_OSS_20B_DRAFTER = dict(
    QWEN3_8B_DRAFTER, vocab_size=201088, hidden_size=2880, intermediate_size=7680, num_attention_heads=64,
    num_key_value_heads=8, head_dim=64, num_target_layers=24,
    dflash_config=dict(mask_token_id=200017, target_layer_ids=[1, 6, 11, 16, 21], block_size=16),
)
# Qwen3.5-9B (issue 35): 32 layers, every 4th a gated attention layer (16 heads of 256, 4 kv
# heads, a quarter of each head rotated), the rest gated-delta-net layers (16 q/k heads and 32
# v heads of 128); transformers' Qwen3_5TextConfig defaults, which third-party reports of the
# 9B checkpoint match. A DFlash-1 drafter of the 8B drafter's form at its vocabulary.
QWEN3_5_9B = dict(
    architectures=["Qwen3_5ForCausalLM"], vocab_size=248320, hidden_size=4096, intermediate_size=12288,
    num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    max_position_embeddings=262144, tie_word_embeddings=False, linear_conv_kernel_dim=4, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
)
QWEN3_5_9B_DRAFTER = dict(
    QWEN3_8B_DRAFTER, vocab_size=248320, num_target_layers=32, max_position_embeddings=262144,
    dflash_config=dict(mask_token_id=248319, target_layer_ids=[1, 8, 15, 22, 29], block_size=16),
)
# DFlash 2 (issue 33): the 8B drafter with convolutions and a candidate selector, at the sizes
# of the published DFlash 2 recipes (kernel 4, top 16 candidates, rank 256).
QWEN3_8B_DFLASH2_DRAFTER = dict(
    QWEN3_8B_DRAFTER, architectures=["DFlash2DraftModel"],
    dflash_config=dict(QWEN3_8B_DRAFTER["dflash_config"], conv_kernel_size=4, conv_group_size=64, selector_rank=256,
                       selector_top_k=16),
)
# The SmolLM2 DFlash 2 drafter's form (bench.pipelines.smollm2_drafter --dflash2 4,64,64,16).
SMOLLM2_135M_DFLASH2_DRAFTER = dict(
    SMOLLM2_135M_DRAFTER, architectures=["DFlash2DraftModel"],
    dflash_config=dict(SMOLLM2_135M_DRAFTER["dflash_config"], conv_kernel_size=4, conv_group_size=64, selector_rank=64,
                       selector_top_k=16),
)
SMALL = dict(QWEN3_8B, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
SMALL_DRAFTER = dict(
    QWEN3_8B_DRAFTER, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, num_target_layers=4,
    dflash_config=dict(mask_token_id=1023, target_layer_ids=[1, 2], block_size=16),
)
SMALL_DFLASH2_DRAFTER = dict(
    SMALL_DRAFTER, architectures=["DFlash2DraftModel"],
    dflash_config=dict(SMALL_DRAFTER["dflash_config"], conv_kernel_size=4, conv_group_size=64, selector_rank=32,
                       selector_top_k=8),
)
SMALL_QWEN3_5 = dict(
    QWEN3_5_9B, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
)
SMALL_MOE = dict(SMALL, architectures=["Qwen3MoeForCausalLM"], moe_intermediate_size=128, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=True)


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """A target's shape and its drafter's; `title` names them in reports."""

    title: str
    target: dict
    drafter: dict


MODELS = {
    "qwen3-8b": ModelShapes("Qwen3-8B shape", QWEN3_8B, QWEN3_8B_DRAFTER),
    "qwen3-8b-dflash2": ModelShapes("Qwen3-8B shape, DFlash 2 drafter", QWEN3_8B, QWEN3_8B_DFLASH2_DRAFTER),
    "qwen3-32b": ModelShapes("Qwen3-32B shape", QWEN3_32B, QWEN3_32B_DRAFTER),
    "smollm2-135m": ModelShapes("SmolLM2-135M shape", SMOLLM2_135M, SMOLLM2_135M_DRAFTER),
    "smollm2-135m-dflash2": ModelShapes("SmolLM2-135M shape, DFlash 2 drafter", SMOLLM2_135M, SMOLLM2_135M_DFLASH2_DRAFTER),
    "qwen3-30b-a3b": ModelShapes("Qwen3-30B-A3B shape", QWEN3_30B_A3B, QWEN3_30B_A3B_DRAFTER),
    "qwen3-30b-a3b-24-layers": ModelShapes("Qwen3-30B-A3B shape, 24 of its 48 layers", QWEN3_30B_A3B_HALF,
                                           QWEN3_30B_A3B_HALF_DRAFTER),
    "gpt-oss-20b": ModelShapes("gpt-oss-20b shape", GPT_OSS_20B, GPT_OSS_20B_DRAFTER),
    "small": ModelShapes("small CPU shapes", SMALL, SMALL_DRAFTER),
    "small-dflash2": ModelShapes("small CPU shapes, DFlash 2 drafter", SMALL, SMALL_DFLASH2_DRAFTER),
    "qwen3_5-9b": ModelShapes("Qwen3.5-9B shape", QWEN3_5_9B, QWEN3_5_9B_DRAFTER),
    "small-qwen3_5": ModelShapes("small CPU shapes, a hybrid target", SMALL_QWEN3_5, SMALL_DRAFTER),
    "small-moe": ModelShapes("small CPU shapes, routed experts", SMALL_MOE, SMALL_DRAFTER),
}
