"""The verify block a mixture-of-experts target takes by default: the one whose cycle returns
the most tokens per unit of time, from a cost model of the cycle and the drafter's acceptance.

Cost. At decode and verify shapes a target pass is bound by what it reads (or, for many
tokens, by its products): the dense weights once, the LM head once, and each expert that some
token routes to. With `top_k` of E experts chosen per token, n tokens touch on average
E (1 - (1 - top_k / E)^n) of them (routing taken as uniform; real routers concentrate, which
only makes larger blocks cheaper). So a verify block of 16 tokens reads far more of a MoE
layer than one decode token does, while on a dense target it reads what a step reads. The
pass's time (`Roofline`) is a fixed cost per sparse layer (the routing and the small
operations around the experts' products) plus its bytes over the memory bandwidth plus its
products over their rate, fitted to this library's MoE steps on an H200 (bench/LOG.md).

Return. With a per-position acceptance rate a, a block of b tokens (b - 1 drafts) yields
1 + a + ... + a^(b - 1) tokens per cycle. `DEFAULT_ACCEPTANCE` is what the published
block-16 DFlash drafters reach on code (bench/LOG.md says which numbers).

The default block (`default_block_size`) maximises tokens per cycle time over the powers of two
from 4 up to the drafter's trained block (and the trained block). It applies where the
experts' product reads only the routed experts (the Pallas kernel); the reference
(`ragged_dot`, and any CPU run) reads every expert at any block, and dense targets read the
same weights at any block: those keep the trained block.
"""

from __future__ import annotations

import dataclasses

from dflash_jax.config import TargetConfig

DEFAULT_ACCEPTANCE = 0.86  # per position: 6.5 tokens per block-16 cycle


@dataclasses.dataclass(frozen=True)
class Roofline:
    """What a target pass costs on a GPU: `sparse_layer_seconds` per layer of routed experts
    whatever the tokens, bytes at `bandwidth` (bytes/s), products at `flops` (flop/s); an
    H200's in bf16."""

    sparse_layer_seconds: float = 4.5e-5
    bandwidth: float = 4.0e12
    flops: float = 4.6e14


def experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """The expected number of distinct experts `tokens` tokens route to (uniform routing)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def mixer_params(cfg: TargetConfig, layer: int) -> int:
    """The parameters of layer `layer`'s token mixer: attention's q (and its output gate), k,
    v and o, or a gated-delta-net layer's [q | k | v], z, a, b and out projections."""
    D, H = cfg.hidden_size, cfg.head_dim
    if cfg.is_linear_attention(layer):
        la = cfg.linear_attention
        value_heads = la.num_value_heads
        return D * (la.conv_dim + 2 * value_heads * la.value_head_dim + 2 * value_heads)
    gate = cfg.num_heads if cfg.attention_output_gate else 0
    return D * H * (2 * cfg.num_heads + gate + 2 * cfg.num_kv_heads)


def pass_cost(cfg: TargetConfig, tokens: int, itemsize: int = 2, roofline: Roofline = Roofline()) -> dict:
    """What one target pass over `tokens` tokens reads and computes: "bytes", "flops" (weights
    only: the KV cache's share grows with the context, not with the block) and "seconds".
    `itemsize`: the bytes of a float weight; an 8-bit target's decoder weights take one (their
    scales and the few products held float left out), its LM head `itemsize`."""
    D = cfg.hidden_size
    dense_mlp = 3 * D * cfg.intermediate_size
    head = cfg.vocab_size * D
    weights, active, sparse = head, head, 0  # parameters read, used per token; sparse layers
    for layer in range(cfg.num_layers):
        experts = cfg.layer_experts(layer)
        mixer = mixer_params(cfg, layer)
        weights, active = weights + mixer, active + mixer
        if experts is None:
            weights, active = weights + dense_mlp, active + dense_mlp
            continue
        sparse += 1
        per_expert = 3 * D * experts.intermediate_size
        router = D * experts.num_experts + (3 * D + 1) * (experts.shared_intermediate_size or 0)  # and a shared expert
        weights += router + per_expert * experts_touched(experts.num_experts, experts.top_k, tokens)
        active += router + per_expert * experts.top_k
    decoder_itemsize = 1 if cfg.quantization is not None else itemsize
    nbytes, flops = head * itemsize + (weights - head) * decoder_itemsize, 2 * active * tokens
    seconds = sparse * roofline.sparse_layer_seconds + nbytes / roofline.bandwidth + flops / roofline.flops
    return dict(bytes=nbytes, flops=flops, seconds=seconds)


def tokens_per_cycle(block_size: int, acceptance: float = DEFAULT_ACCEPTANCE) -> float:
    """The expected tokens a cycle of `block_size` yields at per-position `acceptance`."""
    return sum(acceptance ** i for i in range(block_size))


def projected_speedup(cfg: TargetConfig, block_size: int, batch: int, acceptance: float = DEFAULT_ACCEPTANCE,
                      roofline: Roofline = Roofline()) -> float:
    """Tokens per second of DFlash at `block_size` over autoregressive decoding's, both at
    `batch` requests, from the cost model (the drafter's share of a cycle left out: it
    barely grows with the block)."""
    step = pass_cost(cfg, batch, roofline=roofline)["seconds"]
    cycle = pass_cost(cfg, batch * block_size, roofline=roofline)["seconds"]
    return tokens_per_cycle(block_size, acceptance) * step / cycle


def candidate_block_sizes(trained: int) -> list[int]:
    """Powers of two from 4 below the trained block, and the trained block."""
    sizes, size = [], 4
    while size < trained:
        sizes.append(size)
        size *= 2
    return sizes + [trained]


def default_block_size(cfg: TargetConfig, trained: int, batch: int, acceptance: float = DEFAULT_ACCEPTANCE,
                       roofline: Roofline = Roofline()) -> int:
    """The verify block a run of `batch` requests takes when none is given: the trained block
    on a dense target; on a MoE target, the candidate with the best projected speedup."""
    if cfg.experts is None:
        return trained
    return max(candidate_block_sizes(trained),
               key=lambda b: projected_speedup(cfg, b, batch, acceptance, roofline=roofline))
