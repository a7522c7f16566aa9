"""8-bit weight products on the GPU: the Pallas kernel's tilings against XLA's products.

    python -m bench.kernels.quantized_products --out $OUT/quantized_products.json
    python -m bench.kernels.quantized_products --small --out /tmp/qp.json   # CPU smoke test

For each decoder-layer matrix of the Qwen3-8B shape (`bench.shapes`: qkv [4096, 6144], o
[4096, 4096], gate_up [4096, 24576], down [12288, 4096]) and M rows, chained over `--copies`
distinct weights (so every matrix streams from HBM), times:
  - bf16: XLA's product of a bf16 weight (what 8 bits must beat);
  - xla-int8 / xla-int8-b128: `quantized_matmul_reference` (XLA, the conversion in the
    product's operand) through the 8-bit layers' `converted_dot_general` (one row run as two
    on a GPU), one scale per column / per 128 input rows;
  - pallas-*: `pallas_kernels.quantized_matmul` with its default tiling, and the tilings of
    `--sweep` at the rows of `--sweep-rows`, int8 with `--sweep-block`;
  - tokamax-bf16, tokamax-int8(-b128), tokamax-fp8-b128: openxla/tokamax's `ragged_dot`
    (Mosaic GPU; one group) over the bf16 weight, or the same 8-bit values and scales as a
    qwix `QArray` (Hopper: dequantized in registers), where tokamax loads (`optional_tokamax`);
  - jaxmixed-int8-sS-qQ-nW: JAX's own Hopper mixed-type Mosaic GPU product over per-column
    int8 values held [N, K], the input rows split S ways, Q tiles in flight, W columns at most
    (`bench.kernels.jax_mixed_matmul`; GPU only; its result's largest error recorded);
  - mgpu-int8-b128-mM-nN-qQ: `bench.kernels.wgmma_block_scaled`, a Mosaic GPU prototype with
    scales per 128 input rows (GPU only; its result's largest error recorded);
  - none: the chain without a product (what each link costs besides its kernel).
A variant that fails (a kernel refusing a shape) is reported with its error. Reports us per
matrix (the device's busy time from a profiler trace on a GPU, the wall time elsewhere; both
recorded) and the achieved read rate of its weight bytes (values + scales).
"""

from __future__ import annotations

import argparse
import itertools
import json

import jax
import jax.numpy as jnp

from bench import harness
from bench.kernels.jax_mixed_matmul import mixed_variants
from bench.kernels.wgmma_block_scaled import block_scaled_variants
from bench.shapes import QWEN3_8B, SMALL
from bench.traces import device_seconds


def matrices(model: dict) -> dict[str, tuple[int, int]]:
    d, inter, h = model["hidden_size"], model["intermediate_size"], model["head_dim"]
    nh, kh = model["num_attention_heads"] * h, model["num_key_value_heads"] * h
    return {"qkv": (d, nh + 2 * kh), "o": (nh, d), "gate_up": (d, 2 * inter), "down": (inter, d)}


def time_chain(fn, x, weights, reps) -> dict:
    """One `fn(x, w)` over the chain of distinct weights: "wall_us", the median wall time per
    link (the chain's dispatch included: ~10-30 us a link, bench/LOG.md session 40), and
    "device_us", the device's busy time per link from a profiler trace (None on a CPU); "us" is
    the device time where there is one, else the wall time."""

    @jax.jit
    def run(x, weights):
        total = jnp.zeros((), jnp.float32)
        for w in weights:
            total = total + fn(x, *w)[0, 0].astype(jnp.float32)
        return total

    chain = lambda: run(x, weights)  # noqa: E731
    wall = harness.time_calls(chain, reps=reps, calls_per_sample=len(weights)).median_s
    device = device_seconds(chain, calls_per_run=len(weights))
    return dict(us=1e6 * (wall if device is None else device), wall_us=1e6 * wall,
                device_us=None if device is None else 1e6 * device)


def tokamax_variants(floats, quantized, K: int, N: int) -> dict:
    """tokamax's Mosaic GPU `ragged_dot` (one group of all rows) over the bf16 weights and
    over the 8-bit values and scales as qwix `QArray`s ([1, K, N] values, [1, K / block or 1,
    N] scales), where tokamax loads."""
    from bench.kernels.optional_tokamax import load_tokamax

    tokamax = load_tokamax()
    if tokamax is None:
        return {}
    import qwix

    def product(x, w):
        return tokamax.ragged_dot(x, w, jnp.array([x.shape[0]], jnp.int32), implementation="mosaic",
                                  preferred_element_type=jnp.bfloat16)

    variants = {"tokamax-bf16": (lambda x, w: product(x, w[None]), [(w,) for w in floats], K * N * 2)}
    for (weights, block), ws in quantized.items():
        if weights == "fp8" and block is None:
            continue
        as_qarray = [(qwix.QArray(qvalue=v[None], scale=s.reshape(1, -1, N), qtype=v.dtype),) for v, s in ws]
        variants[f"tokamax-{weights}{'-b128' if block else ''}"] = (
            product, as_qarray, K * N + ws[0][1].size * 4)
    return variants


def main(argv=None):
    from dflash_jax.layers import converted_dot_general
    from dflash_jax.quantization import WeightQuantization, quantize
    from pallas_kernels.quantized_matmul import (Tiling, call_tiling, quantized_matmul_pallas,
                                                 quantized_matmul_reference)

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_output_arguments(parser, out_default="quantized_products.json")
    parser.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke test")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--copies", type=int, default=12, help="distinct weights per matrix")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--sweep", default="128,256:64,128:1,2,4,8:4:3:64",
                        help="block_k : block_n : splits : warps : stages : block_rows lists ('' for none)")
    parser.add_argument("--sweep-rows", default="1,16", help="the rows M the sweep runs at")
    parser.add_argument("--sweep-block", type=int, default=128,
                        help="the swept weights' input rows per scale (0: per column)")
    parser.add_argument("--sweep-transposed", action="store_true",
                        help="sweep weights stored [N, K] (each column's input rows contiguous)")
    parser.add_argument("--matrices", default="qkv,o,gate_up,down")
    args = parser.parse_args(argv)
    record = harness.Record(__spec__.name, args, argv)
    shapes = matrices(SMALL if args.small else QWEN3_8B)
    rows_list = [int(r) for r in args.rows.split(",")]
    interpret = jax.default_backend() != "gpu"
    key = jax.random.key(0)
    results = []

    def report(**row):
        results.append(row)
        print(json.dumps(row), flush=True)

    for name in args.matrices.split(","):
        K, N = shapes[name]
        floats = []
        for _ in range(args.copies):
            key, sub = jax.random.split(key)
            floats.append((jax.random.normal(sub, (K, N), jnp.float32) * 0.02).astype(jnp.bfloat16))
        quantized = {}
        for weights, block in (("int8", None), ("int8", 128), ("fp8", None), ("fp8", 128)):
            q = WeightQuantization(weights, block)
            quantized[weights, block] = [quantize(w, q) for w in floats]
        variants = {"bf16": (lambda x, w: x @ w, [(w,) for w in floats], K * N * 2),
                    "none": (lambda x, w: x[:, :1], [(w,) for w in floats], K * N * 2)}
        for (weights, block), ws in quantized.items():
            if weights == "fp8" and block is None:
                continue
            tag = f"{weights}{'-b128' if block else ''}"
            nb = K * N + ws[0][1].size * 4
            variants[f"xla-{tag}"] = (
                lambda x, v, s, block=block: quantized_matmul_reference(x, v, s, block, converted_dot_general), ws, nb)
            variants[f"pallas-{tag}"] = (
                lambda x, v, s, block=block: quantized_matmul_pallas(x, v, s, block, interpret=interpret), ws, nb)
            variants[f"pallas-{tag}-nk"] = (
                lambda x, v, s, block=block: quantized_matmul_pallas(x, v, s, block, interpret=interpret,
                                                                     transposed=True),
                [(v.T, s) for v, s in ws], nb)
        variants.update(tokamax_variants(floats, quantized, K, N))
        variants.update(mixed_variants(quantized, K, N))
        variants.update(block_scaled_variants(quantized, K, N))
        for M in rows_list:
            key, sub = jax.random.split(key)
            x = jax.random.normal(sub, (M, K), jnp.float32).astype(jnp.bfloat16)
            for variant, (fn, ws, nb) in variants.items():
                try:
                    timed = time_chain(fn, x, ws, args.reps)
                except Exception as error:  # an optional library's kernel refusing a shape: recorded, not fatal
                    report(matrix=name, rows=M, variant=variant, error=f"{type(error).__name__}: {str(error)[:300]}")
                    continue
                tiling = call_tiling(K, N, 128 if "b128" in variant else None, M,
                                     transposed=variant.endswith("-nk")) if "pallas" in variant else None
                checked = {}
                if variant.startswith(("jaxmixed", "mgpu")):  # kernels on trial: their results checked too
                    block = 128 if "b128" in variant else None
                    values, scales = quantized["int8", block][0]
                    expected = quantized_matmul_reference(x, values, scales, block).astype(jnp.float32)
                    checked["max_error"] = float(jnp.abs(fn(x, *ws[0]).astype(jnp.float32) - expected).max())
                report(matrix=name, K=K, N=N, rows=M, variant=variant, **timed, TBps=nb / timed["us"] / 1e6,
                       tiling=tiling and list(tiling.__dict__.values()), **checked)
        for M in [int(r) for r in args.sweep_rows.split(",")] if args.sweep else []:
            key, sub = jax.random.split(key)
            x = jax.random.normal(sub, (M, K), jnp.float32).astype(jnp.bfloat16)
            block = args.sweep_block or None
            ws = quantized["int8", block]
            if args.sweep_transposed:
                ws = [(v.T, s) for v, s in ws]
            nb = K * N + ws[0][1].size * 4
            for bk, bn, splits, warps, stages, block_rows in itertools.product(
                    *[[int(v) for v in part.split(",")] for part in args.sweep.split(":")]):
                if N % bn or K % (bk * splits) or (block and block % bk):
                    continue
                tiling = Tiling(bk, bn, splits, warps, stages, block_rows)
                fn = lambda x, v, s, block=block, tiling=tiling: quantized_matmul_pallas(
                    x, v, s, block, tiling=tiling, interpret=interpret, transposed=args.sweep_transposed)
                variant = f"sweep{'-b128' if block else ''}{'-nk' if args.sweep_transposed else ''}"
                try:
                    timed = time_chain(fn, x, ws, args.reps)
                except Exception as error:  # a tiling Triton cannot compile is reported, not fatal
                    report(matrix=name, rows=M, variant=variant, tiling=[bk, bn, splits, warps, stages, block_rows],
                           error=str(error)[:300])
                    continue
                report(matrix=name, K=K, N=N, rows=M, variant=variant, **timed, TBps=nb / timed["us"] / 1e6,
                       tiling=[bk, bn, splits, warps, stages, block_rows])
    record.write(dict(copies=args.copies, timings=results))
    print(f"\n{'matrix':<8} {'M':>3} {'variant':<18} {'us':>8} {'TB/s':>6} tiling")
    for r in results:
        if "error" in r:
            print(f"{r['matrix']:<8} {r['rows']:>3} {r['variant']:<18} failed: {r['error'][:80]}")
            continue
        if "us" in r:
            error = f" max error {r['max_error']:.3g}" if "max_error" in r else ""
            print(f"{r['matrix']:<8} {r['rows']:>3} {r['variant']:<18} {r['us']:8.1f} {r['TBps']:6.2f} {r['tiling']}{error}")
    best = {}
    for r in results:
        if r["variant"].startswith("sweep") and "us" in r:
            k = (r["matrix"], r["rows"], r["variant"])
            best[k] = min(best.get(k, r), r, key=lambda t: t["us"])
    print("\nbest sweep tilings:")
    for (matrix, rows, variant), r in best.items():
        print(f"  {matrix:<8} {rows:>3} {variant:<12} {r['us']:8.1f} us {r['TBps']:6.2f} TB/s {r['tiling']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
