"""Routed experts (Qwen3-MoE's and gpt-oss's sparse feed-forward): a router picks `top_k`
experts per token and the token's output is their SwiGLU outputs weighted by the router's
probabilities.

Each token is computed alone whatever tokens share its step: the router's choice depends on
the token only, and the experts' product (`experts_product`) groups the (token, expert) pairs
by expert without mixing rows. So a verify block computes what single steps compute, and
greedy DFlash on a MoE target equals its greedy autoregressive decoding.

`Kernels.experts` picks the product: the reference is `jax.lax.ragged_dot` over the pairs
sorted by expert (XLA's GPU lowering of it reads every expert whatever the routing,
bench/LESSONS.md); the Pallas kernel (`pallas_kernels/grouped_matmul.py`) takes the pairs in
tiles of one expert each and reads only the routed experts' matrices.

On a tensor-parallel mesh the experts are split over "model" (expert parallelism): every
device sees all tokens, computes the pairs routed to its own experts, and one all-reduce sums
the shards' outputs (`sharding.MODEL_AXES` holds the "experts" axis).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from dflash_jax.config import ExpertsConfig
from dflash_jax.kernels import REFERENCE, Kernels
from dflash_jax.layers import MLP, apply_linear, dot_general, linear
from dflash_jax.quantization import WeightQuantization, dequantize
from dflash_jax.sharding import MODEL, tensor_parallel_size
from pallas_kernels.grouped_matmul import expert_tiles, grouped_tiling, tile_rows
from pallas_kernels.router import route_reference


def route(router_logits, experts: ExpertsConfig, dtype, kernel=route_reference):
    """(weights [T, top_k] in `dtype`, expert ids [T, top_k]) from the router's logits [T,
    num_experts], in float32 (`pallas_kernels.router`: Qwen3-MoE's softmax then top k, or
    gpt-oss's top k then softmax); `kernel`: `route_reference` or `route_pallas` (`Kernels.route`)."""
    weights, expert_ids = kernel(router_logits, experts.top_k, softmax_after_top_k=experts.softmax_after_top_k,
                                 norm_topk_prob=experts.norm_topk_prob)
    return weights.astype(dtype), expert_ids


def swiglu(pairs, experts: ExpertsConfig):
    """The experts' activation of their gate and up columns ([gate | up], or interleaved)."""
    width = pairs.shape[-1]
    if experts.interleaved:
        gate, up = pairs[:, 0::2], pairs[:, 1::2]
    else:
        gate, up = pairs[:, : width // 2], pairs[:, width // 2:]
    if experts.swiglu_alpha is None:
        return jax.nn.silu(gate) * up
    limit = experts.swiglu_limit
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * experts.swiglu_alpha))


def experts_product(x_TD, params: dict, weights, expert_ids, experts: ExpertsConfig, grouped_matmul=None,
                    block_in: int | None = None, *, dropped_ids: bool = True):
    """sum over k of weights[t, k] * expert expert_ids[t, k] applied to x[t]. `params`:
    "gate_up" [experts, D, 2 * inter], "down" [experts, inter, D] (and with biases
    "gate_up_bias" [experts, 2 * inter], "down_bias" [experts, D]; 8-bit experts: with
    "gate_up_scale" and "down_scale" [experts, rows, columns], a float32 scale per column and
    block of `block_in` input rows, or per column with `block_in` None); `weights`, `expert_ids`
    [T, top_k]; an id equal to the number of experts (one another shard holds) adds nothing
    (`dropped_ids` False: no id is, which spares the kernel's layout those checks).
    `grouped_matmul`: None for XLA's `ragged_dot` over the pairs sorted by expert, or
    `grouped_matmul_pallas`'s signature over the pairs laid out in tiles of one expert (the
    tokens' rows gathered into them by the product).
    Usable under `vmap` (the trainer maps the target over a batch of sequences): neither
    product has a batching rule, but the product is token by token, so a batch of token sets
    is one set of all their tokens."""
    return _token_wise(experts, grouped_matmul, block_in, dropped_ids)(x_TD, params, weights, expert_ids)


@functools.lru_cache(maxsize=None)
def _token_wise(experts: ExpertsConfig, grouped_matmul, block_in: int | None, dropped_ids: bool):
    @jax.custom_batching.custom_vmap
    def product(x_TD, params, weights, expert_ids):
        if grouped_matmul is None or not _tiles_fit(params, expert_ids.shape[1], block_in):
            return sorted_pairs_product(x_TD, float_experts(params, block_in, x_TD.dtype), weights, expert_ids,
                                        experts)
        return _tiled_pairs_product(x_TD, params, weights, expert_ids, experts, grouped_matmul, block_in,
                                    dropped_ids)

    @product.def_vmap
    def batched(axis_size, in_batched, x_TD, params, weights, expert_ids):
        if any(jax.tree.leaves(in_batched[1])):
            raise NotImplementedError("the experts' weights cannot be mapped over; map the tokens only.")
        x, w, ids = (a if mapped else jnp.broadcast_to(a, (axis_size, *a.shape))
                     for a, mapped in zip((x_TD, weights, expert_ids), (in_batched[0], *in_batched[2:])))
        out = product(x.reshape(-1, x.shape[-1]), params, w.reshape(-1, w.shape[-1]), ids.reshape(-1, ids.shape[-1]))
        return out.reshape(*x.shape[:-1], -1), True

    return product


def _tiles_fit(params: dict, top_k: int, block_in: int | None) -> bool:
    """Whether the grouped kernel takes both of the experts' matrices: a tile divides each,
    and their flattened rows stay within int32 offsets (else the sorted pairs' product)."""
    return all(grouped_tiling(*params[name].shape[1:], top_k, block_in) is not None and params[name].size < 2**31
               for name in ("gate_up", "down"))


def float_experts(params: dict, block_in: int | None, dtype) -> dict:
    """`params` with 8-bit experts' matrices dequantized to `dtype` (what XLA's `ragged_dot`
    multiplies; every expert is read by it anyway), float ones as they are. The weights are
    rounded to `dtype` here, where the kernel multiplies the exact 8-bit values and scales the
    float32 sums: the two agree within that rounding (exactly in float32)."""
    if "gate_up_scale" not in params:
        return params
    params = dict(params)
    for name in ("gate_up", "down"):
        values, scales = params[name], params.pop(f"{name}_scale")
        params[name] = jax.vmap(lambda v, s: dequantize(v, s, block_in, dtype))(values, scales)
    return params


def _weighted_sum(out_PD, weights, position_P, T: int, top_k: int, dtype):
    """Each token's pairs' outputs (row position_P[p] of out_PD for pair p = t * top_k + k;
    a position past the rows reads zeros), weighted in their dtype (as transformers does) and
    summed in float32 in k order: a token's sum never depends on the pairs beside it."""
    count, width = out_PD.shape
    # a clamped gather and a mask, not a zero row appended: XLA then reads only the pairs' rows
    rows = jnp.where((position_P < count)[:, None], out_PD[jnp.minimum(position_P, count - 1)], 0)
    rows = (rows * weights.reshape(-1)[:, None]).astype(jnp.float32)
    return rows.reshape(T, top_k, width).sum(axis=1).astype(dtype)


def sorted_pairs_product(x_TD, params: dict, weights, expert_ids, experts: ExpertsConfig,
                         ragged_dot=jax.lax.ragged_dot):
    """The pairs sorted by expert, each expert's rows one group of `ragged_dot` (the
    benchmarks pass other implementations of `jax.lax.ragged_dot`'s signature)."""
    T, top_k = expert_ids.shape
    num_experts = params["gate_up"].shape[0]
    order = jnp.argsort(expert_ids.reshape(-1), stable=True)
    token_of, sorted_ids = order // top_k, expert_ids.reshape(-1)[order]
    # ids past the last expert (another shard's) sort last, outside every group: zero rows
    group_sizes = jnp.bincount(expert_ids.reshape(-1), length=num_experts + 1)[:num_experts].astype(jnp.int32)

    def product(rows, name):
        out = ragged_dot(rows, params[name], group_sizes, preferred_element_type=jnp.float32)
        if experts.bias:
            out = out + params[f"{name}_bias"][jnp.minimum(sorted_ids, num_experts - 1)].astype(jnp.float32)
        return out.astype(x_TD.dtype)

    out = product(swiglu(product(x_TD[token_of], "gate_up"), experts), "down")
    position = jnp.where(sorted_ids < num_experts, jnp.arange(order.size), order.size)
    return _weighted_sum(out, weights, jnp.zeros_like(order).at[order].set(position), T, top_k, x_TD.dtype)


def _tiled_pairs_product(x_TD, params: dict, weights, expert_ids, experts: ExpertsConfig, grouped_matmul,
                         block_in: int | None, dropped_ids: bool):
    """The pairs in tiles of one expert each (`expert_tiles`), both products by
    `grouped_matmul`: only the routed experts' matrices are read (8-bit ones converted in the
    kernel)."""
    T, top_k = expert_ids.shape
    num_experts = params["gate_up"].shape[0]
    ids = expert_ids.reshape(-1)
    tiles = expert_tiles(ids, num_experts, tile_rows(ids.size, num_experts), top_k, dropped_ids=dropped_ids)
    G, M = tiles.pair_GM.shape

    def product(rows, name):
        out = grouped_matmul(rows, params[name], tiles, top_k=top_k, scales_ERN=params.get(f"{name}_scale"),
                             block_in=block_in)
        if experts.bias:
            out = out + params[f"{name}_bias"][tiles.expert_G][:, None, :].astype(jnp.float32)
        return out.astype(x_TD.dtype)

    hidden = swiglu(product(x_TD, "gate_up").reshape(G * M, -1), experts).reshape(G, M, -1)  # the kernel gathers x
    out = product(hidden, "down").reshape(G * M, -1)
    return _weighted_sum(out, weights, tiles.row_P, T, top_k, x_TD.dtype)


class RoutedExperts(nnx.Module):
    """A decoder layer's sparse feed-forward: the router `[D, E]`, each expert's gate and up
    as one matrix `[E, D, 2I]` and its down `[E, I, D]` (gpt-oss: with biases). With a
    `quantization`, the experts' matrices are 8-bit values with float32 scales
    (`gate_up_scale` [E, rows, 2I], `down_scale` [E, rows, D]) and the shared expert's products
    8-bit too; the router stays float."""

    def __init__(self, hidden: int, experts: ExpertsConfig, *, dtype, rngs: nnx.Rngs,
                 quantization: WeightQuantization | None = None):
        self.experts = experts
        self.mesh = None  # set where the model is placed on a mesh: the experts are split over "model"
        self.block_in = quantization.block_in if quantization is not None else None
        E, inter = experts.num_experts, experts.intermediate_size
        self.router = linear(hidden, E, ("embed", None), use_bias=experts.bias, dtype=dtype, rngs=rngs)
        init = nnx.initializers.normal(0.02)

        def param(*shape, stored=None):  # split over "model" by expert; `stored`: 8-bit values or scales, zeros
            value = init(rngs.params(), (E, *shape), dtype) if stored is None else jnp.zeros((E, *shape), stored)
            return nnx.Param(value, out_sharding=("experts",) + (None,) * len(shape), eager_sharding=False)

        if quantization is None:
            self.gate_up, self.down = param(hidden, 2 * inter), param(inter, hidden)
        else:
            self.gate_up = param(hidden, 2 * inter, stored=quantization.dtype)
            self.gate_up_scale = param(quantization.scale_rows(hidden), 2 * inter, stored=jnp.float32)
            self.down = param(inter, hidden, stored=quantization.dtype)
            self.down_scale = param(quantization.scale_rows(inter), hidden, stored=jnp.float32)
        if experts.bias:
            self.gate_up_bias, self.down_bias = param(2 * inter), param(hidden)
        if experts.shared_intermediate_size:  # Qwen3.5-MoE: a dense expert every token takes, gated
            self.shared_expert = MLP(hidden, experts.shared_intermediate_size, use_bias=False, dtype=dtype, rngs=rngs,
                                     quantization=quantization)
            self.shared_expert_gate = linear(hidden, 1, ("embed", None), use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x_TD, kernels: Kernels = REFERENCE):
        """`MLP`'s call; `kernels` picks the experts' product. The shared expert's output,
        times sigmoid of its gate, adds to the routed experts'."""
        routed_TD = self._routed(x_TD, kernels)
        if not hasattr(self, "shared_expert"):
            return routed_TD
        gate_T1 = jax.nn.sigmoid(apply_linear(self.shared_expert_gate, x_TD, kernels))
        return routed_TD + (gate_T1 * self.shared_expert(x_TD, kernels)).astype(routed_TD.dtype)

    def _routed(self, x_TD, kernels: Kernels):
        router_logits = dot_general(x_TD, self.router.kernel[...], (((1,), (0,)), ((), ())))
        if self.experts.bias:
            router_logits = router_logits + self.router.bias[...]
        router = kernels.route if self.mesh is None else route_reference  # on a mesh XLA partitions the jnp form
        weights, expert_ids = route(router_logits, self.experts, x_TD.dtype, router)
        names = ("gate_up", "down", "gate_up_bias", "down_bias", "gate_up_scale", "down_scale")
        params = {name: getattr(self, name)[...] for name in names if hasattr(self, name)}
        if self.mesh is None:
            return experts_product(x_TD, params, weights, expert_ids, self.experts, kernels.grouped_matmul,
                                   self.block_in, dropped_ids=False)
        if self.experts.num_experts % tensor_parallel_size(self.mesh):  # XLA partitions the reference, not a kernel
            return experts_product(x_TD, params, weights, expert_ids, self.experts, block_in=self.block_in)

        def local(x_TD, params, weights, expert_ids):  # this shard's experts; the others' pairs dropped
            held = params["gate_up"].shape[0]
            ids = expert_ids - jax.lax.axis_index(MODEL) * held
            ids = jnp.where((ids >= 0) & (ids < held), ids, held)
            return jax.lax.psum(experts_product(x_TD, params, weights, ids, self.experts, kernels.grouped_matmul,
                                                self.block_in), MODEL)

        split, whole = PartitionSpec(MODEL), PartitionSpec()
        return jax.shard_map(local, mesh=self.mesh, in_specs=(whole, split, whole, whole), out_specs=whole,
                             check_vma=False)(x_TD, params, weights, expert_ids)
