"""Top-k / top-p truncation on the GPU: thresholds (the runtime's path) against a full sort.

    python -m bench.kernels.sampling --out $OUT/sampling.json
    python -m bench.kernels.sampling --small --out /tmp/sampling.json   # CPU smoke test

For R rows of V = 151936 (Qwen3, `bench.shapes`) random logits at temperature 0.7, times
`processed_probs` with every row at top-p 0.9, at top-k 50, and at top-k 16 (the TopK fast
path), and the masks alone: `threshold_truncation_mask` at 1, 2, 4 and 8 threshold bits per
pass against the full-sort `truncation_mask(..., vocab)` (which also checks that both keep
the same tokens). Medians of --reps runs of a jitted chain of --chain calls, per call.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from bench.shapes import QWEN3_8B, SMALL
from dflash_jax import sampling


def time_chain(fn, logits, reps, chain):
    """Median seconds per call of `chain` dependent calls in one jitted program."""
    @jax.jit
    def chained(x):
        out = jnp.zeros((), jnp.float32)
        for _ in range(chain):
            out = out + fn(harness.after(x, out)).astype(jnp.float32).sum()
        return out

    return harness.time_calls(lambda: chained(logits), reps=reps, warmup=2, calls_per_sample=chain).median_s


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_output_arguments(parser, out_default="sampling.json")
    parser.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke test")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--chain", type=int, default=10)
    args = parser.parse_args(argv)
    record = harness.Record(__spec__.name, args, argv)
    vocab, row_counts = (SMALL["vocab_size"], (4,)) if args.small else (QWEN3_8B["vocab_size"], (8, 32, 256))
    rng = np.random.default_rng(0)
    results = []
    for rows in row_counts:
        logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32) * 3)
        temperature = jnp.full((rows,), 0.7, jnp.float32)
        row = dict(rows=rows, vocab=vocab)
        for name, top_k, top_p in (("top_p_0.9", 0, 0.9), ("top_k_50", 50, 1.0), ("top_k_16", 16, 1.0)):
            k, p = jnp.full((rows,), top_k, jnp.int32), jnp.full((rows,), top_p, jnp.float32)
            row[f"processed_probs_{name}_us"] = 1e6 * time_chain(
                lambda x, k=k, p=p: sampling.processed_probs(x, temperature, k, p), logits, args.reps, args.chain)
        # The masks alone, at top-k 50 and top-p 0.9 together.
        scores = logits / 0.7
        k, p, use_p = jnp.full((rows,), 50, jnp.int32), jnp.full((rows,), 0.9, jnp.float32), jnp.ones((rows,), bool)
        full_sort = jax.jit(lambda s: sampling.truncation_mask(s, jax.nn.softmax(s, -1), k, p, use_p, vocab))
        row["full_sort_mask_us"] = 1e6 * time_chain(full_sort, scores, args.reps, args.chain)
        row["same_tokens_kept"] = True
        for bits in (1, 2, 4, 8):  # bits per pass
            threshold = jax.jit(lambda s, bits=bits: sampling.threshold_truncation_mask(
                s, jax.nn.softmax(s, -1), k, p, use_p, digit_bits=bits))
            row["same_tokens_kept"] &= bool(np.array_equal(threshold(scores), full_sort(scores)))
            row[f"threshold_mask_{bits}bit_us"] = 1e6 * time_chain(threshold, scores, args.reps, args.chain)
        row["threshold_mask_us"] = row[f"threshold_mask_{sampling.threshold_digit_bits(rows)}bit_us"]
        results.append(row)
        print(json.dumps(row), flush=True)
    record.write(dict(timings=results))
    print(f"\n{'R':>4} {'top-p us':>9} {'top-k50 us':>10} {'top-k16 us':>10} {'mask us by bits/pass 1/2/4/8':>29} "
          f"{'mask sort us':>12} same")
    for r in results:
        by_bits = "/".join(f"{r[f'threshold_mask_{bits}bit_us']:.0f}" for bits in (1, 2, 4, 8))
        print(f"{r['rows']:>4} {r['processed_probs_top_p_0.9_us']:9.0f} {r['processed_probs_top_k_50_us']:10.0f} "
              f"{r['processed_probs_top_k_16_us']:10.0f} {by_bits:>29} {r['full_sort_mask_us']:12.0f} "
              f"{r['same_tokens_kept']}")
    return 0 if all(r["same_tokens_kept"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
