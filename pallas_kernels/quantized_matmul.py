"""x @ W for a weight W stored as 8-bit values (int8 or float8_e4m3fn) and float32 scales, as
one Pallas kernel that reads the 8-bit values from memory and converts them in registers
(Triton lowering on a GPU, interpret mode on CPU).

At decode and verify shapes (a few rows) a product is bound by reading its weight: 8-bit
values halve the bytes of bf16 ones, but XLA's products convert an 8-bit operand through a
bf16 copy where scales come per block of input rows, and its multiply-reduce form reads the
weight once per row. Here each program owns `block_n` output
columns and, with `splits` > 1, one share of the input rows (split-K: enough programs to
fill the GPU when a matrix has few column blocks); shares are summed by XLA afterwards.

Weights are `[K, N]` values with scales `[R, N]`: R = 1 (a scale per output column, applied
once to the float32 sum) or R = ceil(K / block_in) (a scale per column and block of
`block_in` input rows, applied to each block's float32 partial product). The splits depend on
(K, N) alone, never on the number of rows; of the column width, only 64 or 128 columns a
program are ever chosen (`output_major_tiling`), which compute a column alike bit for bit
(narrower blocks would not on a CPU, whose dot sums depend on its width). So a row's result is
the same whatever rows share its call: a verify block computes what single steps compute.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import is_pow2, next_pow2, runs_interpreted, sum_in_order

MIN_TILE = 16  # Triton's smallest product tile


def quantized_matmul_reference(x_TI, values_IO, scales, block_in: int | None, dot_general=lax.dot_general, *,
                               transposed: bool = False):
    """x @ dequantized W in x's dtype (x [..., K]): the 8-bit values only converted (exactly:
    int8 and e4m3 fit in bfloat16; XLA fuses the conversion into the product's operand), float32
    products scaled per column, or per column and block of input rows (products of their own,
    scaled, then summed in block order). `dot_general`: `lax.dot_general`'s signature (the library passes the
    one its CPU products need). transposed: values given as [N, K]."""
    values = (values_IO.T if transposed else values_IO).astype(x_TI.dtype)
    if block_in is None:
        y = dot_general(x_TI, values, (((x_TI.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return (y * scales[0]).astype(x_TI.dtype)
    rows, (*lead, K) = scales.shape[0], x_TI.shape
    pad = rows * block_in - K
    x_blocks = jnp.pad(x_TI.reshape(-1, K), ((0, 0), (0, pad))).reshape(-1, rows, block_in)
    value_blocks = jnp.pad(values, ((0, pad), (0, 0))).reshape(rows, block_in, -1)
    y_blocks = dot_general(x_blocks, value_blocks, (((2,), (1,)), ((1,), (0,))), preferred_element_type=jnp.float32)
    y_TO = sum_in_order(y_blocks * scales[:, None, :])  # block after block
    return y_TO.reshape(*lead, -1).astype(x_TI.dtype)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How a [K, N] weight is cut: `block_k` input rows per step of a program's loop,
    `block_n` output columns per program, `splits` shares of the input rows; `block_rows`, the
    most rows of x per program (larger calls get more programs along the rows)."""

    block_k: int
    block_n: int
    splits: int
    num_warps: int = 4
    num_stages: int = 3
    block_rows: int = 64


def largest_pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides n and is at most cap."""
    return min(n & -n, cap)


def default_tiling(K: int, N: int, block_in: int | None, *, programs: int = 264) -> Tiling | None:
    """The tiling for a [K, N] weight (None where no tile fits: the caller takes the
    reference): 128-row steps (or the largest power of two dividing both K and a scale block),
    128 columns, and as many splits of the rows as bring the programs near `programs` (two per
    H200 multiprocessor) while each split keeps at least four steps."""
    block_k = largest_pow2_divisor(math.gcd(K, block_in) if block_in else K, 128)
    block_n = largest_pow2_divisor(N, 128)
    if block_k < MIN_TILE or block_n < MIN_TILE:
        return None
    steps, column_blocks = K // block_k, N // block_n
    splits = 1
    while (column_blocks * splits * 2 <= programs and steps % (splits * 2) == 0
           and steps // (splits * 2) >= 4):
        splits *= 2
    return Tiling(block_k, block_n, splits)


def output_major_tiling(K: int, N: int, block_in: int | None, rows: int) -> Tiling | None:
    """The default tiling of a weight held [N, K] for a call of `rows` rows: `default_tiling`'s,
    with 64-column programs up to 16 rows (more programs, more loads in flight; 128 from 17
    rows up, where the weight is read once per block of rows). The splits stay those of (K, N),
    and 64 or 128 columns give a column the same bits (tested), so a row computes alike in any
    call."""
    tiling = default_tiling(K, N, block_in)
    if tiling is None or rows > MIN_TILE:
        return tiling
    return dataclasses.replace(tiling, block_n=largest_pow2_divisor(N, 64))


def call_tiling(K: int, N: int, block_in: int | None, rows: int, *, transposed: bool) -> Tiling | None:
    """The tiling `quantized_matmul_pallas` takes when none is given: `output_major_tiling` for a
    weight held [N, K], else `default_tiling`."""
    return output_major_tiling(K, N, block_in, rows) if transposed else default_tiling(K, N, block_in)


def _kernel(x_ref, w_ref, s_ref, o_ref, *, tiling: Tiling, block_m: int, steps: int, block_in: int | None,
            transposed: bool, T: int):
    col_block, split, row_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bk, bn = tiling.block_k, tiling.block_n
    cols = pl.ds(col_block * bn, bn)
    # the call's rows as they are, no padded copy: rows past T load zeros and store nothing
    row_ids = row_block * block_m + jnp.arange(block_m)
    present = (row_ids < T)[:, None]
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None  # float32 stays float32, not TF32

    def step(j, acc):
        k0 = (split * steps + j) * bk
        x = plgpu.load(x_ref.at[jnp.minimum(row_ids, T - 1)[:, None], (k0 + jnp.arange(bk))[None, :]],
                       mask=present, other=0)
        w = (w_ref[cols, pl.ds(k0, bk)] if transposed else w_ref[pl.ds(k0, bk), cols]).astype(x.dtype)
        contract = (((1,), (1 if transposed else 0,)), ((), ()))
        product = lax.dot_general(x, w, contract, precision=precision, preferred_element_type=jnp.float32)
        if block_in is not None:
            product = product * s_ref[pl.ds(k0 // block_in, 1), cols]
        return acc + product

    acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, bn), jnp.float32))
    if tiling.splits == 1 and block_in is None:  # per-column scales on the whole sum; else after the splits'
        acc = acc * s_ref[pl.ds(0, 1), cols]
    # each split's rows in their own T-row band of o (one band without splits); a row past T
    # points past the end, which masked lanes never touch (interpret mode's scatter drops it)
    out_row = jnp.where(row_ids < T, split * T + row_ids, o_ref.shape[0])
    dest = o_ref.at[out_row[:, None], (col_block * bn + jnp.arange(bn))[None, :]]
    plgpu.store(dest, acc.astype(o_ref.dtype), mask=present)


def quantized_matmul_pallas(x_TI, values_IO, scales, block_in: int | None, *, tiling: Tiling | None = None,
                            interpret: bool | None = None, transposed: bool = False):
    """`quantized_matmul_reference` (same arguments and result) as one kernel: x [..., K] in a
    float dtype, values [K, N] int8 or float8_e4m3fn, scales [R, N] float32 (R: 1, or one row
    per block of `block_in` input rows). A weight no tile
    fits (K or N without a power-of-two divisor of 16 or more) takes the reference.
    transposed: values given as [N, K] (each output column's input rows contiguous, PyTorch's
    layout), which Triton turns into product operands with fewer shuffles: the faster layout at
    decode and verify shapes (`QuantizedLinear.to_output_major`).
    interpret: None runs compiled on a GPU backend and in interpret mode elsewhere."""
    *lead, K = x_TI.shape
    N = values_IO.shape[0 if transposed else 1]
    x_TI = x_TI.reshape(-1, K)
    T = x_TI.shape[0]
    tiling = tiling or call_tiling(K, N, block_in, T, transposed=transposed)
    if tiling is None:
        return quantized_matmul_reference(x_TI, values_IO, scales, block_in, transposed=transposed).reshape(*lead, N)
    if (K % (tiling.block_k * tiling.splits) or N % tiling.block_n or (block_in and block_in % tiling.block_k)
            or tiling.block_rows < MIN_TILE or not is_pow2(tiling.block_rows)):
        raise ValueError(f"tiling {tiling} does not divide the weight [{K}, {N}] (block_in {block_in}), or its "
                         f"block_rows is not a power of two of at least {MIN_TILE}; use default_tiling(K, N, block_in).")
    interpret = runs_interpreted(interpret)
    block_m = min(max(next_pow2(T), MIN_TILE), tiling.block_rows)
    finish = tiling.splits == 1
    out_shape = ((T, N), x_TI.dtype) if finish else ((tiling.splits * T, N), jnp.float32)
    out = pl.pallas_call(
        functools.partial(_kernel, tiling=tiling, block_m=block_m, steps=K // tiling.block_k // tiling.splits,
                          block_in=block_in, transposed=transposed, T=T),
        out_shape=jax.ShapeDtypeStruct(*out_shape),
        grid=(N // tiling.block_n, tiling.splits, -(-T // block_m)),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        name="quantized_matmul",
    )(x_TI, values_IO, scales)
    if finish:
        return out.reshape(*lead, N)
    y = sum_in_order(out.reshape(tiling.splits, T, N))
    return (y * scales[0] if block_in is None else y).astype(x_TI.dtype).reshape(*lead, N)
