"""JAX's own Hopper mixed-type product (`jax.experimental.pallas.ops.gpu.
hopper_mixed_type_matmul_mgpu`: Mosaic GPU, TMA loads, int8 values converted in registers and
fed to wgmma) as an 8-bit product, timed beside this project's Triton-lowered kernel.

It multiplies int8 `a` [M, K] by bf16 `b` [K, N], so a weight held [out, in] is `a` and the
rows of x are `b`'s columns: y^T = values_NK @ x^T, padded to the kernel's column tile, scaled
per output column after. Its grid is one tile of rows per program, with no split of the input
rows; the `-sS` variants split them anyway by reshaping values [N, K] to [N*S, K/S] and laying
x's S shares side by side in `b`, then keeping the S diagonal blocks of the [N*S, S*cols]
result (S times the arithmetic, which a one-row product has to spare). Per-column scales only:
the kernel has no place for a scale per block of input rows. GPU only (its interpret mode does
not compile on this project's CPU jax); elsewhere, or where the module does not import, no
variants, the reason printed."""

from __future__ import annotations

import jax
import jax.numpy as jnp

MIN_COLUMNS = 16  # the narrowest column tile tried (a wgmma's N is a multiple of 8)


def load_kernel():
    """The module, or None (the reason printed) off a GPU or where it does not import."""
    if jax.default_backend() != "gpu":
        return None
    try:
        from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu
    except Exception as error:  # a jax without it, or whose module does not import
        print(f"jax's mixed-type kernel not measured: {type(error).__name__}: {error}", flush=True)
        return None
    return hopper_mixed_type_matmul_mgpu


def mixed_product(module, x_TK, values_NK, scales, *, splits: int, steps: int, widest: int, tile_m: int = 64):
    """y [T, N] = x @ values^T * scales[0] through `module.mixed_matmul_kernel` (float32
    sums), the input rows split `splits` ways, `steps` tiles in flight, column tiles of at most
    `widest` (shared memory holds `steps` tiles of x and the float32 result's), `tile_m`
    weight rows a warpgroup (two a program)."""
    T, K = x_TK.shape
    N = values_NK.shape[0]
    columns = max(MIN_COLUMNS, -(-T // MIN_COLUMNS) * MIN_COLUMNS) if T <= 64 else -(-T // 128) * 128
    if splits > 1 and T > MIN_COLUMNS:
        raise ValueError(f"splits of the input rows are tried up to {MIN_COLUMNS} rows, not {T}")
    tile_n = min(columns * splits, widest)
    config = module.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=128, max_concurrent_steps=steps,
                                 epi_tile_n=min(tile_n, 64), epi_tile_m=64,
                                 wg_dimension=module.MatmulDimension.M)
    x = jnp.pad(x_TK, ((0, columns - T), (0, 0)))
    b = x.reshape(columns, splits, K // splits).transpose(2, 1, 0).reshape(K // splits, splits * columns)
    a = values_NK.reshape(N * splits, K // splits)
    out = module.mixed_matmul_kernel(a, b, out_dtype=jnp.float32, config=config)
    diagonal = jnp.arange(splits)
    y_NC = out.reshape(N, splits, splits, columns)[:, diagonal, diagonal, :].sum(axis=1)
    return (y_NC[:, :T].T * scales[0]).astype(x_TK.dtype)


def mixed_variants(quantized: dict, K: int, N: int) -> dict:
    """{name: (fn(x, values_NK, scales), weights, bytes)} for per-column int8 weights: 1 or 4
    splits of the input rows, 2-8 tiles in flight, column tiles of at most 64 or 128, 64 or
    128 weight rows a warpgroup ("-m128")."""
    module = load_kernel()
    if module is None or ("int8", None) not in quantized:
        return {}
    ws = [(v.T, s) for v, s in quantized["int8", None]]
    nbytes = K * N + ws[0][1].size * 4
    variants = {}
    for splits, steps, widest, tile_m in ((1, 4, 64, 64), (1, 8, 64, 64), (1, 3, 128, 64), (4, 4, 128, 64),
                                          (1, 3, 64, 128), (1, 2, 128, 128), (1, 2, 128, 64)):
        if K % (128 * splits) or N % (2 * tile_m):
            continue
        variants[f"jaxmixed-int8-s{splits}-q{steps}-n{widest}{'-m128' if tile_m == 128 else ''}"] = (
            lambda x, v, s, splits=splits, steps=steps, widest=widest, tile_m=tile_m: mixed_product(
                module, x, v, s, splits=splits, steps=steps, widest=widest, tile_m=tile_m),
            ws, nbytes)
    return variants
