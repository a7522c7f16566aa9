"""XLA CPU product speed by dtype and row count: why `layers.dot_general` runs a bfloat16
product on CPU with a float32 result and a single row as two.

    python -m bench.kernels.cpu_products [--layers 30] [--reps 11] [--out J]

Times, per row count M, a jitted chain over `--layers` distinct [576, 3072] matrices
(SmolLM2-135M's fused gate/up product, `bench.shapes`; distinct, so every matrix streams
from memory): float32; bfloat16 x bfloat16 with a bfloat16 result (what `lax.dot_general`
gives); with a float32 result; and `layers.dot_general` (float32 result, one row run as
two). Medians, ms per chain.
"""

import argparse

import jax
import jax.numpy as jnp

from bench import harness
from bench.kernels.projections import time_layers
from bench.shapes import SMOLLM2_135M
from dflash_jax.layers import dot_general

NN = (((1,), (0,)), ((), ()))
VARIANTS = {
    "float32": (jnp.float32, lambda x, w: jax.lax.dot_general(x, w, NN)),
    "bf16 -> bf16": (jnp.bfloat16, lambda x, w: jax.lax.dot_general(x, w, NN)),
    "bf16 -> f32": (jnp.bfloat16, lambda x, w: jax.lax.dot_general(x, w, NN, preferred_element_type=jnp.float32)),
    "layers.dot_general bf16": (jnp.bfloat16, lambda x, w: dot_general(x, w, NN)),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_output_arguments(parser)
    parser.add_argument("--layers", type=int, default=SMOLLM2_135M["num_hidden_layers"])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--rows", default="1,2,4,8,16")
    args = parser.parse_args(argv)
    record = harness.Record(__spec__.name, args, argv)
    hidden, width = SMOLLM2_135M["hidden_size"], 2 * SMOLLM2_135M["intermediate_size"]
    keys = jax.random.split(jax.random.key(0), args.layers)
    weights32 = [0.02 * jax.random.normal(k, (hidden, width), jnp.float32) for k in keys]
    weights = {jnp.float32: weights32, jnp.bfloat16: [w.astype(jnp.bfloat16) for w in weights32]}
    print(f"{record.env['device']}, jax {jax.__version__}, {args.layers} x [{hidden}, {width}], ms per chain")
    print(f"{'rows':>4} " + " ".join(f"{name:>24}" for name in VARIANTS))
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        cells = []
        for dtype, product in VARIANTS.values():
            x = jnp.ones((rows, hidden), dtype)
            seconds_per_layer, _ = time_layers(product, x, weights[dtype], args.reps)
            cells.append(seconds_per_layer * args.layers * 1e3)
        print(f"{rows:>4} " + " ".join(f"{ms:24.2f}" for ms in cells), flush=True)
        results.append(dict(rows=rows, ms_per_chain=dict(zip(VARIANTS, cells))))
        record.write(results)


if __name__ == "__main__":
    main()
