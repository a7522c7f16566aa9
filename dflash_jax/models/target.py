"""The target model: Qwen3 (q/k norm), Qwen3-MoE (routed experts in some layers), gpt-oss
(attention sinks, windowed layers, routed experts), Llama (llama3 RoPE, tied embeddings) and
Qwen3.5 (gated-delta-net layers among gated attention layers with partial RoPE) in Flax NNX.

One class covers them all: they differ in the per-head q/k RMSNorm, the attention sinks, each
layer's attention rule and feed-forward (`TargetConfig.layer_attention`, `layer_experts`: dense
or routed experts) and config values.
Attention is delegated to an `attend(layer_idx, heads)` callable (`layers.AttendFn`) so that
the dense path and the paged runtime share these layers; a layer never sees a cache. A
gated-delta-net layer hands the same callable its `RecurrentInputs` and never sees a state.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax.numpy as jnp
from flax import nnx

from dflash_jax.config import TargetConfig
from dflash_jax.experts import RoutedExperts
from dflash_jax.kernels import REFERENCE, Kernels
from dflash_jax.layers import AttendFn, DecoderLayer, RMSNorm, dot_general, linear, logical
from dflash_jax.models.gated_delta_net import GatedDeltaNetLayer
from dflash_jax.sharding import replicated


class DerivedWeight(nnx.Variable):
    """A weight computed from the parameters when a model is loaded; never saved (checkpoints
    keep `nnx.Param`s only)."""


class Target(nnx.Module):
    """Token ids + positions -> final hidden states, plus chosen decoder-layer outputs."""

    def __init__(self, cfg: TargetConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.mesh = None  # the jax.sharding.Mesh the parameters are placed on (`sharding.place_model`)
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=dtype,
            param_dtype=dtype,
            embedding_init=logical(nnx.initializers.normal(0.02), ("vocab", "embed")),
            rngs=rngs,
        )
        def feed_forward(layer: int):  # None: the dense SwiGLU
            experts = cfg.layer_experts(layer)
            return None if experts is None else RoutedExperts(cfg.hidden_size, experts, dtype=dtype, rngs=rngs,
                                                              quantization=cfg.quantization)

        def layer(i: int):
            if cfg.is_linear_attention(i):
                return GatedDeltaNetLayer(cfg, dtype=dtype, rngs=rngs, mlp=feed_forward(i))
            return DecoderLayer(cfg, qk_norm=cfg.qk_norm, mlp_bias=cfg.mlp_bias, dtype=dtype, rngs=rngs,
                                mlp=feed_forward(i), sinks=cfg.attention_sinks)

        self.layers = nnx.List([layer(i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, axis_name="embed", dtype=dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), use_bias=False, dtype=dtype, rngs=rngs)

    @property
    def dtype(self):
        return self.embed_tokens.embedding[...].dtype

    def transpose_tied_head(self) -> None:
        """Give a tied float32 model's LM head its own [D, V] copy of the embedding table.

        XLA CPU multiplies a few float32 rows by the [V, D] table transposed more slowly than
        by a [D, V] copy, and a DFlash cycle pays it twice (verify and draft heads); in
        bfloat16 the [V, D] table is the faster one: no copy (bench/LESSONS.md). `load_target`
        calls this on CPU backends."""
        if self.cfg.tie_word_embeddings and self.dtype == jnp.float32:
            self.use_head_weight(jnp.transpose(self.embed_tokens.embedding[...]))

    def use_head_weight(self, weight_DV) -> None:
        """Unembed with `weight_DV` [D, V] instead of the tied table or `lm_head`: a derived
        weight, never saved (a tied head's transposed copy; a benchmark's rounded head)."""
        self.head_DV = DerivedWeight(weight_DV)

    def embed(self, token_ids_T):
        return self.embed_tokens(token_ids_T)

    def unembed(self, h_TD):
        """float32 logits [T, V] from final-normed hidden states (tied or separate head)."""
        if hasattr(self, "head_DV"):
            w, contract = self.head_DV[...], 0
        elif self.cfg.tie_word_embeddings:
            w, contract = self.embed_tokens.embedding[...], 1
        else:
            w, contract = self.lm_head.kernel[...], 0
        return dot_general(h_TD, w, (((1,), (contract,)), ((), ())), preferred_element_type=jnp.float32)

    def __call__(self, token_ids_T, positions_T, attend: AttendFn, *, layer_ids: Sequence[int] = (),
                 kernels: Kernels = REFERENCE):
        """Returns (final-normed hidden [T, D], outputs of `layer_ids` concatenated [T, n*D]);
        `kernels` (resolved) picks the norm's implementation. The last layer's output is taken
        after the final norm, as transformers' `hidden_states[num_layers]` (which z-lab's
        drafters are trained on) is."""
        x_TD, delta_TD = self.embed(token_ids_T), None
        wanted = {layer_id: None for layer_id in layer_ids}
        for i, layer in enumerate(self.layers):
            x_TD, delta_TD = layer(x_TD, delta_TD, positions_T, functools.partial(attend, i), kernels)
            x_TD, delta_TD = replicated(x_TD, self.mesh), replicated(delta_TD, self.mesh)
            if i in wanted:  # the layer's output (this sum fuses into the concatenation below)
                wanted[i] = x_TD + delta_TD
        hidden_TD = self.norm.add_norm(x_TD, delta_TD, kernels)[1]
        if len(self.layers) - 1 in wanted:
            wanted[len(self.layers) - 1] = hidden_TD
        features = [wanted[layer_id] for layer_id in layer_ids]
        features_TF = jnp.concatenate(features, axis=-1) if features else x_TD[:, :0]
        return hidden_TD, features_TF
