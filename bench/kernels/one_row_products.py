"""One-row products on the GPU: what XLA makes of a decode step's [1, K] x [K, N] product, and
whether running the row as two (`layers.dot_general`) buys a matrix kernel.

    python -m bench.kernels.one_row_products --out $OUT/one_row_products.json
    python -m bench.kernels.one_row_products --small --out /tmp/one_row.json   # CPU smoke test

XLA GPU rewrites a vector x matrix product whose operands hold fewer than ~10M elements into
an elementwise multiply and a reduce (its dot strength reduction): the Qwen3-30B-A3B o_proj
(4096 x 2048) and every MoE router fall under it, the Qwen3-8B matrices do not. For each
shape, bf16, chained over `--layers` distinct weights (so every matrix streams from HBM),
times:
  - plain: `lax.dot_general` of the one row;
  - two rows: the row and a zero row, the first result row kept;
  - library: `dflash_jax.layers.dot_general` as it stands.
Reports us per product, the read rate over the matrix's bytes, and the kinds of kernel XLA
chose (from the compiled HLO).
"""

from __future__ import annotations

import argparse
import json
import re

import jax
import jax.numpy as jnp

from bench import harness
from dflash_jax.layers import dot_general

NN = (((1,), (0,)), ((), ()))
SHAPES = {  # name: (K, N)
    "qwen3-30b-a3b o_proj": (4096, 2048),
    "qwen3-30b-a3b qkv_proj": (2048, 5120),
    "qwen3-30b-a3b router": (2048, 128),
    "gpt-oss-20b router": (2880, 32),
    "qwen3_5-9b in_proj_ba": (4096, 64),
    "qwen3-8b o_proj": (4096, 4096),
    "smollm2-135m o_proj": (576, 576),
}
SMALL_SHAPES = {"small o_proj": (256, 128), "small router": (128, 8)}
VARIANTS = {
    "plain": lambda x, w: jax.lax.dot_general(x, w, NN),
    "two rows": lambda x, w: jax.lax.dot_general(jnp.concatenate([x, jnp.zeros_like(x)]), w, NN)[:1],
    "library": lambda x, w: dot_general(x, w, NN),
}


def time_chain(product, x, weights, reps):
    """Median seconds of one product in a chain over `weights`, each row fed by the last."""

    @jax.jit
    def run(x, weights):
        for w in weights:
            out = product(x, w)
            x = x + 1e-3 * jnp.resize(out, x.shape).astype(x.dtype)
        return x

    timing = harness.time_calls(lambda: run(x, weights), reps=reps, calls_per_sample=len(weights))
    text = run.lower(x, weights).compile().as_text().lower()
    kinds = sorted(set(re.findall(r"(gemm_fusion|__cublas\w*|input_reduce_fusion|triton_gemm|custom-call)", text)))
    return timing.median_s, kinds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_output_arguments(parser, out_default="one_row_products.json")
    parser.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke test")
    parser.add_argument("--layers", type=int, default=24, help="distinct weights per shape")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    record = harness.Record(__spec__.name, args, argv)
    key = jax.random.key(0)
    results = []
    for name, (K, N) in (SMALL_SHAPES if args.small else SHAPES).items():
        weights = [0.02 * jax.random.normal(jax.random.fold_in(key, i), (K, N), jnp.bfloat16)
                   for i in range(args.layers)]
        x = jax.random.normal(key, (1, K), jnp.bfloat16)
        for variant, product in VARIANTS.items():
            seconds, kinds = time_chain(product, x, weights, args.reps)
            row = dict(shape=name, K=K, N=N, variant=variant, us=seconds * 1e6,
                       TBps=K * N * 2 / seconds / 1e12, kinds=kinds)
            results.append(row)
            print(json.dumps(row), flush=True)
        del weights
    record.write(results)
    print(f"\n{'shape':24s} {'variant':10s} {'us':>8s} {'TB/s':>6s}  kernels")
    for r in results:
        print(f"{r['shape']:24s} {r['variant']:10s} {r['us']:8.2f} {r['TBps']:6.2f}  {','.join(r['kinds'])}")


if __name__ == "__main__":
    main()
