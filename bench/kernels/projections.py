"""A decoder layer's input projections on the GPU: separate matrices against fused ones.

    python -m bench.kernels.projections --out $OUT/projections.json
    python -m bench.kernels.projections --small --out /tmp/projections.json   # CPU smoke test

For M rows of the Qwen3-8B shape (`bench.shapes`: hidden 4096, 32 / 8 heads of 128,
intermediate 12288), bf16, over 36 layers' distinct weights (so every matrix streams from
HBM), times:
  - q, k, v as three products against one product with [Wq | Wk | Wv];
  - gate, up as two products (then silu(gate) * up) against one with [Wgate | Wup].
Reports us per layer, the achieved read rate, and the kind of kernel XLA chose for each
product (a "gemm" fusion, a cuBLAS call, or a reduce fusion), from the compiled HLO.
"""

from __future__ import annotations

import argparse
import json
import re

import jax
import jax.numpy as jnp

from bench import harness
from bench.shapes import QWEN3_8B, SMALL


def time_layers(fn, x, weights, reps):
    """Median seconds of one call of `fn` chained over every layer's weights."""

    @jax.jit
    def run(x, weights):
        for w in weights:  # unrolled, as the model's layers are: no slicing of stacked weights
            x = x + 1e-3 * fn(x, w)[..., : x.shape[-1]].astype(x.dtype)
        return x

    timing = harness.time_calls(lambda: run(x, weights), reps=reps, calls_per_sample=len(weights))
    kinds = sorted(set(re.findall(r"(gemm_fusion|__cublas\w*|input_reduce_fusion|triton_gemm)",
                                  run.lower(x, weights).compile().as_text())))
    return timing.median_s, kinds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_output_arguments(parser, out_default="projections.json")
    parser.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke test")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    record = harness.Record(__spec__.name, args, argv)
    model = SMALL if args.small else QWEN3_8B
    d, inter, layers = model["hidden_size"], model["intermediate_size"], model["num_hidden_layers"]
    nh, kh = (model[heads] * model["head_dim"] for heads in ("num_attention_heads", "num_key_value_heads"))
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
    record.write(dict(layers=layers, timings=results))
    print(f"\n{'M':>3} {'variant':<18} {'us/layer':>9} {'TB/s':>6} kernels")
    for r in results:
        print(f"{r['rows']:>3} {r['variant']:<18} {r['us_per_layer']:9.1f} {r['read_TBps']:6.2f} {','.join(r['kernels'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
