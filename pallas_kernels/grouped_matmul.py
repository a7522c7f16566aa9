"""Rows grouped by expert times their expert's matrix, as one Pallas kernel that reads only the
experts some row routes to (Triton lowering on a GPU, interpret mode on CPU); the rows come
laid out in tiles, or as token rows the kernel gathers into its tiles itself.

XLA's `ragged_dot` on the GPU streams every expert's matrix whatever the routing, so a decode
step of a 128-expert model pays for all 128 while its tokens use 8. Here the rows arrive in
tiles of `block_m` rows that all go to one expert (`expert_tiles` lays the (token, expert)
pairs out so); each program multiplies one tile by `block_n` columns of its expert's matrix,
and a tile no pair fills does no work. The experts' matrices are read once per tile, so a
step reads the experts it routes to and no others. 8-bit experts (int8 or e4m3 values with
float32 scales, as `quantized_matmul` takes them) are converted to the rows' dtype in
registers and scaled per block of input rows or per column.

The tiling (`grouped_tiling`) depends on the matrix's shape and the model's top k, never on
the number of rows; the rows per tile and the layout do (`tile_rows`, `pairs_tile_alone`),
but each tile row's products are its own, over the same steps in the same order, so a row's
result is the same whatever rows share its call and a verify block computes what single
steps compute (tested in interpret mode across both layouts and tile heights).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2, runs_interpreted, sum_in_order
from pallas_kernels.quantized_matmul import MIN_TILE, Tiling, default_tiling

MAX_BLOCK_M = 64  # rows per tile at most (prefill shapes)


@dataclasses.dataclass(frozen=True)
class ExpertTiles:
    """The (token, expert) pairs laid out as tiles of one expert each: `pair_GM` [G, M], the
    pair in each tile row (P, the number of pairs, where the row is empty); `row_P` [P], each
    pair's row in the flattened tiles (G * M for a dropped pair); `expert_G` [G], each tile's
    expert; `used_G` [G], whether any pair fills the tile."""

    pair_GM: jax.Array
    row_P: jax.Array
    expert_G: jax.Array
    used_G: jax.Array


jax.tree_util.register_dataclass(ExpertTiles, data_fields=["pair_GM", "row_P", "expert_G", "used_G"],
                                 meta_fields=[])


def tile_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per tile for a call of `num_pairs` pairs: Triton's smallest product tile at
    decode and verify shapes, up to MAX_BLOCK_M as the pairs per expert grow (prefill)."""
    return min(MAX_BLOCK_M, max(MIN_TILE, next_pow2(-(-num_pairs // num_experts))))


def pairs_tile_alone(num_pairs: int, top_k: int) -> bool:
    """Whether each pair takes a tile of its own: one token's pairs (a decode step of one
    request), whose experts are distinct, so no expert is read twice and the grouping's
    small launches are saved. Two tokens may share experts, and a tile per pair would read
    a shared expert once per pair."""
    return num_pairs <= top_k


def expert_tiles(expert_ids_P, num_experts: int, block_m: int, top_k: int, *, dropped_ids: bool = True) -> ExpertTiles:
    """`expert_ids_P` [P] (ids >= num_experts are dropped: another shard's experts; `top_k`
    a token's pairs) as tiles of `block_m` rows of one expert each: one tile per pair
    (`pairs_tile_alone`), or the pairs grouped by expert, in expert order, in at most
    ceil(P / block_m) + min(P, num_experts) tiles (that many, the unused ones last). No sort:
    each pair's rank among its expert's pairs is a running count. `dropped_ids` False: every
    id is below num_experts (one device holds all experts), which leaves a one-token step's
    tiles constant but for their experts (no small kernels computing them)."""
    (P,) = expert_ids_P.shape
    if dropped_ids:
        valid = expert_ids_P < num_experts
        expert = jnp.minimum(expert_ids_P, num_experts - 1).astype(jnp.int32)
    else:
        valid, expert = jnp.ones((P,), bool), expert_ids_P.astype(jnp.int32)
    if pairs_tile_alone(P, top_k):  # pair p in row 0 of tile p: no scatter needed
        row_P = jnp.where(valid, jnp.arange(P) * block_m, P * block_m)
        first_row = (jnp.arange(block_m) == 0)[None, :] & valid[:, None]
        pair_GM = jnp.where(first_row, jnp.arange(P, dtype=jnp.int32)[:, None], P)
        return ExpertTiles(pair_GM, row_P.astype(jnp.int32), expert, valid)
    G = -(-P // block_m) + min(P, num_experts)
    one_hot = (expert_ids_P[:, None] == jnp.arange(num_experts)[None, :]).astype(jnp.int32)
    running = jnp.cumsum(one_hot, axis=0)  # [P, E]: pairs of each expert so far
    rank = jnp.take_along_axis(running, expert[:, None], axis=1)[:, 0] - 1
    tiles = -(-running[-1] // block_m)
    tile_end = jnp.cumsum(tiles)
    tile = tile_end[expert] - tiles[expert] + rank // block_m
    row_P = jnp.where(valid, tile * block_m + rank % block_m, G * block_m)
    expert_G = jnp.minimum((tile_end[None, :] <= jnp.arange(G)[:, None]).sum(axis=1), num_experts - 1)
    used_G = jnp.arange(G) < tile_end[-1]
    pair_GM = jnp.full((G * block_m + 1,), P, jnp.int32).at[row_P].set(jnp.arange(P, dtype=jnp.int32))
    return ExpertTiles(pair_GM[:-1].reshape(G, block_m), row_P.astype(jnp.int32), expert_G.astype(jnp.int32),
                       used_G)


def tile_inputs(x, tiles: ExpertTiles, top_k: int):
    """The rows [G, M, K] a product multiplies: `x` itself if it is laid out in tiles already,
    else (token rows [T, K]) each tile row's token, zeros where the row is empty."""
    if x.ndim == 3:
        return x
    return jnp.take(x, tiles.pair_GM // top_k, axis=0, mode="fill", fill_value=0)


def grouped_matmul_reference(x, weights_EKN, tiles: ExpertTiles, *, top_k: int, scales_ERN=None,
                             block_in: int | None = None):
    """x_GMK[g] @ weights_EKN[expert_G[g]] in float32, zeros for unused tiles (jnp: each
    tile's matrix gathered); `x` the tiles' rows [G, M, K] or the token rows [T, K] each
    pair's tile row takes (`tile_inputs`, with the pairs per token `top_k`). 8-bit experts:
    `scales_ERN` [E, R, N] float32, a scale per column and block of `block_in` input rows (R =
    ceil(K / block_in)), or per column (R = 1, `block_in` None); the gathered matrices are
    dequantized in float32."""
    weights = weights_EKN[tiles.expert_G]
    if scales_ERN is not None:
        K = weights_EKN.shape[1]
        scales = scales_ERN[tiles.expert_G]
        scales = scales if block_in is None else jnp.repeat(scales, block_in, axis=1)[:, :K]
        weights = weights.astype(jnp.float32) * scales
    out = jnp.einsum("gmk,gkn->gmn", tile_inputs(x, tiles, top_k), weights, preferred_element_type=jnp.float32)
    return jnp.where(tiles.used_G[:, None, None], out, 0)


def grouped_tiling(K: int, N: int, top_k: int, block_in: int | None = None) -> Tiling | None:
    """The tiling for experts' [K, N] matrices (8-bit ones scaled per `block_in` input rows:
    steps within a block): `default_tiling`'s, with the column blocks and row splits sized to
    fill the GPU at one decode token (top_k tiles)."""
    return default_tiling(K, N, block_in, programs=max(1, 264 // top_k))


def _kernel(x_ref, pair_ref, w_ref, *refs, tiling: Tiling, K: int, steps: int, token_rows: int, top_k: int,
            scale_rows: int, block_in: int | None):
    s_ref, expert_ref, used_ref, o_ref = refs if scale_rows else (None, *refs)
    col_block, split, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bk, bn = tiling.block_k, tiling.block_n
    cols = pl.ds(col_block * bn, bn)
    first_row, first_scale = expert_ref[g] * K, expert_ref[g] * scale_rows
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None  # float32 stays float32, not TF32
    if token_rows:  # each tile row's token, gathered here (an empty row, pair P, reads nothing: zeros)
        pairs = pair_ref[g, :]
        filled = pairs < token_rows * top_k
        token = jnp.where(filled, pairs // top_k, 0)

    def step(j, acc):
        k0 = (split * steps + j) * bk
        if token_rows:
            x = plgpu.load(x_ref.at[token[:, None], (k0 + jnp.arange(bk))[None, :]], mask=filled[:, None], other=0)
        else:
            x = x_ref[g, :, pl.ds(k0, bk)]
        w = w_ref[pl.ds(first_row + k0, bk), cols].astype(x.dtype)  # 8-bit values: exact in any float dtype
        product = lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision,
                                  preferred_element_type=jnp.float32)
        if block_in is not None:
            product = product * s_ref[pl.ds(first_scale + k0 // block_in, 1), cols]
        return acc + product

    trips = used_ref[g] * steps  # an unused tile: no steps
    acc = lax.fori_loop(0, trips, step, jnp.zeros((pair_ref.shape[1], bn), jnp.float32))
    if scale_rows and block_in is None:
        acc = acc * s_ref[pl.ds(first_scale, 1), cols]
    o_ref[split, g, :, cols] = acc


def grouped_matmul_pallas(x, weights_EKN, tiles: ExpertTiles, *, top_k: int, scales_ERN=None,
                          block_in: int | None = None, tiling: Tiling | None = None, interpret: bool | None = None):
    """`grouped_matmul_reference` (same arguments and result) as one kernel reading only the
    used tiles' experts; token rows [T, K] are gathered into the tiles by the kernel itself
    (no laid-out copy). 8-bit experts (`scales_ERN`) are converted to the rows' dtype in
    registers, each step's product scaled per block of `block_in` input rows, or the sum
    per column. A matrix no tile fits takes the reference. top_k: the pairs per token
    (the tiling's assumed tiles at one token). interpret: None runs compiled on a GPU backend
    and in interpret mode elsewhere."""
    G, M = tiles.pair_GM.shape
    K = x.shape[-1]
    E, _, N = weights_EKN.shape
    tiling = tiling or grouped_tiling(K, N, top_k, block_in)
    if tiling is None:
        return grouped_matmul_reference(x, weights_EKN, tiles, top_k=top_k, scales_ERN=scales_ERN, block_in=block_in)
    if K % (tiling.block_k * tiling.splits) or N % tiling.block_n or (block_in and block_in % tiling.block_k):
        raise ValueError(f"tiling {tiling} does not divide the experts' matrices [{K}, {N}] (block_in {block_in}); "
                         "use grouped_tiling(K, N, top_k, block_in).")
    interpret = runs_interpreted(interpret)
    scale_rows = 0 if scales_ERN is None else scales_ERN.shape[1]
    scales = () if scales_ERN is None else (scales_ERN.reshape(E * scale_rows, N),)
    out = pl.pallas_call(
        functools.partial(_kernel, tiling=tiling, K=K, steps=K // tiling.block_k // tiling.splits,
                          token_rows=x.shape[0] if x.ndim == 2 else 0, top_k=top_k, scale_rows=scale_rows,
                          block_in=block_in if scale_rows else None),
        out_shape=jax.ShapeDtypeStruct((tiling.splits, G, M, N), jnp.float32),
        grid=(N // tiling.block_n, tiling.splits, G),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        name="grouped_matmul",
    )(x, tiles.pair_GM, weights_EKN.reshape(E * K, N), *scales, tiles.expert_G, tiles.used_G.astype(jnp.int32))
    return sum_in_order(out)
