"""Routed experts (Qwen3-MoE's sparse feed-forward): a router picks `top_k` experts per token
and the token's output is their SwiGLU outputs weighted by the router's probabilities.

Each token is computed alone whatever tokens share its step: the router's choice depends on
the token only, and the experts' product (`experts_product`) groups the (token, expert) pairs
by expert without mixing rows. So a verify block computes what single steps compute, and
greedy DFlash on a MoE target equals its greedy autoregressive decoding.

The product is `jax.lax.ragged_dot` over the pairs sorted by expert: on a GPU XLA reads only
the experts the step routes to. A grouped-expert kernel of our own is still to come.

On a tensor-parallel mesh the experts are split over "model" (expert parallelism): every
device sees all tokens, computes the pairs routed to its own experts, and one all-reduce sums
the shards' outputs (`sharding.MODEL_AXES` holds the "experts" axis).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from dflash_jax.config import ExpertsConfig
from dflash_jax.kernels import REFERENCE, Kernels
from dflash_jax.layers import dot_general, linear
from dflash_jax.sharding import MODEL, tensor_parallel_size


def route(router_logits, experts: ExpertsConfig, dtype):
    """(weights [T, top_k] in `dtype`, expert ids [T, top_k]) from the router's logits [T,
    num_experts]: the softmax's top k in float32, renormalised over them when the config says
    so (transformers' Qwen3-MoE router)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, expert_ids = jax.lax.top_k(probs, experts.top_k)
    if experts.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights.astype(dtype), expert_ids


def experts_product(x_TD, gate_up, down, weights, expert_ids):
    """sum over k of weights[t, k] * down(silu(gate) * up) of expert expert_ids[t, k] at x[t].
    `gate_up` [experts, D, 2 * inter] ([gate | up] columns), `down` [experts, inter, D];
    `weights`, `expert_ids` [T, top_k]. The (token, expert) pairs are sorted by expert, each
    expert's rows one group of `ragged_dot`, and the weighted rows summed back per token in
    float32. An id equal to the number of experts (an expert another shard holds) adds nothing."""
    T, top_k = expert_ids.shape
    num_experts, _, width = gate_up.shape
    order = jnp.argsort(expert_ids.reshape(-1), stable=True)
    token_of = order // top_k
    # ids past the last expert (another shard's) sort last, outside every group: zero rows
    group_sizes = jnp.bincount(expert_ids.reshape(-1), length=num_experts + 1)[:num_experts].astype(jnp.int32)
    pairs = jax.lax.ragged_dot(x_TD[token_of], gate_up, group_sizes, preferred_element_type=jnp.float32)
    pairs = pairs.astype(x_TD.dtype)
    hidden = jax.nn.silu(pairs[:, : width // 2]) * pairs[:, width // 2:]
    out = jax.lax.ragged_dot(hidden, down, group_sizes, preferred_element_type=jnp.float32).astype(x_TD.dtype)
    weights = jnp.where(expert_ids < num_experts, weights, 0).reshape(-1)[order]
    out = (out * weights[:, None]).astype(jnp.float32)
    return jnp.zeros((T, out.shape[-1]), jnp.float32).at[token_of].add(out).astype(x_TD.dtype)


class RoutedExperts(nnx.Module):
    """A decoder layer's sparse feed-forward: the router `[D, E]`, each expert's gate and up
    as one matrix `[E, D, 2I]` ([gate | up] columns) and its down `[E, I, D]`."""

    def __init__(self, hidden: int, experts: ExpertsConfig, *, dtype, rngs: nnx.Rngs):
        self.experts = experts
        self.mesh = None  # set where the model is placed on a mesh: the experts are split over "model"
        E, inter = experts.num_experts, experts.intermediate_size
        self.router = linear(hidden, E, ("embed", None), use_bias=False, dtype=dtype, rngs=rngs)
        init = nnx.initializers.normal(0.02)
        axes = ("experts", None, None)
        self.gate_up = nnx.Param(init(rngs.params(), (E, hidden, 2 * inter), dtype), out_sharding=axes,
                                 eager_sharding=False)
        self.down = nnx.Param(init(rngs.params(), (E, inter, hidden), dtype), out_sharding=axes, eager_sharding=False)

    def __call__(self, x_TD, kernels: Kernels = REFERENCE):
        router_logits = dot_general(x_TD, self.router.kernel[...], (((1,), (0,)), ((), ())))
        weights, expert_ids = route(router_logits, self.experts, x_TD.dtype)
        gate_up, down = self.gate_up[...], self.down[...]
        if self.mesh is None or self.experts.num_experts % tensor_parallel_size(self.mesh):
            return experts_product(x_TD, gate_up, down, weights, expert_ids)

        def local(x_TD, gate_up, down, weights, expert_ids):  # this shard's experts; the others' pairs dropped
            held = gate_up.shape[0]
            ids = expert_ids - jax.lax.axis_index(MODEL) * held
            ids = jnp.where((ids >= 0) & (ids < held), ids, held)
            return jax.lax.psum(experts_product(x_TD, gate_up, down, weights, ids), MODEL)

        split, whole = PartitionSpec(MODEL), PartitionSpec()
        return jax.shard_map(local, mesh=self.mesh, in_specs=(whole, split, split, whole, whole), out_specs=whole,
                             check_vma=False)(x_TD, gate_up, down, weights, expert_ids)
