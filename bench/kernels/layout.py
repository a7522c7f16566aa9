"""DFlash layout on the GPU: check the Pallas (Triton-lowered) and jax-triton kernels
against the jnp reference on random batches, then time all three.

    python -m bench.kernels.layout --out $OUT/layout.json     # the log goes beside it (.log)

Timings per call, median: ``sync`` is one call plus block_until_ready (what a host loop
sees, dispatch included); ``queued`` is 50 calls enqueued back to back, then one sync,
divided by 50; ``device`` is 50 calls inside one jitted, unrolled fori_loop (no
while-loop round trips), so host dispatch is out of it (an optimisation barrier on (inputs, previous outputs) keeps the calls in
sequence and stops XLA from hoisting or merging them; nothing is dead).
"""

import argparse
import dataclasses
import json
import time
import warnings

# jax 0.11 warns that Pallas' Triton backend is deprecated; it still works.
warnings.filterwarnings("ignore", message=".*[Tt]riton.*", category=DeprecationWarning)
warnings.filterwarnings("ignore", message=".*[Tt]riton.*", category=FutureWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from bench import harness  # noqa: E402
from bench.shapes import QWEN3_8B_DRAFTER  # noqa: E402
from pallas_kernels.dflash_layout import DFlashLayout, prepare_dflash_inputs  # noqa: E402

MASK = QWEN3_8B_DRAFTER["dflash_config"]["mask_token_id"]
FIELDS = [f.name for f in dataclasses.fields(DFlashLayout)]


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    max_num_reqs: int
    num_steps: int
    block_size: int
    max_blocks: int
    num_target_rows: int
    max_num_tokens: int
    max_model_len: int
    cp_size: int = 1
    cp_interleave: int = 1

    def static_kwargs(self):
        return dict(block_size=self.block_size, parallel_drafting_token_id=MASK,
                    num_speculative_steps=self.num_steps, max_num_reqs=self.max_num_reqs,
                    max_num_tokens=self.max_num_tokens, max_model_len=self.max_model_len,
                    cp_size=self.cp_size, cp_interleave=self.cp_interleave)


def random_batch(rng, shape, num_reqs, chunk_lens=None, prefill_share=0.3):
    """Verify requests (1 + N rows, 0..N rejected) and prefill chunks, then padding rows.

    chunk_lens fixes every request's row count (all prefill chunks) instead."""
    Q, L, T = shape.num_steps + 1, shape.max_model_len, shape.num_target_rows
    starts, positions, rejected, sampled = [0], [], [], []
    for r in range(num_reqs):
        budget = T - starts[-1] - (num_reqs - r - 1)
        if chunk_lens is not None:
            n, rej, smp = chunk_lens[r], 0, 0
        elif rng.random() < prefill_share:
            n = int(rng.integers(1, max(1, min(budget, 4 * Q)) + 1))
            rej, smp = 0, int(rng.random() < 0.3)
        else:
            n = min(Q, budget)
            rej, smp = int(rng.integers(0, n)), 1
        first = int(rng.integers(max(0, L - n - 2 * Q) if rng.random() < 0.2 else 0, L - n + 1))
        positions += range(first, first + n)
        starts.append(starts[-1] + n)
        rejected.append(rej)
        sampled.append(smp)
    positions += list(rng.integers(0, L, T - len(positions)))
    table = rng.integers(1, 1 << 20, (num_reqs, shape.max_blocks))
    table[rng.random(table.shape) < 0.1] = 0
    MR = shape.max_num_reqs
    i32 = np.int32
    return dict(
        target_positions=np.asarray(positions, i32),
        target_query_start_loc=np.asarray(starts, i32),
        idx_mapping=rng.permutation(MR)[:num_reqs].astype(i32),
        last_sampled=rng.integers(0, 150000, MR).astype(i32),
        next_prefill_tokens=rng.integers(0, 150000, MR).astype(i32),
        num_sampled=np.asarray(sampled, i32), num_rejected=np.asarray(rejected, i32),
        temperature=rng.random(MR).astype(np.float32),
        seeds=rng.integers(0, 2**31 - 1, MR).astype(i32),
        block_table=table.astype(i32))


@jax.jit
def _touch_one_input(batch):
    return batch["target_positions"] + 1


def layout_fn(impl, shape):
    if impl == "floor":  # a one-fusion jitted call on the same inputs: the dispatch floor
        return lambda batch, cp_rank=0: _touch_one_input(batch)
    kwargs = shape.static_kwargs()
    return lambda batch, cp_rank=0: prepare_dflash_inputs(**batch, **kwargs, cp_rank=cp_rank,
                                                          impl=impl)


def check(impls, rng, log, num_batches):
    """Each kernel equals the reference on num_batches random batches."""
    cases = [  # (shape, request counts, chunk lengths, share of the batches)
        (Shape("verify", 256, 15, 16, 64, 4096, 4096 + 64, 4096), [1, 32, 256], None, 0.6),
        (Shape("prefill8192", 256, 15, 16, 1024, 8192 + 64, 4096 + 64, 16384), [1, 4],
         "chunk8192", 0.2),
        (Shape("cp2_i4", 64, 7, 64, 16, 1024, 512 + 16, 2048, cp_size=2, cp_interleave=4),
         [1, 17, 64], None, 0.2),
    ]
    mismatches = {impl: 0 for impl in impls}
    counts = {impl: 0 for impl in impls}
    for shape, request_counts, chunks, share in cases:
        fns = {impl: layout_fn(impl, shape) for impl in ["reference", *impls]}
        for i in range(int(num_batches * share)):
            num_reqs = request_counts[i % len(request_counts)]
            chunk_lens = None
            if chunks == "chunk8192":
                chunk_lens = [8192] + [int(n) for n in rng.integers(1, 16, num_reqs - 1)]
            batch = random_batch(rng, shape, num_reqs, chunk_lens)
            cp_rank = int(rng.integers(0, shape.cp_size))
            want = jax.device_get(fns["reference"](batch, cp_rank))
            for impl in impls:
                got = jax.device_get(fns[impl](batch, cp_rank))
                counts[impl] += 1
                bad = [f for f in FIELDS if not np.array_equal(getattr(got, f), getattr(want, f))]
                if bad:
                    mismatches[impl] += 1
                    if mismatches[impl] <= 5:
                        log(f"MISMATCH {impl} {shape.name} reqs={num_reqs} fields={bad}")
    for impl in impls:
        log(f"check {impl}: {counts[impl]} batches, {mismatches[impl]} mismatches")
    return mismatches


def timing_shapes():
    """(label, shape, num_reqs, chunk lengths or None for verify)."""
    out = []
    for kind in ("verify", "prefill"):
        for num_reqs in (1, 32, 256):
            if kind == "verify":
                rows, chunks = num_reqs * 16, None
            else:
                rows, chunks = 8192, [8192 // num_reqs] * num_reqs
            shape = Shape(f"{kind}-{num_reqs}", 256, 15, 16, 1024, rows, 256 * 16, 16384)
            out.append((shape, num_reqs, chunks))
    return out


def time_impl(fn, batch, reps, chain=50):
    """Median microseconds per call: (sync, queued, device), as the module docstring says."""
    args = jax.device_put(batch)
    sync = harness.time_calls(lambda: fn(args), reps=reps)
    queued = harness.time_calls(lambda: [fn(args) for _ in range(chain)], reps=max(3, reps // chain), warmup=0,
                                calls_per_sample=chain)

    @jax.jit
    def chained(args):
        def body(i, layout):
            return fn(harness.after(args, layout))  # in order, none of them dead
        init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, args))
        return lax.fori_loop(0, chain, body, init, unroll=True)

    device = harness.time_calls(lambda: chained(args), reps=max(3, reps // chain), calls_per_sample=chain)
    return tuple(1e6 * timing.median_s for timing in (sync, queued, device))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_output_arguments(parser, out_default="layout.json")
    parser.add_argument("--batches", type=int, default=1000, help="random batches checked")
    parser.add_argument("--reps", type=int, default=300, help="timed calls per measure")
    args = parser.parse_args(argv)
    record = harness.Record(__spec__.name, args, argv, packages=("triton", "jax-triton"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(args.out.with_suffix(".log"), "w")

    def log(line):
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    log(json.dumps(record.env))
    impls = ["pallas"]
    if record.env["jax-triton"] != "unavailable":
        impls.append("triton")
    rng = np.random.default_rng(0)
    t0 = time.time()
    mismatches = check(impls, rng, log, args.batches)
    log(f"check took {time.time() - t0:.1f} s")

    rows = []
    for shape, num_reqs, chunks in timing_shapes():
        batch = random_batch(rng, shape, num_reqs, chunks, prefill_share=0.0)
        for impl in ["reference", *impls, "floor"]:
            sync, queued, device = time_impl(layout_fn(impl, shape), batch, args.reps)
            rows.append(dict(shape=shape.name, impl=impl, sync_us=sync, queued_us=queued,
                             device_us=device))
            log(json.dumps(rows[-1]))
    record.write(dict(mismatches=mismatches, timings=rows))

    log("\nshape        impl       sync_us  queued_us  device_us  device/ref")
    log("(floor: one elementwise fusion jitted on the same inputs, for scale)")
    ref = {r["shape"]: r for r in rows if r["impl"] == "reference"}
    for r in rows:
        ratio = r["device_us"] / ref[r["shape"]]["device_us"]
        log(f"{r['shape']:<12} {r['impl']:<9} {r['sync_us']:8.1f} {r['queued_us']:10.1f} "
            f"{r['device_us']:10.1f} {ratio:10.2f}")
    log(f"mismatches: {mismatches}")


if __name__ == "__main__":
    main()
