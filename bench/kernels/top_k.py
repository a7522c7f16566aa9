"""A DFlash 2 selector's candidates: the top 16 of each block position's logits over the
vocabulary, `lax.top_k` against `chunked_top_k` (per slice, then over the slices' winners),
per call in a jitted loop of calls that each depend on the last.

    python -m bench.kernels.top_k --out $OUT/top_k.json
    python -m bench.kernels.top_k --small --out /tmp/top_k.json   # CPU smoke test
"""

from __future__ import annotations

import argparse
import functools
import json

from bench import harness


def main(argv=None):
    import jax
    import jax.numpy as jnp

    from dflash_jax.models.dflash2 import chunked_top_k

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_output_arguments(parser, out_default="top_k.json")
    parser.add_argument("--small", action="store_true", help="small shapes: a CPU smoke test")
    parser.add_argument("--shapes", default="16x49152,16x151936,256x151936", help="rows x vocabulary, comma separated")
    parser.add_argument("--chunks", default="32,128,512")
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--loop", type=int, default=20, help="calls per timed sample")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    record = harness.Record(__spec__.name, args, argv)
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in ("4x4096" if args.small else args.shapes).split(",")]
    variants = {"lax.top_k": functools.partial(jax.lax.top_k, k=args.k)}
    variants |= {f"chunked {c}": functools.partial(chunked_top_k, k=args.k, chunks=int(c)) for c in args.chunks.split(",")}
    results = []
    for rows, vocab in shapes:
        x = jax.random.normal(jax.random.key(0), (rows, vocab), jnp.float32)
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
    print(f"\n{'rows':>5} {'vocab':>7} {'variant':<13} {'us':>8} same")
    for r in results:
        print(f"{r['rows']:>5} {r['vocab']:>7} {r['variant']:<13} {r['us']:8.1f} {r['same_as_lax']}")


if __name__ == "__main__":
    main()
