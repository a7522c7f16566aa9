"""Split-K products summed by the next norm: a layer's o- and down-products at batch 1 / 16
rows on the GPU, as XLA's product + the residual-add + RMSNorm kernel, against the product
as P partial sums (a batched product over P slices of the contraction, float32) that the
norm kernel adds up itself.

    python -m bench.kernels.split_products --out $OUT/split_products.json
    python -m bench.kernels.split_products --small --out /tmp/split.json   # CPU smoke test

At one row XLA splits the contraction of these products (N = 4096 outputs leave too few
tiles for 132 SMs) and sums the splits in a reduce kernel of its own before the norm reads
the result: 2 of them per layer, ~1.4 us each (bench/LOG.md). Over 36 layers' distinct
weights (every matrix streams from HBM), reports us per layer for (o-product + norm +
down-product + norm), the kernel kinds XLA compiled, and the largest difference from the
plain result.
"""

import argparse
import functools
import json
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bench import harness
from bench.shapes import QWEN3_8B, SMALL
from pallas_kernels.common import next_pow2, quiet_triton_deprecation
from pallas_kernels.rms_norm import add_rms_norm_pallas


def _norm_partials_kernel(x_ref, parts_ref, w_ref, sum_ref, out_ref, *, dim, block_d, size, parts, eps):
    cols = jnp.arange(block_d)
    ok = cols < dim
    at = pl.program_id(0) * dim + cols
    delta = plgpu.load(parts_ref.at[at], mask=ok, other=0)
    for p in range(1, parts):
        delta += plgpu.load(parts_ref.at[p * size + at], mask=ok, other=0)
    x = plgpu.load(x_ref.at[at], mask=ok, other=0) + delta.astype(x_ref.dtype)
    x32 = x.astype(jnp.float32)
    normed = (x32 * lax.rsqrt(jnp.sum(x32 * x32) / dim + eps)).astype(x.dtype)
    dest = jnp.where(ok, at, size)
    plgpu.store(sum_ref.at[dest], x, mask=ok)
    plgpu.store(out_ref.at[dest], (plgpu.load(w_ref.at[cols], mask=ok, other=0) * normed).astype(out_ref.dtype),
                mask=ok)


def add_rms_norm_partials(x_TD, parts_PTD, weight_D, eps, interpret):
    """(x + sum of partials, its RMSNorm times weight): a prototype of the fused kernel."""
    T, D = x_TD.shape
    P = parts_PTD.shape[0]
    if not interpret:
        quiet_triton_deprecation()
    block_d = next_pow2(D)
    outs = pl.pallas_call(
        functools.partial(_norm_partials_kernel, dim=D, block_d=block_d, size=T * D, parts=P, eps=eps),
        out_shape=[jax.ShapeDtypeStruct((T * D,), x_TD.dtype), jax.ShapeDtypeStruct((T * D,), x_TD.dtype)],
        grid=(T,), interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4 if block_d <= 2048 else 8, num_stages=1),
        name="add_rms_norm_partials",
    )(x_TD.reshape(-1), parts_PTD.reshape(-1), weight_D)
    return outs[0].reshape(T, D), outs[1].reshape(T, D)


def partial_products(x_TK, w_KN, parts):
    """[P, T, N] float32: x's contraction cut into P slices, one batched product."""
    T, K = x_TK.shape
    x_TPk = x_TK.reshape(T, parts, K // parts)
    w_PkN = w_KN.reshape(parts, K // parts, w_KN.shape[1])
    return lax.dot_general(x_TPk, w_PkN, (((2,), (1,)), ((1,), (0,))), preferred_element_type=jnp.float32)


def layer_fn(parts, interpret):
    """One layer's o-product + norm + down-product + norm, the way the model chains them."""
    def run(x, h, w_o, w_down, g):
        if parts == 1:
            x, h = add_rms_norm_pallas(x, h @ w_o, g, 1e-6, interpret=interpret)
            x, h = add_rms_norm_pallas(x, jnp.tile(h, (1, 3)) @ w_down, g, 1e-6, interpret=interpret)
        else:
            x, h = add_rms_norm_partials(x, partial_products(h, w_o, parts), g, 1e-6, interpret)
            x, h = add_rms_norm_partials(x, partial_products(jnp.tile(h, (1, 3)), w_down, parts), g, 1e-6, interpret)
        return x, h
    return run


def time_layers(fn, x, weights, g, reps):
    @jax.jit
    def chain(x, weights, g):
        h = x
        for w_o, w_down in weights:
            x, h = fn(x, h, w_o, w_down, g)
        return x, h

    timing = harness.time_calls(lambda: chain(x, weights, g), reps=reps, calls_per_sample=len(weights))
    text = chain.lower(x, weights, g).compile().as_text()
    kinds = {k: len(re.findall(k, text)) for k in ("gemm_fusion", "__cublas", "reduce_fusion", "custom-call")}
    return timing.median_s, kinds, chain(x, weights, g)[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_output_arguments(parser, out_default="split_products.json")
    parser.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke test")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--parts", default="1,2,4,8")
    args = parser.parse_args(argv)
    record = harness.Record(__spec__.name, args, argv)
    interpret = jax.default_backend() != "gpu"
    model = SMALL if args.small else QWEN3_8B
    d, layers = model["hidden_size"], model["num_hidden_layers"]
    key = jax.random.key(0)
    keys = jax.random.split(key, 2 * layers + 2)
    dt = jnp.bfloat16
    weights = [((0.02 * jax.random.normal(keys[2 * i], (d, d))).astype(dt),
                (0.02 * jax.random.normal(keys[2 * i + 1], (3 * d, d))).astype(dt)) for i in range(layers)]
    g = jnp.ones((d,), dt)
    results = []
    for rows in (1, 16):
        x = jax.random.normal(keys[-1], (rows, d)).astype(dt)
        base = None
        for parts in (int(p) for p in args.parts.split(",")):
            seconds, kinds, out = time_layers(layer_fn(parts, interpret), x, weights, g, args.reps)
            base = out if base is None else base
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - base.astype(jnp.float32))))
            results.append(dict(rows=rows, parts=parts, us_per_layer=seconds * 1e6, kernels=kinds, max_abs_diff=err))
            print(json.dumps(results[-1]), flush=True)
    record.write(dict(layers=layers, timings=results))
    print(f"\n{'M':>3} {'parts':>5} {'us/layer':>9} {'max diff':>9} kernels")
    for r in results:
        print(f"{r['rows']:>3} {r['parts']:>5} {r['us_per_layer']:9.1f} {r['max_abs_diff']:9.3g} {r['kernels']}")


if __name__ == "__main__":
    main()
