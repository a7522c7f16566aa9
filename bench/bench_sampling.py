"""Top-k / top-p truncation on the GPU: thresholds (the runtime's path) against a full sort.

    python bench/bench_sampling.py --out $OUT/sampling.json
    python bench/bench_sampling.py --small --out /tmp/sampling.json   # CPU smoke test

For R rows of V = 151936 (Qwen3) random logits at temperature 0.7, times `processed_probs`
with every row at top-p 0.9, at top-k 50, and at top-k 16 (the TopK fast path), and the
masks alone: `_threshold_truncation_mask` at 1, 2, 4 and 8 threshold bits per pass
against the full-sort `_truncation_mask(..., vocab)` (which also checks that both keep the
same tokens). Medians of
--reps runs of a jitted chain of --chain calls, per call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dflash_jax import sampling  # noqa: E402


def time_chain(fn, logits, reps, chain):
    """Median seconds per call of `chain` dependent calls in one jitted program."""
    @jax.jit
    def chained(x):
        out = jnp.zeros((), jnp.float32)
        for _ in range(chain):
            x = lax.optimization_barrier((x, out))[0]
            out = out + fn(x).astype(jnp.float32).sum()
        return out

    for _ in range(2):
        jax.block_until_ready(chained(logits))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(chained(logits))
        samples.append((time.perf_counter() - t0) / chain)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench_sampling.json")
    parser.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke test")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--chain", type=int, default=10)
    args = parser.parse_args()
    vocab, row_counts = (1000, (4,)) if args.small else (151936, (8, 32, 256))
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
        full_sort = jax.jit(lambda s: sampling._truncation_mask(s, jax.nn.softmax(s, -1), k, p, use_p, vocab))
        row["full_sort_mask_us"] = 1e6 * time_chain(full_sort, scores, args.reps, args.chain)
        runtime_policy = sampling.threshold_digit_bits
        row["same_tokens_kept"] = True
        for bits in (1, 2, 4, 8):  # bits per pass; traced under each setting, then restored
            sampling.threshold_digit_bits = lambda rows, bits=bits: bits
            threshold = jax.jit(lambda s: sampling._threshold_truncation_mask(s, jax.nn.softmax(s, -1), k, p, use_p))
            row["same_tokens_kept"] &= bool(np.array_equal(threshold(scores), full_sort(scores)))
            row[f"threshold_mask_{bits}bit_us"] = 1e6 * time_chain(threshold, scores, args.reps, args.chain)
        sampling.threshold_digit_bits = runtime_policy
        row["threshold_mask_us"] = row[f"threshold_mask_{runtime_policy(rows)}bit_us"]
        results.append(row)
        print(json.dumps(row), flush=True)
    info = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}
    with open(args.out, "w") as f:
        json.dump(dict(versions=info, reps=args.reps, chain=args.chain, results=results), f, indent=1)
    print(f"\n{'R':>4} {'top-p us':>9} {'top-k50 us':>10} {'top-k16 us':>10} {'mask us by bits/pass 1/2/4/8':>29} "
          f"{'mask sort us':>12} same")
    for r in results:
        by_bits = "/".join(f"{r[f'threshold_mask_{bits}bit_us']:.0f}" for bits in (1, 2, 4, 8))
        print(f"{r['rows']:>4} {r['processed_probs_top_p_0.9_us']:9.0f} {r['processed_probs_top_k_50_us']:10.0f} "
              f"{r['processed_probs_top_k_16_us']:10.0f} {by_bits:>29} {r['full_sort_mask_us']:12.0f} "
              f"{r['same_tokens_kept']}")
    return 0 if all(r["same_tokens_kept"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
