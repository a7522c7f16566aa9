"""A decoder layer's input projections on the GPU: separate matrices against fused ones.

    python bench/bench_projections.py --out $OUT/projections.json
    python bench/bench_projections.py --small --out /tmp/projections.json   # CPU smoke test

For M rows of the Qwen3-8B shape (hidden 4096, 32 / 8 heads of 128, intermediate 12288),
bf16, over 36 layers' distinct weights (so every matrix streams from HBM), times:
  - q, k, v as three products against one product with [Wq | Wk | Wv];
  - gate, up as two products (then silu(gate) * up) against one with [Wgate | Wup].
Reports us per layer, the achieved read rate, and the kind of kernel XLA chose for each
product (a "gemm" fusion, a cuBLAS call, or a reduce fusion), from the compiled HLO.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def time_layers(fn, x, weights, reps):
    """Median seconds of one call of `fn` chained over every layer's weights."""

    @jax.jit
    def run(x, weights):
        for w in weights:  # unrolled, as the model's layers are: no slicing of stacked weights
            x = x + 1e-3 * fn(x, w)[..., : x.shape[-1]].astype(x.dtype)
        return x

    run(x, weights).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run(x, weights).block_until_ready()
        times.append(time.perf_counter() - t0)
    kinds = sorted(set(re.findall(r"(gemm_fusion|__cublas\w*|input_reduce_fusion|triton_gemm)",
                                  run.lower(x, weights).compile().as_text())))
    return statistics.median(times) / len(weights), kinds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench_projections.json")
    parser.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke test")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    d, nh, kh, inter, layers = (256, 512, 128, 768, 4) if args.small else (4096, 4096, 1024, 12288, 36)
    key = jax.random.key(0)
    dt = jnp.bfloat16

    def draw(*shape):
        nonlocal key
        key, sub = jax.random.split(key)
        return (jax.random.normal(sub, shape, jnp.float32) * 0.02).astype(dt)

    qkv = [(draw(d, nh), draw(d, kh), draw(d, kh)) for _ in range(layers)]
    gate_up = [(draw(d, inter), draw(d, inter)) for _ in range(layers)]
    variants = {
        "qkv_separate": (lambda x, w: jnp.concatenate([x @ w[0], x @ w[1], x @ w[2]], -1), qkv),
        "qkv_fused": (lambda x, w: x @ w, [jnp.concatenate(w, -1) for w in qkv]),
        "gate_up_separate": (lambda x, w: jax.nn.silu(x @ w[0]) * (x @ w[1]), gate_up),
        "gate_up_fused": (lambda x, w: (lambda gu: jax.nn.silu(gu[..., :inter]) * gu[..., inter:])(x @ w),
                          [jnp.concatenate(w, -1) for w in gate_up]),
    }
    nbytes = {"qkv": d * (nh + 2 * kh) * 2, "gate_up": d * 2 * inter * 2}
    results = []
    for rows in (1, 16):
        x = draw(rows, d)
        for name, (fn, weights) in variants.items():
            seconds, kinds = time_layers(fn, x, weights, args.reps)
            rate = nbytes[name.rsplit("_", 1)[0]] / seconds
            results.append(dict(rows=rows, variant=name, us_per_layer=seconds * 1e6, read_TBps=rate / 1e12,
                                kernels=kinds))
            print(json.dumps(results[-1]), flush=True)
    info = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}
    with open(args.out, "w") as f:
        json.dump(dict(versions=info, reps=args.reps, layers=layers, results=results), f, indent=1)
    print(f"\n{'M':>3} {'variant':<18} {'us/layer':>9} {'TB/s':>6} kernels")
    for r in results:
        print(f"{r['rows']:>3} {r['variant']:<18} {r['us_per_layer']:9.1f} {r['read_TBps']:6.2f} {','.join(r['kernels'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
