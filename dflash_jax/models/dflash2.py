"""DFlash 2's parts of the drafter (`DrafterConfig.dflash2`), in Flax NNX: the grouped dynamic
causal convolution around each sublayer and the candidate selector.

The convolution runs along the block's positions and never across blocks: position t mixes
positions t, t - 1, ... of its own block (zeros before the block's first), with per channel a
base kernel plus a kernel predicted from the sublayer's normed input, shared by groups of
channels. The selector walks the block from its anchor: at each position it scores that
position's top-K drafter logits by logit plus a low-rank term pairing the previous token
(predecessor codebook, scaled by the hidden state) with the candidate (successor codebook),
and takes the best (greedy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.config import DFlash2Config
from dflash_jax.kernels import REFERENCE, Kernels
from dflash_jax.layers import DecoderLayer, apply_linear, linear


def grouped_causal_convolve(h_BD, dynamic_BKG, base_KD, group_size: int):
    """sum over taps o of (base[o] + dynamic[t, o] per group) * h[t - o], h zero before the
    block: h [..., B, D], dynamic [..., B, taps, groups], base [taps, D]."""
    *lead, B, D = h_BD.shape
    taps, groups = base_KD.shape[0], D // group_size
    blocks = h_BD.reshape(*lead, B, groups, group_size)
    pad = [(0, 0)] * len(lead) + [(taps, 0), (0, 0), (0, 0)]
    padded = jnp.pad(blocks, pad)
    out = jnp.zeros_like(blocks)
    for offset in range(taps):
        shifted = padded[..., taps - offset: taps - offset + B, :, :]
        out = out + base_KD[offset].reshape(groups, group_size).astype(h_BD.dtype) * shifted
        out = out + dynamic_BKG[..., offset, :, None] * shifted
    return out.reshape(h_BD.shape)


class GroupedDynamicConv(nnx.Module):
    """One sublayer's convolutions: `prepare` convolves its input (kernel 0) and predicts the
    kernel `finish` convolves its output with (kernel 1), both from the normed input."""

    def __init__(self, hidden: int, dflash2: DFlash2Config, *, dtype, rngs: nnx.Rngs):
        self.taps, self.group_size = dflash2.conv_kernel_size, dflash2.conv_group_size
        groups = hidden // self.group_size
        self.base_kernel = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (2, self.taps, hidden), dtype))
        self.kernel_projection = linear(hidden, 2 * self.taps * groups, ("embed", None), use_bias=False, dtype=dtype,
                                        rngs=rngs)

    def prepare(self, h_BD):
        dynamic = self.kernel_projection(h_BD).reshape(*h_BD.shape[:-1], 2, self.taps, -1)
        base = self.base_kernel[...]
        return grouped_causal_convolve(h_BD, dynamic[..., 0, :, :], base[0], self.group_size), dynamic[..., 1, :, :]

    def finish(self, out_BD, dynamic_BKG):
        return grouped_causal_convolve(out_BD, dynamic_BKG, self.base_kernel[...][1], self.group_size)


class DFlash2DecoderLayer(DecoderLayer):
    """`DecoderLayer` with the convolutions around attention and MLP. The rows of one call are
    one block (the dense API's draft block)."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, qk_norm=True, mlp_bias=False, dtype=dtype, rngs=rngs)
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, cfg.dflash2, dtype=dtype, rngs=rngs)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, cfg.dflash2, dtype=dtype, rngs=rngs)

    def __call__(self, x_TD, delta_TD, positions_T, attend, kernels: Kernels = REFERENCE):
        x_TD, h_TD = self.input_layernorm.add_norm(x_TD, delta_TD, kernels)
        h_TD, attention_kernel = self.attention_conv.prepare(h_TD)
        a_TUH = attend(self.self_attn.project(h_TD, positions_T, kernels))
        attended = apply_linear(self.self_attn.o_proj, a_TUH.reshape(x_TD.shape[0], -1), kernels)
        x_TD, h_TD = self.post_attention_layernorm.add_norm(
            x_TD, self.attention_conv.finish(attended, attention_kernel), kernels)
        h_TD, mlp_kernel = self.mlp_conv.prepare(h_TD)
        return x_TD, self.mlp_conv.finish(self.mlp(h_TD, kernels), mlp_kernel)


class CandidateSelector(nnx.Module):
    """The codebooks [V, rank] and the hidden state's projection [D, rank]."""

    def __init__(self, hidden: int, vocab_size: int, dflash2: DFlash2Config, *, dtype, rngs: nnx.Rngs):
        self.top_k = dflash2.selector_top_k
        init = nnx.initializers.normal(0.02)
        self.predecessor_codebook = nnx.Param(init(rngs.params(), (vocab_size, dflash2.selector_rank), dtype))
        self.successor_codebook = nnx.Param(init(rngs.params(), (vocab_size, dflash2.selector_rank), dtype))
        self.hidden_projection = linear(hidden, dflash2.selector_rank, ("embed", None), use_bias=False, dtype=dtype,
                                        rngs=rngs)

    def greedy_path(self, hidden_PD, logits_PV, anchor):
        """(the drafts [P], each position's candidates [P, top_k]) for the P positions after
        the anchor token `anchor`: one scan step per position, the best-scored candidate
        becoming the next step's predecessor."""
        unary_PK, candidates_PK = jax.lax.top_k(logits_PV, self.top_k)
        h_PR = self.hidden_projection(hidden_PD)
        predecessors, successors = self.predecessor_codebook[...], self.successor_codebook[...]

        def step(previous, inputs):
            unary_K, candidates_K, h_R = inputs
            pairing = (predecessors[previous] * h_R) @ successors[candidates_K].T
            chosen = candidates_K[jnp.argmax(unary_K + pairing.astype(unary_K.dtype))]
            return chosen, chosen

        _, drafts_P = jax.lax.scan(step, jnp.asarray(anchor, jnp.int32), (unary_PK, candidates_PK, h_PR))
        return drafts_P, candidates_PK
