"""The model configs' types: frozen dataclasses that everything past parsing reads
(`config.py` parses and validates them from HF `config.json`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_jax.quantization import WeightQuantization
from pallas_kernels.attention_mask import CAUSAL, LayerAttention


class ConfigError(ValueError):
    """A config.json the project cannot use; the message says what and what to do."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Neox-style RoPE parameters; `scaling` holds the HF scaling dict minus type/theta."""

    theta: float
    rope_type: str = "default"
    scaling: tuple[tuple[str, Any], ...] = ()

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.scaling).get(name, default)


@dataclasses.dataclass(frozen=True)
class ExpertsConfig:
    """Routed experts (Qwen3-MoE, gpt-oss): a router picks `top_k` of `num_experts` SwiGLU
    experts per token, their outputs summed with the router's probabilities (Qwen3-MoE's
    renormalised over the chosen ones when `norm_topk_prob`)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    layers: tuple[int, ...]  # the decoder layers whose feed-forward is routed experts (the rest dense)
    # gpt-oss: the router's top k logits softmaxed (not the softmax's top k), biases on the
    # router and the experts, gate and up columns interleaved, and a clamped SwiGLU
    # (gate * sigmoid(alpha * gate) * (up + 1), gate <= limit, |up| <= limit)
    softmax_after_top_k: bool = False
    bias: bool = False
    interleaved: bool = False
    swiglu_alpha: float | None = None  # None: silu(gate) * up
    swiglu_limit: float | None = None
    # Qwen3.5-MoE: a dense SwiGLU expert of this width every token takes, scaled by sigmoid of
    # its own gate (None: no shared expert)
    shared_intermediate_size: int | None = None


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Qwen3.5's linear-attention layers: q, k, v through a depthwise causal convolution of
    `conv_kernel_size` taps, then the gated delta rule over a [value heads, key dim, value
    dim] state per request; `num_key_heads` q/k heads shared by `num_value_heads` v heads."""

    conv_kernel_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    layers: tuple[int, ...]  # the decoder layers that are gated-delta-net layers (the rest attention)

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: [q | k | v]."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    quantization: WeightQuantization | None = None  # 8-bit decoder-layer weights (None: float)
    experts: ExpertsConfig | None = None  # routed experts in some layers (None: dense feed-forward only)
    attention_layers: tuple[LayerAttention, ...] = ()  # per layer (gpt-oss's windows); (): all causal
    attention_sinks: bool = False  # a learned logit per head in each softmax's denominator (gpt-oss)
    linear_attention: GatedDeltaNetConfig | None = None  # gated-delta-net layers (Qwen3.5); None: all attention
    attention_output_gate: bool = False  # attention's output times sigmoid of a gate projection (Qwen3.5)
    zero_centered_norms: bool = False  # checkpoints store norm weights w applied as 1 + w (Qwen3.5); held as 1 + w

    @property
    def kind(self) -> str:
        return "target"

    def layer_attention(self, layer: int) -> LayerAttention:
        """How layer `layer` attends: causal, with its window where it has one."""
        return self.attention_layers[layer] if self.attention_layers else CAUSAL

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The decoder layers that keep keys and values (all but gated-delta-net layers): the
        target's paged cache holds these, in order."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear_attention(i))

    def is_linear_attention(self, layer: int) -> bool:
        """Whether layer `layer` is a gated-delta-net layer rather than an attention layer."""
        return self.linear_attention is not None and layer in self.linear_attention.layers

    def layer_experts(self, layer: int) -> ExpertsConfig | None:
        """Layer `layer`'s routed experts, or None where its feed-forward is dense."""
        return self.experts if self.experts is not None and layer in self.experts.layers else None


@dataclasses.dataclass(frozen=True)
class DFlash2Config:
    """DFlash 2's additions to the drafter (z-lab's `dflash_config`): around every attention
    and MLP sublayer a causal convolution over the block's positions, `conv_kernel_size`
    taps, a base kernel per channel plus a kernel predicted from the hidden state per group of
    `conv_group_size` channels; and a candidate selector that walks the block through each
    position's `selector_top_k` best logits, scored with rank-`selector_rank` codebooks."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    attention_bias: bool
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    num_target_layers: int | None
    mask_token_id: int
    trained_block_size: int  # the DFlash block the drafter was trained with (verify and draft blocks are at most this)
    layers: tuple[LayerAttention, ...]
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    quantization: WeightQuantization | None = None  # 8-bit fc and layer weights (`convert --quantize`)
    dflash2: DFlash2Config | None = None  # DFlash 2's convolutions and candidate selector (None: DFlash-1)
    draft_vocab_size: int | None = None  # a head over this many target ids (speculators' d2t); None: the target's

    @property
    def kind(self) -> str:
        return "drafter"

    @property
    def fc_in_features(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden_size
