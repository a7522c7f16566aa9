"""A mixture-of-experts router's choice per token (softmax and top k, in the two orders the
families use) as one Pallas kernel (Triton lowering on a GPU, interpret mode on CPU), beside
its jnp reference.

XLA runs a decode step's routing as four or five small kernels a sparse layer (the float32
conversion, the softmax's max and sum, the top k, the renormalisation), each a launch that
costs more than its bytes; a 48-layer model pays them in every layer (bench/results). Here
one program per token loads its logits once and writes its top-k weights and expert ids. The
top k is k rounds of (largest value, its lowest index), which is `lax.top_k`'s order (values
descending, ties to the lower index). Each token is computed alone, so a verify block routes
exactly as single steps do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2, runs_interpreted


def route_reference(logits_TE, top_k: int, *, softmax_after_top_k: bool, norm_topk_prob: bool):
    """(weights [T, top_k] float32, expert ids [T, top_k] int32) from router logits [T, E]:
    Qwen3-MoE's softmax then top k (renormalised over them with `norm_topk_prob`), or
    gpt-oss's top k logits then their softmax (`softmax_after_top_k`)."""
    logits = logits_TE.astype(jnp.float32)
    if softmax_after_top_k:
        top, expert_ids = jax.lax.top_k(logits, top_k)
        return jax.nn.softmax(top, axis=-1), expert_ids
    weights, expert_ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, expert_ids


def _softmax(x, valid):
    """Softmax over the `valid` lanes of a vector (zeros elsewhere)."""
    top = jnp.max(jnp.where(valid, x, -jnp.inf))
    e = jnp.where(valid, jnp.exp(x - top), 0.0)
    return e / jnp.sum(e)


def _kernel(logits_ref, weights_ref, ids_ref, *, num_experts: int, top_k: int, block_e: int, block_k: int,
            size: int, softmax_after_top_k: bool, norm_topk_prob: bool):
    t = pl.program_id(0)
    experts, slots = jnp.arange(block_e), jnp.arange(block_k)
    known, chosen = experts < num_experts, slots < top_k
    logits = plgpu.load(logits_ref.at[t * num_experts + experts], mask=known, other=0).astype(jnp.float32)
    scores = jnp.where(known, logits if softmax_after_top_k else _softmax(logits, known), -jnp.inf)
    top, ids = jnp.zeros((block_k,), jnp.float32), jnp.zeros((block_k,), jnp.int32)
    for i in range(top_k):  # the largest score left, at its lowest index
        best = jnp.max(scores)
        index = jnp.min(jnp.where(scores == best, experts, block_e))
        top, ids = jnp.where(slots == i, best, top), jnp.where(slots == i, index, ids)
        scores = jnp.where(experts == index, -jnp.inf, scores)
    if softmax_after_top_k:
        top = _softmax(top, chosen)
    elif norm_topk_prob:
        top = top / jnp.sum(jnp.where(chosen, top, 0.0))
    at = jnp.where(chosen, t * top_k + slots, size)  # masked lanes one past the end (interpret mode drops them)
    plgpu.store(weights_ref.at[at], top, mask=chosen)
    plgpu.store(ids_ref.at[at], ids, mask=chosen)


def route_pallas(logits_TE, top_k: int, *, softmax_after_top_k: bool, norm_topk_prob: bool,
                 interpret: bool | None = None):
    """`route_reference` (same arguments and results) as one kernel, a program per token.
    interpret: None runs compiled on a GPU backend and in interpret mode elsewhere."""
    T, E = logits_TE.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, {E}] experts, got {top_k}.")
    if T == 0:
        return route_reference(logits_TE, top_k, softmax_after_top_k=softmax_after_top_k,
                               norm_topk_prob=norm_topk_prob)
    weights, ids = pl.pallas_call(
        functools.partial(_kernel, num_experts=E, top_k=top_k, block_e=next_pow2(E), block_k=next_pow2(top_k),
                          size=T * top_k, softmax_after_top_k=softmax_after_top_k, norm_topk_prob=norm_topk_prob),
        out_shape=[jax.ShapeDtypeStruct((T * top_k,), jnp.float32), jax.ShapeDtypeStruct((T * top_k,), jnp.int32)],
        grid=(T,),
        interpret=runs_interpreted(interpret),
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        name="route_experts",
    )(logits_TE.reshape(-1))
    return weights.reshape(T, top_k), ids.reshape(T, top_k)
