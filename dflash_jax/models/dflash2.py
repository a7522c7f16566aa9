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

from dflash_jax import sampling
from dflash_jax.config import DFlash2Config
from dflash_jax.kernels import REFERENCE, Kernels
from dflash_jax.layers import DecoderLayer, apply_linear, linear
from dflash_jax.top_k import top_k


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
    """`DecoderLayer` with the convolutions around attention and MLP, over blocks of
    `block_size` consecutive rows (None: all the call's rows are one block)."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs):
        super().__init__(cfg, qk_norm=True, mlp_bias=False, dtype=dtype, rngs=rngs)
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, cfg.dflash2, dtype=dtype, rngs=rngs)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, cfg.dflash2, dtype=dtype, rngs=rngs)

    def __call__(self, x_TD, delta_TD, positions_T, attend, kernels: Kernels = REFERENCE, block_size=None):
        blocks = x_TD.shape[0] // (block_size or x_TD.shape[0])
        x_TD, h_TD = self.input_layernorm.add_norm(x_TD, delta_TD, kernels)
        h_BD, attention_kernel = self.attention_conv.prepare(_blocked(h_TD, blocks))
        a_TUH = attend(self.self_attn.project(h_BD.reshape(x_TD.shape), positions_T, kernels))
        attended = apply_linear(self.self_attn.o_proj, a_TUH.reshape(x_TD.shape[0], -1), kernels)
        attended = self.attention_conv.finish(_blocked(attended, blocks), attention_kernel).reshape(x_TD.shape)
        x_TD, h_TD = self.post_attention_layernorm.add_norm(x_TD, attended, kernels)
        h_BD, mlp_kernel = self.mlp_conv.prepare(_blocked(h_TD, blocks))
        out_TD = self.mlp(h_BD.reshape(x_TD.shape), kernels)
        return x_TD, self.mlp_conv.finish(_blocked(out_TD, blocks), mlp_kernel).reshape(x_TD.shape)


def _blocked(rows_TD, blocks: int):
    """[T, D] rows as [blocks, T / blocks, D]: each block's positions along the middle axis."""
    return rows_TD.reshape(blocks, -1, rows_TD.shape[-1])


class CandidateSelector(nnx.Module):
    """The codebooks [V, rank] and the hidden state's projection [D, rank]."""

    def __init__(self, hidden: int, vocab_size: int, dflash2: DFlash2Config, *, dtype, rngs: nnx.Rngs):
        self.top_k = dflash2.selector_top_k
        init = nnx.initializers.normal(0.02)
        self.predecessor_codebook = nnx.Param(init(rngs.params(), (vocab_size, dflash2.selector_rank), dtype))
        self.successor_codebook = nnx.Param(init(rngs.params(), (vocab_size, dflash2.selector_rank), dtype))
        self.hidden_projection = linear(hidden, dflash2.selector_rank, ("embed", None), use_bias=False, dtype=dtype,
                                        rngs=rngs)

    def candidates(self, logits_NV):
        """(float32 logits [..., K], token ids [..., K]) of each position's top-K candidates."""
        return top_k(logits_NV.astype(jnp.float32), self.top_k)

    def pairings(self, projected_NQ, previous_NA, candidates_NK):
        """float32 [..., A, K]: predecessor[previous a] * projected hidden . successor[candidate
        k] for every pair of A possible previous tokens and K candidates; `projected_NQ` is
        `hidden_projection` of the position's hidden state."""
        predecessors_NAQ = self.predecessor_codebook[...][previous_NA] * projected_NQ[..., None, :]
        return jnp.einsum("...aq,...kq->...ak", predecessors_NAQ,
                          self.successor_codebook[...][candidates_NK]).astype(jnp.float32)

    def scores(self, projected_NQ, previous_N, unary_NK, candidates_NK):
        """float32 [..., K]: each candidate's logit plus its pairing with the previous token."""
        return unary_NK + self.pairings(projected_NQ, previous_N[..., None], candidates_NK)[..., 0, :]

    def greedy_path(self, hidden_PD, logits_PV, anchor):
        """(the drafts [P], each position's candidates [P, top_k]) for the P positions after
        the anchor token `anchor` (the dense API's one block)."""
        drafts, candidates, _ = self.walk(hidden_PD[None], logits_PV[None], jnp.asarray(anchor, jnp.int32)[None])
        return drafts[0], candidates[0]

    def walk(self, hidden_RND, logits_RNV, anchors_R, temperature_R=None, seeds_R=None, positions_R=None):
        """Each row's drafts [R, N] through its positions' top-K candidates [R, N, K], one scan
        step per position, the chosen candidate becoming the next step's predecessor; and,
        where `temperature_R` is given, q [R, N, V]: the selector's distribution each draft
        was drawn from (softmax of the scores over temperature, zero outside the candidates;
        one-hot where the row is greedy), keyed (DRAFT_STREAM, the anchor's position
        `positions_R` + j) as `sampling.sample_drafts` keys its draws. Without it (greedy, or
        argmax drafts) every row takes its best-scored candidate and q is None."""
        unary_RNK, candidates_RNK = self.candidates(logits_RNV)
        # Every position's pairings with each candidate the position before may choose (the
        # anchor before the first) in one batched product: the walk itself only looks rows up.
        R, N, K = candidates_RNK.shape
        previous_RNK = jnp.concatenate([jnp.broadcast_to(anchors_R.astype(jnp.int32)[:, None, None], (R, 1, K)),
                                        candidates_RNK[:, :-1]], axis=1)
        pairings_RNKK = self.pairings(self.hidden_projection(hidden_RND), previous_RNK, candidates_RNK)
        sampled = temperature_R is not None

        def step(previous_R, inputs):
            unary_RK, candidates_RK, pairings_RKK, j = inputs
            scores_RK = unary_RK + jnp.take_along_axis(pairings_RKK, previous_R[:, None, None], axis=1)[:, 0]
            if not sampled:
                index_R, q_RK = jnp.argmax(scores_RK, axis=-1), None
            else:
                greedy_R = temperature_R[:, None] <= 0
                tempered_RK = sampling.scaled_logits(scores_RK, jnp.where(greedy_R[:, 0], 1.0, temperature_R))
                q_RK = jnp.where(greedy_R, jax.nn.one_hot(jnp.argmax(scores_RK, axis=-1), self.top_k),
                                 jax.nn.softmax(tempered_RK, axis=-1))
                index_R = sampling.sample_tokens(q_RK, seeds_R, positions_R + j, sampling.DRAFT_STREAM)
            return index_R, (jnp.take_along_axis(candidates_RK, index_R[:, None], axis=-1)[:, 0], q_RK)

        steps = (jnp.swapaxes(unary_RNK, 0, 1), jnp.swapaxes(candidates_RNK, 0, 1), jnp.swapaxes(pairings_RNKK, 0, 1),
                 jnp.arange(N, dtype=jnp.int32))
        # the previous choice's index among its candidates (0 before the first: every row of
        # the first position's pairings is the anchor's); unrolled, the tiny steps fuse
        _, (drafts_NR, q_NRK) = jax.lax.scan(step, jnp.zeros(R, jnp.int32), steps, unroll=True)  # q: None unless sampled
        if not sampled:
            return drafts_NR.T, candidates_RNK, None
        q_RNV = jnp.zeros(logits_RNV.shape, jnp.float32).at[
            jnp.arange(R)[:, None, None], jnp.arange(N)[None, :, None], candidates_RNK].set(jnp.swapaxes(q_NRK, 0, 1))
        return drafts_NR.T, candidates_RNK, q_RNV
