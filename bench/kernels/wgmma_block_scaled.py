"""A prototype 8-bit product for verify-sized calls on Hopper: Mosaic GPU, weights held
[out, in] as wgmma's first operand (int8 converted to bf16 in registers), x^T from shared
memory as its second, and a float32 scale per output column and block of 128 input rows
applied to each block's partial product, the library's numbers (`quantized_matmul_reference`).

JAX's own mixed-type kernel does the 256-row products in 0.63x the Triton-lowered kernel's
time but takes no block scales (bench/results, session 46). Here each pipeline step is one
scale block: its wgmma goes to a fresh accumulator, whose product is scaled per row and added
to the float32 sum the step carries in registers. One warpgroup a program, `tile_m` weight
rows x `tile_n` columns of x^T; the rows of x past T are zeros. GPU only (Mosaic GPU has no
CPU interpret mode that compiles under this project's jax); measured by
`bench.kernels.quantized_products` (`mgpu-int8-b128-*` variants).

Beside it, a W8A8 form (`mgpu-w8a8-b128-*`): x rounded to int8 per token and block
(`int8_rows`), int8 x int8 wgmma into an exact int32 sum per block, then both scales. Int8
tensor cores run at twice bf16's rate, yet this form only matches cuBLAS bf16's time at 256
rows, and int8 activations miss issue 36's accuracy line (bench/results, session 47): kept to
measure what that rate would buy, not for the library.

    python -m bench.kernels.wgmma_block_scaled --rows 3,256   # on a GPU: each tile setting's
                                                              # largest error, or its traceback
"""

from __future__ import annotations

import argparse
import functools
import itertools
import traceback

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

BLOCK_IN = 128  # input rows per scale and per pipeline step


def block_scaled_product(x_TK, values_NK, scales_RN, *, tile_m: int = 64, tile_n: int = 128, steps: int = 3):
    """y [T, N] = sum over blocks b of (x[:, b] @ values[:, b]^T) * scales[b], in x's dtype."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    T, K = x_TK.shape
    N = values_NK.shape[0]
    if K % BLOCK_IN or scales_RN.shape != (K // BLOCK_IN, N) or N % tile_m:
        raise ValueError(f"weights [{N}, {K}] with scales {scales_RN.shape}: needs K a multiple of {BLOCK_IN}, "
                         f"a scale per {BLOCK_IN} input rows, N a multiple of {tile_m}")
    columns = -(-T // tile_n) * tile_n
    xT = jnp.pad(x_TK, ((0, columns - T), (0, 0))).T.astype(jnp.bfloat16)  # [K, columns]

    def kernel(a_gmem, b_gmem, s_gmem, out_gmem):
        mi, ni = lax.axis_index("m"), lax.axis_index("n")

        def step(_, a_smem, b_smem, s_smem, total):
            partial = _block_product(a_smem[...].astype(jnp.bfloat16), b_smem, (tile_m, tile_n), jnp.float32)
            scale = plgpu.load(s_smem.at[0], (), layout=plgpu.Layout.WGMMA.reduce(1))
            return total + partial * lax.broadcast_in_dim(scale, partial.shape, [0])

        zeros = plgpu.layout_cast(jnp.full((tile_m, tile_n), 0, jnp.float32), plgpu.Layout.WGMMA)
        total = plgpu.emit_pipeline(
            step,
            grid=(K // BLOCK_IN,),
            in_specs=[
                plgpu.BlockSpec((tile_m, BLOCK_IN), lambda k: (mi, k), transforms=_transforms(8, BLOCK_IN, "lhs")),
                plgpu.BlockSpec((BLOCK_IN, tile_n), lambda k: (k, ni), transforms=_transforms(16, tile_n, "rhs")),
                plgpu.BlockSpec((1, tile_m), lambda k: (k, mi)),
            ],
            max_concurrent_steps=steps,
            init_carry=zeros,
        )(a_gmem, b_gmem, s_gmem)

        _store(total, out_gmem, mi, ni)

    y_NC = _launch(kernel, N, columns, tile_m, tile_n)(values_NK, xT, scales_RN)
    return y_NC[:, :T].T.astype(x_TK.dtype)


def _transforms(bits: int, width: int, operand: str):
    """The shared-memory tiling and swizzle of a wgmma operand whose rows hold `width` values
    of `bits` bits."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    swizzle = plgpu.find_swizzle(width * bits, operand)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def _block_product(a, b, shape: tuple[int, int], dtype):
    """a @ b by wgmma into a fresh accumulator of `shape` and `dtype` (float32, or int32 for
    int8 operands), waited for and read back: one scale block's partial product."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    def product(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC(shape, dtype))


def _store(total, out_gmem, mi, ni):
    """A program's float32 result tile [tile_m, tile_n] through shared memory to its place."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    tile_m, tile_n = total.shape

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((tile_m, tile_n), jnp.float32))
    def store(o_smem):
        o_smem[...] = total
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[pl.ds(mi * tile_m, tile_m), pl.ds(ni * tile_n, tile_n)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _launch(kernel, N: int, columns: int, tile_m: int, tile_n: int):
    """`kernel` over a grid of tile_m weight rows x tile_n columns of x^T, one warpgroup each,
    its result y^T [N, columns] in float32."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((N, columns), jnp.float32),
        grid=(N // tile_m, columns // tile_n),
        grid_names=("m", "n"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


def int8_rows(x_TK, group: int = BLOCK_IN):
    """x rounded to int8 per token and block of `group` channels: (values [T, K] int8, scales
    [K / group, T] float32), each row's numbers its own (a verify block rounds what single
    steps do)."""
    T, K = x_TK.shape
    blocks = x_TK.astype(jnp.float32).reshape(T, K // group, group)
    scales = jnp.max(jnp.abs(blocks), axis=-1) / 127
    scales = jnp.where(scales > 0, scales, 1)
    values = jnp.clip(jnp.round(blocks / scales[..., None]), -127, 127).astype(jnp.int8)
    return values.reshape(T, K), scales.T


def int8_activation_reference(x_TK, values_NK, scales_RN):
    """The product with x rounded by `int8_rows`: per block an exact int32 sum, times the
    weight's scale, times the row's, added over blocks in order (float32), in x's dtype."""
    xq, sx_RT = int8_rows(x_TK)
    R = scales_RN.shape[0]
    total = None
    for b in range(R):
        cols = slice(b * BLOCK_IN, (b + 1) * BLOCK_IN)
        exact = lax.dot_general(xq[:, cols], values_NK[:, cols], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.int32)
        partial = exact.astype(jnp.float32) * scales_RN[b][None, :] * sx_RT[b][:, None]
        total = partial if total is None else total + partial
    return total.astype(x_TK.dtype)


def int8_activation_product(x_TK, values_NK, scales_RN, *, tile_m: int = 64, tile_n: int = 128, steps: int = 3):
    """`int8_activation_reference` as one Mosaic GPU kernel: int8 x int8 wgmma into an int32
    accumulator per block (exact), scaled per weight row and per token into a float32 sum."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    T, K = x_TK.shape
    N = values_NK.shape[0]
    columns = -(-T // tile_n) * tile_n
    xq, sx_RT = int8_rows(jnp.pad(x_TK, ((0, columns - T), (0, 0))))

    def kernel(a_gmem, b_gmem, sw_gmem, sx_gmem, out_gmem):
        mi, ni = lax.axis_index("m"), lax.axis_index("n")

        def step(_, a_smem, b_smem, sw_smem, sx_smem, total):
            exact = _block_product(a_smem, plgpu.transpose_ref(b_smem, (1, 0)), (tile_m, tile_n), jnp.int32)
            sw = plgpu.load(sw_smem.at[0], (), layout=plgpu.Layout.WGMMA.reduce(1))
            sx = plgpu.load(sx_smem.at[0], (), layout=plgpu.Layout.WGMMA.reduce(0))
            partial = exact.astype(jnp.float32) * lax.broadcast_in_dim(sw, exact.shape, [0])
            return total + partial * lax.broadcast_in_dim(sx, exact.shape, [1])

        zeros = plgpu.layout_cast(jnp.full((tile_m, tile_n), 0, jnp.float32), plgpu.Layout.WGMMA)
        total = plgpu.emit_pipeline(
            step,
            grid=(K // BLOCK_IN,),
            in_specs=[
                plgpu.BlockSpec((tile_m, BLOCK_IN), lambda k: (mi, k), transforms=_transforms(8, BLOCK_IN, "lhs")),
                plgpu.BlockSpec((tile_n, BLOCK_IN), lambda k: (ni, k), transforms=_transforms(8, BLOCK_IN, "rhs")),
                plgpu.BlockSpec((1, tile_m), lambda k: (k, mi)),
                plgpu.BlockSpec((1, tile_n), lambda k: (k, ni)),
            ],
            max_concurrent_steps=steps,
            init_carry=zeros,
        )(a_gmem, b_gmem, sw_gmem, sx_gmem)

        _store(total, out_gmem, mi, ni)

    y_NC = _launch(kernel, N, columns, tile_m, tile_n)(values_NK, xq, scales_RN, sx_RT)
    return y_NC[:, :T].T.astype(x_TK.dtype)


TILE_SETTINGS = ((64, 128, 3), (64, 64, 4), (128, 64, 3))  # (tile_m, tile_n, steps)
PRODUCTS = {"mgpu-int8-b128": block_scaled_product, "mgpu-w8a8-b128": int8_activation_product}


def block_scaled_variants(quantized: dict, K: int, N: int) -> dict:
    """{name: (fn(x, values_NK, scales), weights, bytes)} for int8 per 128 input rows, a few
    tile settings; none off a GPU."""
    if jax.default_backend() != "gpu" or ("int8", BLOCK_IN) not in quantized:
        return {}
    ws = [(v.T, s) for v, s in quantized["int8", BLOCK_IN]]
    nbytes = K * N + ws[0][1].size * 4
    variants = {}
    for (prefix, product), (tile_m, tile_n, steps) in itertools.product(PRODUCTS.items(), TILE_SETTINGS):
        if N % tile_m:
            continue
        variants[f"{prefix}-m{tile_m}-n{tile_n}-q{steps}"] = (
            functools.partial(product, tile_m=tile_m, tile_n=tile_n, steps=steps), ws, nbytes)
    return variants


def main(argv=None) -> int:
    """Each tile setting at each of --rows against `quantized_matmul_reference` on a [K, N]
    weight: its largest error, or the full traceback of a setting that fails to lower or run."""
    from dflash_jax.quantization import WeightQuantization, quantize
    from pallas_kernels.quantized_matmul import quantized_matmul_reference

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="3,256")
    parser.add_argument("--shape", default="4096,6144", help="K,N of the weight (Qwen3-8B's qkv)")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("the Mosaic GPU prototype runs on a GPU only", flush=True)
        return 0
    K, N = (int(n) for n in args.shape.split(","))
    weight = jax.random.normal(jax.random.key(0), (K, N), jnp.float32) * 0.02
    values, scales = quantize(weight, WeightQuantization("int8", BLOCK_IN))
    failed = 0
    for T in (int(r) for r in args.rows.split(",")):
        x = jax.random.normal(jax.random.key(T), (T, K), jnp.float32).astype(jnp.bfloat16)
        expected = {block_scaled_product: quantized_matmul_reference(x, values, scales, BLOCK_IN),
                    int8_activation_product: jax.jit(int8_activation_reference)(x, values.T, scales)}
        for (prefix, product), (tile_m, tile_n, steps) in itertools.product(PRODUCTS.items(), TILE_SETTINGS):
            setting = f"{prefix} rows {T} tile_m {tile_m} tile_n {tile_n} steps {steps}"
            reference = expected[product].astype(jnp.float32)
            try:
                y = jax.jit(functools.partial(product, tile_m=tile_m, tile_n=tile_n, steps=steps))(
                    x, values.T, scales)
                print(f"{setting}: largest error {float(jnp.abs(y.astype(jnp.float32) - reference).max()):.3g} "
                      f"(largest |y| {float(jnp.abs(reference).max()):.3g})", flush=True)
            except Exception:  # a prototype on trial: every failure shown whole
                failed += 1
                print(f"{setting}: FAILED", flush=True)
                traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
