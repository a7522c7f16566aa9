"""A layer's projected heads finished in one Pallas kernel: per-head q/k RMSNorm, RoPE, and the
keys and values written to their paged-cache slots in place (Triton lowering on a GPU,
interpret mode on CPU), beside its jnp reference.

After the q/k/v product, XLA makes ~7 small kernels of a decode step's layer: the two head
norms (a reduction and a scaling each), the rotations, and a scatter per cache. At batch 1
each costs a few microseconds, and a deep model pays them in every layer (bench/LESSONS.md).
Here one program per (token, head) loads its head once, and writes either
the finished query or its cache row; the caches are aliased to the outputs, so the write
updates them in place.

Numerics follow the reference step by step (HF's order): norm in float32, cast back, times
the weight; rotation in float32 with cos/sin computed outside (the same table the reference
uses), cast back. Only the order of the float32 sum of squares may differ: outputs agree to a
rounding step.

Indexing: arrays are flat; a program's lanes cover its head, padded to a power of two
(Triton block shapes) and masked, and each lane also loads the dim it rotates with (i + Z or
i - Z for a table of Z pairs; itself past the rotated 2Z dims, which pass through); masked or
pad-slot stores point one element past the end (the GPU touches nothing there; interpret
mode's scatter drops them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import as_stored, next_pow2, quiet_triton_deprecation
from pallas_kernels.rms_norm import add_rms_norm_reference


def finish_qkv_reference(qkv_TYH, cos_TZ, sin_TZ, q_weight_H, k_weight_H, eps, *, num_heads: int):
    """(queries [T, U, H], keys [T, K, H], values [T, K, H]) from `qkv_TYH` [T, U + 2K, H]
    straight out of the projection: q/k normed (weights None: models without q/k norm) and
    rotated by the float32 [T, Z] (Z = H / 2) table `cos_TZ`, `sin_TZ`."""
    n, k = num_heads, (qkv_TYH.shape[1] - num_heads) // 2
    q_TUH, k_TKH, v_TKH = qkv_TYH[:, :n], qkv_TYH[:, n : n + k], qkv_TYH[:, n + k :]
    if q_weight_H is not None:
        q_TUH = add_rms_norm_reference(q_TUH, None, q_weight_H, eps)[1]
        k_TKH = add_rms_norm_reference(k_TKH, None, k_weight_H, eps)[1]
    return rotate(q_TUH, cos_TZ, sin_TZ), rotate(k_TKH, cos_TZ, sin_TZ), v_TKH


def write_slots(cache_XKH, slots_T, rows_TKH):
    """The cache with `rows_TKH` scattered to `slots_T`; slots < 0 (padding) write nothing.
    A cache stored as its values' bits (`common.stored_as_bits`) gets the rows' bits."""
    slots_T = jnp.where(slots_T < 0, cache_XKH.shape[0], slots_T)  # out of range -> dropped
    return cache_XKH.at[slots_T].set(as_stored(rows_TKH, cache_XKH.dtype), mode="drop")


def finish_heads_reference(qkv_TYH, cos_TZ, sin_TZ, q_weight_H, k_weight_H, eps, slots_T, k_cache_XKH, v_cache_XKH,
                           *, num_heads: int):
    """(queries, key cache, value cache): `finish_qkv_reference`, then keys and values written
    to their `slots_T` (< 0 writes nothing)."""
    q_TUH, k_TKH, v_TKH = finish_qkv_reference(qkv_TYH, cos_TZ, sin_TZ, q_weight_H, k_weight_H, eps,
                                               num_heads=num_heads)
    return q_TUH, write_slots(k_cache_XKH, slots_T, k_TKH), write_slots(v_cache_XKH, slots_T, v_TKH)


def rotate(x_TUH, cos_TZ, sin_TZ):
    """Neox-style RoPE of `x_TUH` by a [T, Z] table: the first 2Z dimensions as halves (a, b)
    -> (a cos - b sin, b cos + a sin), in float32, cast back; dimensions past 2Z (partial
    rotary) pass through."""
    half = cos_TZ.shape[-1]
    x = x_TUH.astype(jnp.float32)
    a, b, rest = x[..., :half], x[..., half: 2 * half], x[..., 2 * half:]
    cos, sin = cos_TZ[:, None, :], sin_TZ[:, None, :]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin, rest], axis=-1).astype(x_TUH.dtype)


def _kernel(qkv_ref, cos_ref, sin_ref, *refs, num_heads, num_kv_heads, head_dim, rotary_half, block_h, eps, qk_norm,
            sizes):
    if qk_norm:
        q_weight_ref, k_weight_ref, slots_ref, _, _, q_ref, k_cache_ref, v_cache_ref = refs
    else:
        slots_ref, _, _, q_ref, k_cache_ref, v_cache_ref = refs
    n, k, z = num_heads, num_kv_heads, rotary_half
    t, j = pl.program_id(0), pl.program_id(1)
    dims = jnp.arange(block_h)
    ok = dims < head_dim
    rotated, first_half = dims < 2 * z, dims < z
    partner = jnp.where(rotated & ok, jnp.where(first_half, dims + z, dims - z), dims)  # the dim it rotates with
    at = (t * (n + 2 * k) + j) * head_dim
    x = plgpu.load(qkv_ref.at[at + dims], mask=ok, other=0)
    y = plgpu.load(qkv_ref.at[at + partner], mask=ok, other=0)
    is_q, is_v = j < n, j >= n + k
    if qk_norm:  # the key weights for value heads too: their normed rows are never stored
        def weight(index):
            return jnp.where(is_q, plgpu.load(q_weight_ref.at[index], mask=ok, other=0),
                             plgpu.load(k_weight_ref.at[index], mask=ok, other=0))

        x32 = x.astype(jnp.float32)
        scale = lax.rsqrt(jnp.sum(x32 * x32) / head_dim + eps)
        normed_x = weight(dims) * (x32 * scale).astype(x.dtype)
        normed_y = weight(partner) * (y.astype(jnp.float32) * scale).astype(y.dtype)
    else:
        normed_x, normed_y = x, y
    table_at = t * z + jnp.where(first_half, dims, dims - z)
    cos = plgpu.load(cos_ref.at[table_at], mask=ok & rotated, other=0)
    sin = plgpu.load(sin_ref.at[table_at], mask=ok & rotated, other=0)
    x32, y32 = normed_x.astype(jnp.float32), normed_y.astype(jnp.float32)
    rot = jnp.where(first_half, x32 * cos - y32 * sin, x32 * cos + y32 * sin)
    finished = jnp.where(rotated, rot.astype(q_ref.dtype), normed_x.astype(q_ref.dtype))

    q_at = (t * n + j) * head_dim + dims
    plgpu.store(q_ref.at[jnp.where(ok & is_q, q_at, sizes[0])], finished, mask=ok & is_q)
    slot = slots_ref[t]
    kv_head = jnp.where(is_v, j - n - k, j - n)
    row_at = (slot * k + kv_head) * head_dim + dims
    for cache_ref, wanted, row in ((k_cache_ref, ~is_q & ~is_v, finished), (v_cache_ref, is_v, x)):
        store = ok & wanted & (slot >= 0)
        plgpu.store(cache_ref.at[jnp.where(store, row_at, sizes[1])], row.astype(cache_ref.dtype), mask=store)


def finish_heads_pallas(qkv_TYH, cos_TZ, sin_TZ, q_weight_H, k_weight_H, eps, slots_T, k_cache_XKH, v_cache_XKH,
                        *, num_heads: int, interpret: bool | None = None):
    """`finish_heads_reference` (same arguments and results) as one kernel writing the caches
    in place (donate them, or keep them loop-carried, or XLA copies them first); a table
    narrower than half a head (partial rotary) rotates that many leading pairs. interpret:
    None runs compiled on a GPU backend and in interpret mode elsewhere."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    num_tokens, num_all_heads, head_dim = qkv_TYH.shape
    num_slots, num_kv_heads, _ = k_cache_XKH.shape
    if num_all_heads != num_heads + 2 * num_kv_heads or head_dim % 2 or v_cache_XKH.shape != k_cache_XKH.shape:
        raise ValueError(f"qkv {qkv_TYH.shape} does not fit {num_heads} query heads and caches {k_cache_XKH.shape} / "
                         f"{v_cache_XKH.shape}: pass [T, U + 2K, H] heads with an even H and equal [X, K, H] caches.")
    if (q_weight_H is None) != (k_weight_H is None):
        raise ValueError("pass both q/k norm weights (Qwen3) or neither (Llama).")
    if 2 * cos_TZ.shape[-1] > head_dim:
        raise ValueError(f"a rotary table of {cos_TZ.shape[-1]} pairs does not fit heads of {head_dim} dims.")
    qk_norm = q_weight_H is not None
    eps = float(eps)  # a Python number: a traced one would be a constant the kernel captures
    if not interpret:
        quiet_triton_deprecation()
    q_size, cache_size = num_tokens * num_heads * head_dim, k_cache_XKH.size
    weights = (q_weight_H, k_weight_H) if qk_norm else ()
    inputs = (qkv_TYH.reshape(-1), cos_TZ.reshape(-1), sin_TZ.reshape(-1), *weights, slots_T.astype(jnp.int32),
              k_cache_XKH.reshape(-1), v_cache_XKH.reshape(-1))
    q_dtype = jnp.result_type(qkv_TYH.dtype, *(w.dtype for w in weights))
    q, k_cache, v_cache = pl.pallas_call(
        functools.partial(_kernel, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          rotary_half=cos_TZ.shape[-1], block_h=next_pow2(head_dim), eps=eps, qk_norm=qk_norm,
                          sizes=(q_size, cache_size)),
        out_shape=[jax.ShapeDtypeStruct((q_size,), q_dtype), jax.ShapeDtypeStruct((cache_size,), k_cache_XKH.dtype),
                   jax.ShapeDtypeStruct((cache_size,), v_cache_XKH.dtype)],
        grid=(num_tokens, num_all_heads),
        input_output_aliases={len(inputs) - 2: 1, len(inputs) - 1: 2},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        name="finish_heads",
    )(*inputs)
    return (q.reshape(num_tokens, num_heads, head_dim), k_cache.reshape(k_cache_XKH.shape),
            v_cache.reshape(v_cache_XKH.shape))
