"""The DFlash block drafter (spec section 1) in Flax NNX; DFlash 2's parts in `dflash2.py`.

The drafter owns no embedding and no LM head: callers embed the block with the target's table
and unembed with the target's head. Context tokens contribute keys and values only, computed
once from `hidden_norm(fc(features))` for all layers in one fused projection
(`context_kv`); block tokens run through the layers and attend to [context | block] through an
`attend(layer_idx, heads)` callable that applies the layer's mask rule.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.config import DrafterConfig
from dflash_jax.kernels import REFERENCE, Kernels
from dflash_jax.layers import AttendFn, DecoderLayer, RMSNorm, converted_dot_general, dot_general, linear
from dflash_jax.models.dflash2 import CandidateSelector, DFlash2DecoderLayer
from dflash_jax.sharding import replicated
from pallas_kernels.quantized_matmul import quantized_matmul_reference


class Drafter(nnx.Module):
    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.mesh = None  # the jax.sharding.Mesh the parameters are placed on (`sharding.place_model`)
        self.fc = linear(cfg.fc_in_features, cfg.hidden_size, ("mlp", "embed"), use_bias=False, dtype=dtype, rngs=rngs,
                         quantization=cfg.quantization)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, axis_name="embed", dtype=dtype)
        if cfg.dflash2 is None:
            layer = functools.partial(DecoderLayer, cfg, qk_norm=True, mlp_bias=False)
        else:  # DFlash 2: convolutions around each sublayer, and the candidate selector
            layer = functools.partial(DFlash2DecoderLayer, cfg)
            self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.dflash2, dtype=dtype,
                                                        rngs=rngs)
        self.layers = nnx.List([layer(dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, axis_name="embed", dtype=dtype)
        if cfg.draft_vocab_size is not None:  # its own head over part of the vocabulary, and those tokens' ids
            self.draft_head = linear(cfg.hidden_size, cfg.draft_vocab_size, ("embed", None), use_bias=False,
                                     dtype=dtype, rngs=rngs)
            self.draft_to_target = nnx.Param(jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32))

    @property
    def dtype(self):
        return self.norm.weight[...].dtype

    def context_kv_weights(self) -> tuple:
        """The context K/V product's operands: every layer's K/V columns stacked side by side
        ([D, shards x layers x 2K/shards x H]: each shard's columns of every layer together),
        their scales where the drafter is quantized (else None) and biases (else None).
        Stacking copies the columns (XLA copies a column slice for a per-layer product just
        the same: bench/LESSONS.md), so a program that loops over cycles builds them once,
        before its loop, and hands them to `context_kv`. On a tensor-parallel mesh the stack
        is laid out per shard (`Attention.kv_weights`), so each shard computes its own kv
        heads."""
        weights = [layer.self_attn.kv_weights() for layer in self.layers]
        stacked = jnp.stack([kernel for kernel, _, _ in weights], axis=2).reshape(self.cfg.hidden_size, -1)
        scales = None
        if self.cfg.quantization is not None:
            scales = jnp.stack([scale for _, scale, _ in weights], axis=2)
            scales = scales.reshape(scales.shape[0], -1)
        bias = jnp.stack([bias for _, _, bias in weights], axis=1).reshape(-1) if self.cfg.attention_bias else None
        return stacked, scales, bias

    def context_kv(self, features_LF, positions_L, weights: tuple | None = None):
        """Context K/V of every layer from target features: one GEMM against the stacked
        `context_kv_weights` (`weights`, built here when None).

        Returns a list, per layer, of (k [L, K, H], v [L, K, H]), normed and rotated: exactly
        what the drafter's KV cache stores.
        """
        cfg = self.cfg
        ctx_LD = self.hidden_norm(replicated(self.fc(replicated(features_LF, self.mesh).astype(self.dtype)), self.mesh))
        stacked, scales, bias = self.context_kv_weights() if weights is None else weights
        shards = self.layers[0].self_attn.shards
        if scales is None:
            kv = dot_general(ctx_LD, stacked, (((1,), (0,)), ((), ())))
        else:
            kv = quantized_matmul_reference(ctx_LD, stacked, scales, cfg.quantization.block_in, converted_dot_general)
        if bias is not None:
            kv = kv + bias
        # [L, shards, layers, 2, K/shards, H]; no -1 in the shape: L is 0 before there is any context.
        kv = kv.reshape(ctx_LD.shape[0], shards, cfg.num_layers, 2, cfg.num_kv_heads // shards, cfg.head_dim)
        kv_heads = [jnp.swapaxes(kv[:, :, :, i], 1, 2).reshape(ctx_LD.shape[0], cfg.num_layers,
                                                                cfg.num_kv_heads, cfg.head_dim)
                    for i in (0, 1)]  # keys, values: [L, layers, K, H]
        return [
            layer.self_attn.finish_kv(kv_heads[0][:, i], kv_heads[1][:, i], positions_L)
            for i, layer in enumerate(self.layers)
        ]

    def __call__(self, block_embeds_BD, positions_B, attend: AttendFn, kernels: Kernels = REFERENCE,
                 block_size: int | None = None):
        """Block hidden states [B, D] after the final norm; `attend(i, heads)` per layer
        (`layers.AttendFn`); `kernels` (resolved) picks the norm's implementation. The rows are
        blocks of `block_size` consecutive rows (None: one block), which DFlash 2's
        convolutions keep apart."""
        x_BD, delta_BD = block_embeds_BD * jnp.asarray(self.cfg.input_embedding_scale, block_embeds_BD.dtype), None
        per_block = {} if self.cfg.dflash2 is None else {"block_size": block_size}
        for i, layer in enumerate(self.layers):
            x_BD, delta_BD = layer(x_BD, delta_BD, positions_B, functools.partial(attend, i), kernels, **per_block)
            x_BD, delta_BD = replicated(x_BD, self.mesh), replicated(delta_BD, self.mesh)
        return self.norm.add_norm(x_BD, delta_BD, kernels)[1]

    def logits(self, unembed: Callable[[jax.Array], jax.Array], h_BD):
        """float32 logits over the target's vocabulary, with the optional Gemma-style scalars:
        through the target's head, or through the drafter's own head over a reduced vocabulary,
        placed at those tokens' ids with -inf elsewhere (no other token is ever drafted)."""
        cap = self.cfg.final_logit_softcapping

        def scaled(logits):  # capped after the -inf fill, a token off the draft vocabulary would get -cap
            logits = logits * self.cfg.output_multiplier
            return logits if cap is None else jnp.tanh(logits / cap) * cap

        if self.cfg.draft_vocab_size is None:
            return scaled(unembed(h_BD))
        own = dot_general(h_BD.astype(self.dtype), self.draft_head.kernel[...], (((h_BD.ndim - 1,), (0,)), ((), ())),
                          preferred_element_type=jnp.float32)
        logits = jnp.full((*h_BD.shape[:-1], self.cfg.vocab_size), -jnp.inf, jnp.float32)
        return logits.at[..., self.draft_to_target[...]].set(scaled(own))
