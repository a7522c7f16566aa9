"""A DFlash 2 selector's candidates: the top 16 of each block position's logits over the
vocabulary. XLA's top-k against exact two-stage candidates, per call in a jitted loop of
calls that each depend on the last; each variant is checked equal to `lax.top_k` (values and
indices, ties to the lower index) on the timed input.

    python -m bench.kernels.top_k --out $OUT/top_k.json
    python -m bench.kernels.top_k --small --out /tmp/top_k.json   # CPU smoke test

Variants:
  lax.top_k      what the selector runs;
  sliced C       each of C slices' top k, then the top k of their winners (slices of k or more);
  chunk-max C    (C >= k) `dflash_jax.top_k.chunk_max_top_k`: each of C slices' maximum, the
                 k slices with the largest maxima, in index order, to one top-k (what the
                 DFlash 2 selector runs at large vocabularies).
"""

from __future__ import annotations

import argparse
import functools
import json

from bench import harness


def _slices(x_NV, chunks: int):
    """x's last axis as [chunks, width], padded with -inf, and the width."""
    import jax.numpy as jnp

    V = x_NV.shape[-1]
    width = -(-V // chunks)
    padded = jnp.pad(x_NV, [(0, 0)] * (x_NV.ndim - 1) + [(0, chunks * width - V)], constant_values=-jnp.inf)
    return padded.reshape(*x_NV.shape[:-1], chunks, width), width


def sliced_top_k(x_NV, k: int, chunks: int):
    import jax
    import jax.numpy as jnp

    slices, width = _slices(x_NV, chunks)
    values, local = jax.lax.top_k(slices, k)
    index = local + (jnp.arange(chunks, dtype=local.dtype) * width)[:, None]
    lead = x_NV.shape[:-1]
    top, picked = jax.lax.top_k(values.reshape(*lead, chunks * k), k)
    return top, jnp.take_along_axis(index.reshape(*lead, chunks * k), picked, axis=-1)


def main(argv=None):
    import jax
    import jax.numpy as jnp

    from dflash_jax.top_k import chunk_max_top_k

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_output_arguments(parser, out_default="top_k.json")
    parser.add_argument("--small", action="store_true", help="small shapes: a CPU smoke test")
    parser.add_argument("--shapes", default="16x49152,16x151936,256x151936", help="rows x vocabulary, comma separated")
    parser.add_argument("--sliced", default="32,512", help="slice counts of the sliced variant")
    parser.add_argument("--chunk-max", default="256,1024,4096", help="slice counts of the chunk-max variant")
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--loop", type=int, default=20, help="calls per timed sample")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    record = harness.Record(__spec__.name, args, argv)
    if args.small:
        args.shapes, args.sliced, args.chunk_max = "4x4096", "32", "64,256"
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    variants = {"lax.top_k": functools.partial(jax.lax.top_k, k=args.k)}
    variants |= {f"sliced {c}": functools.partial(sliced_top_k, k=args.k, chunks=int(c)) for c in args.sliced.split(",")}
    variants |= {f"chunk-max {c}": functools.partial(chunk_max_top_k, k=args.k, chunks=int(c))
                 for c in args.chunk_max.split(",")}
    results = []
    for rows, vocab in shapes:
        x = jax.random.normal(jax.random.key(0), (rows, vocab), jnp.float32).round(1)  # ties, as bf16 logits have
        expected = jax.lax.top_k(x, args.k)
        for name, top_k in variants.items():
            same = all(bool(jnp.array_equal(a, b)) for a, b in zip(top_k(x), expected))

            @jax.jit
            def loop(x, top_k=top_k):
                def body(_, x):
                    values, _ = top_k(x)
                    return x.at[0, 0].add(values[0, -1] * 0)  # each call waits for the last
                return jax.lax.fori_loop(0, args.loop, body, x)

            timing = harness.time_calls(lambda: loop(x), reps=args.reps, calls_per_sample=args.loop)
            results.append(dict(rows=rows, vocab=vocab, variant=name, us=timing.median_s * 1e6, same_as_lax=same))
            print(json.dumps(results[-1]), flush=True)
    record.write(dict(k=args.k, timings=results))
    print(f"\n{'rows':>5} {'vocab':>7} {'variant':<15} {'us':>8} same")
    for r in results:
        print(f"{r['rows']:>5} {r['vocab']:>7} {r['variant']:<15} {r['us']:8.1f} {r['same_as_lax']}")


if __name__ == "__main__":
    main()
