"""Paged attention on the GPU: the jnp reference against the Pallas kernel at Qwen3-8B
attention shapes (32 query heads, 8 kv heads, head_dim 128, bf16, pages of 16, causal; or
another model's heads with --model), batch 1 / 8 / 32 (--batches) x context 1k / 8k (--contexts) x 1 or
16 query rows per request.

    python -m bench.kernels.paged_attention --out $OUT/paged_attention.json
    python -m bench.kernels.paged_attention --small --out /tmp/pa.json     # CPU smoke test

Each point checks the kernel against the reference (max abs error, bf16 both) and then
times, per call, the median over --reps runs of a jitted chain of --chain calls (after a
warm-up): inside one program, so host dispatch is out of it; each call's query depends on
the previous call's output (`harness.after`), so calls run one after another and none is
dead. The calls cycle through enough K/V cache copies (at least --min-cache-mb in all)
that L2 (50 MB on an H200) does not hold the keys between calls, as in a real model where
every layer has its own cache.

Floor: the bytes a call must move (each visible key and value read once, queries read and
outputs written once) over the device copy rate measured on the H200 (4.24 TB/s, see
shared/ENVIRONMENT.md); ``GB/s`` is those bytes over the measured time.

``pallas_split`` runs the kernel with the key splits (flash-decoding) that the runtime picks
for the step (`default_kv_splits`), where that is more than one.
"""

import argparse
import json
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from bench.shapes import MODELS, SMALL
from dflash_jax.config import LayerAttention
from pallas_kernels.common import TRITON_DEPRECATION
from pallas_kernels.paged_attention import (
    default_block_k,
    default_block_q,
    default_kv_splits,
    paged_attention_pallas,
    query_blocks,
)
from pallas_kernels.paged_attention_reference import paged_attention_reference as paged_attention

# jax 0.11 warns at each Triton-backend lowering that the backend is deprecated; it works.
warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)

COPY_BYTES_PER_S = 4.24e12   # H200 device copy, read + write counted (ENVIRONMENT.md)
CAUSAL = LayerAttention(True)


def shapes(small, model="qwen3-8b", side="target"):
    """(num_heads, num_kv_heads, head_dim, page_size, batches, contexts, query rows) of `model`'s
    target or drafter (`side`)."""
    config = SMALL if small else getattr(MODELS[model], side)
    heads = (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"], 16)
    if small:
        return *heads, (1, 2), (64, 128), (1, 4)
    return *heads, (1, 8, 32), (1024, 8192), (1, 16)


def make_point(rng, batch, context, rows, num_heads, num_kv_heads, head_dim, page_size,
               min_cache_bytes, dtype=jnp.bfloat16):
    """Inputs of one point: `rows` queries per request at the last positions of `context`
    keys, pages scattered at random, and several K/V cache copies to cycle through."""
    pages_per_req = -(-context // page_size)
    num_pages = 1 + batch * pages_per_req            # page 0 is the null page
    table = rng.permutation(np.arange(1, num_pages)).reshape(batch, pages_per_req)
    num_tokens = batch * rows
    q_req = np.repeat(np.arange(batch), rows).astype(np.int32)
    q_pos = np.tile(np.arange(context - rows, context), batch).astype(np.int32)
    cache_shape = (num_pages * page_size, num_kv_heads, head_dim)
    cache_bytes = 2 * math.prod(cache_shape) * jnp.dtype(dtype).itemsize
    copies = max(1, min(64, -(-min_cache_bytes // cache_bytes)))
    key = jax.random.key(int(rng.integers(1 << 31)))
    keys = jax.random.split(key, 2 * copies + 1)
    q = jax.random.normal(keys[0], (num_tokens, num_heads, head_dim), jnp.float32).astype(dtype)
    caches = [(jax.random.normal(keys[1 + 2 * i], cache_shape, jnp.float32).astype(dtype),
               jax.random.normal(keys[2 + 2 * i], cache_shape, jnp.float32).astype(dtype))
              for i in range(copies)]
    visible_bytes = 2 * batch * context * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
    io_bytes = 2 * q.size * q.dtype.itemsize + table.size * 4
    return dict(q=q, q_pos=jnp.asarray(q_pos), q_req=jnp.asarray(q_req),
                table=jnp.asarray(table, jnp.int32),
                seq_lens=jnp.full((batch,), context, jnp.int32), caches=caches,
                bytes=visible_bytes + io_bytes, copies=copies)


def attention_fn(impl, page_size, kv_splits=1):
    if impl == "reference":
        return lambda q, pos, req, k, v, table, lens: paged_attention(
            q, pos, req, k, v, table, lens, page_size=page_size, rule=CAUSAL)
    return lambda q, pos, req, k, v, table, lens: paged_attention_pallas(
        q, pos, req, k, v, table, lens, page_size=page_size, rule=CAUSAL, kv_splits=kv_splits)


def time_fn(fn, point, reps, chain, blocks_q=None):
    """Median seconds per call of a jitted chain of `chain` calls over the cache copies.
    blocks_q: cut the query blocks once per chain with this block_q and pass them on."""
    copies = point["caches"]

    @jax.jit
    def chained(q, pos, req, caches, table, lens):
        extra = {} if blocks_q is None else dict(blocks=query_blocks(req, blocks_q))
        out = q
        for i in range(chain):
            k, v = caches[i % len(caches)]
            out = fn(harness.after(q, out), pos, req, k, v, table, lens, **extra)
        return out

    args = (point["q"], point["q_pos"], point["q_req"], tuple(copies), point["table"],
            point["seq_lens"])
    timing = harness.time_calls(lambda: chained(*args), reps=reps, warmup=3, calls_per_sample=chain)
    return timing.median_s, timing.min_s, timing.max_s


SWEEP_POINTS = ((1, 1024, 1), (1, 1024, 16), (1, 8192, 1), (8, 1024, 16), (32, 1024, 16))
SWEEP_SETTINGS = tuple(dict(block_k=k, kv_splits=s, num_stages=2, pages_ahead=False) for k in (32, 64, 128) for s in (1, 4, 8)) + (
    dict(block_k=None, kv_splits=1, num_stages=1), dict(block_k=None, kv_splits=1, num_stages=3))
# Batch-1 long-context settings (--contexts), for programs that wait on their loads (few
# programs over long rows): pipelined loads (stages 2-4, page ids a chunk ahead or not) at
# one program an SM, and unpipelined ones (stage 1: less shared memory) with more programs.
LONG_SWEEP_SETTINGS = (
    tuple(dict(block_k=k, kv_splits=32, num_stages=n, num_warps=4, pages_ahead=a)
          for k in (64, 128) for n in (2, 3) for a in (False, True))
    + tuple(dict(block_k=k, kv_splits=s, num_stages=1, num_warps=4, pages_ahead=a)
            for k in (64, 128) for s in (32, 64, 128) for a in (False, True))
    + tuple(dict(block_k=64, kv_splits=32, num_stages=n, num_warps=8, pages_ahead=a)
            for n in (3, 4) for a in (False, True))
    # 32-key chunks three or four stages deep: half the shared memory of 64, so two programs
    # share an SM at 64 splits
    + tuple(dict(block_k=32, kv_splits=s, num_stages=n, num_warps=4, pages_ahead=True) for s in (32, 64) for n in (3, 4))
    # query blocks of 8 tokens: a 16-row block as two programs of half the rows each (smaller
    # accumulators; the second reads its keys from L2 if the two run together)
    + tuple(dict(block_q=8, block_k=64, kv_splits=32, num_stages=n, num_warps=4, pages_ahead=True) for n in (2, 3)))

def sweep(rng, reps, chain, min_cache_bytes, model="qwen3-8b", contexts=None, side="target",
          query_rows=(1, 16)):
    """Kernel settings (block_k x kv_splits x num_stages) at the decode / verify points that
    dominate a cycle, with `model`'s heads; with `contexts`, the batch-1 points of
    `query_rows` rows at those contexts over `LONG_SWEEP_SETTINGS` instead. The query blocks are cut once
    per chain, as the runtime cuts them once per step, so each call times the kernel (and the
    split epilogue) alone."""
    num_heads, num_kv_heads, head_dim, page_size = shapes(False, model, side)[:4]
    group_pad = 1 << math.ceil(math.log2(num_heads // num_kv_heads))
    points, settings_list = SWEEP_POINTS, SWEEP_SETTINGS
    if contexts:
        points = tuple((1, context, rows) for context in contexts for rows in query_rows)
        settings_list = LONG_SWEEP_SETTINGS
    rows_out = []
    for batch, context, rows in points:
        point = make_point(rng, batch, context, rows, num_heads, num_kv_heads, head_dim, page_size,
                           min_cache_bytes)
        block_q = max(default_block_q(batch * rows, batch, num_heads // num_kv_heads), 16 // group_pad)
        k0, v0 = point["caches"][0]
        inputs = (point["q"], point["q_pos"], point["q_req"], k0, v0, point["table"], point["seq_lens"])
        want = np.asarray(jax.jit(attention_fn("reference", page_size))(*inputs).astype(jnp.float32))
        for settings in settings_list:
            kernel_settings = {name: value for name, value in settings.items() if name != "block_q"}
            setting_block_q = max(settings.get("block_q", block_q), 16 // group_pad)

            def fn(q, pos, req, k, v, table, lens, blocks=None, block_q=setting_block_q, kernel_settings=kernel_settings):
                return paged_attention_pallas(q, pos, req, k, v, table, lens, page_size=page_size, rule=CAUSAL,
                                              block_q=block_q, blocks=blocks, **kernel_settings)

            def with_blocks(q, pos, req, k, v, table, lens):
                return fn(q, pos, req, k, v, table, lens, blocks=query_blocks(req, setting_block_q))

            try:
                got = np.asarray(jax.jit(with_blocks)(*inputs).astype(jnp.float32))
                median, low, _ = time_fn(fn, point, reps, chain, blocks_q=setting_block_q)
                row = dict(batch=batch, context=context, query_rows=rows, **kernel_settings, block_q=setting_block_q,
                           us=1e6 * median,
                           us_min=1e6 * low, max_abs_err=float(np.max(np.abs(got - want))))
            except Exception as error:  # a setting Triton cannot compile: record it, go on
                row = dict(batch=batch, context=context, query_rows=rows, **settings,
                           error=f"{type(error).__name__}: {str(error)[:200]}")
            rows_out.append(row)
            print(json.dumps(row), flush=True)
        del point
    return rows_out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_output_arguments(parser, out_default="paged_attention.json")
    parser.add_argument("--small", action="store_true", help="tiny shapes: a CPU smoke test")
    parser.add_argument("--reps", type=int, default=None, help="timed chains per measure")
    parser.add_argument("--chain", type=int, default=None, help="calls per timed chain")
    parser.add_argument("--min-cache-mb", type=float, default=None,
                        help="K/V cache copies cycled through add up to at least this")
    parser.add_argument("--kv-splits", default="auto",
                        help="'auto' (the runtime's default_kv_splits), or a power of two for pallas_split")
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS), help="whose attention heads")
    parser.add_argument("--side", default="target", choices=("target", "drafter"),
                        help="the model's target heads or its drafter's (timed with the causal rule)")
    parser.add_argument("--contexts", default=None, help="contexts to time, comma separated (default 1024,8192); "
                        "with --sweep, batch-1 long-context settings at these contexts")
    parser.add_argument("--batches", default=None, help="batches to time, comma separated (default 1,8,32)")
    parser.add_argument("--rows", default="1,16", help="with --sweep --contexts: query rows per request, comma separated")
    parser.add_argument("--sweep", action="store_true",
                        help="time kernel settings at the points that dominate a cycle (GPU only)")
    args = parser.parse_args(argv)
    small = args.small
    reps = args.reps or (3 if small else 30)
    chain = args.chain or (2 if small else 10)
    min_cache_bytes = int((args.min_cache_mb or (0 if small else 256)) * 2**20)
    record = harness.Record(__spec__.name, args, argv, packages=("triton",))
    print(json.dumps(record.env), flush=True)
    num_heads, num_kv_heads, head_dim, page_size, batches, contexts, query_rows = shapes(small, args.model, args.side)
    contexts = tuple(int(c) for c in args.contexts.split(",")) if args.contexts else contexts
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else batches
    rng = np.random.default_rng(0)
    if args.sweep:
        rows = sweep(rng, reps, chain, min_cache_bytes, args.model,
                     tuple(int(c) for c in args.contexts.split(",")) if args.contexts else None, args.side,
                     tuple(int(r) for r in args.rows.split(",")))
        record.write(dict(reps=reps, chain=chain, model=args.model, sweep=rows))
        for r in rows:
            settings = (f"block_q={r.get('block_q', 'auto')} block_k={r['block_k']} S={r['kv_splits']} stages={r['num_stages']} "
                        f"warps={r.get('num_warps', 'auto')} ahead={int(r.get('pages_ahead', False))}")
            timing = f"{r['us']:8.1f} us (min {r['us_min']:.1f}) err {r['max_abs_err']:.1e}" if "us" in r else r["error"]
            print(f"B{r['batch']:<3} ctx {r['context']:<5} q{r['query_rows']:<3} {settings:<61} {timing}")
        return 0
    results = []
    for rows in query_rows:
        for batch in batches:
            for context in contexts:
                point = make_point(rng, batch, context, rows, num_heads, num_kv_heads, head_dim,
                                   page_size, min_cache_bytes)
                group = num_heads // num_kv_heads
                block_q = max(default_block_q(batch * rows, batch, group),
                              16 // (1 << math.ceil(math.log2(group))))
                block_k = default_block_k(block_q * (1 << math.ceil(math.log2(group))))
                if args.kv_splits != "auto":
                    splits = int(args.kv_splits)
                elif small:
                    splits = 2  # the smoke test runs the split path too
                else:
                    splits = default_kv_splits(batch * rows, batch, block_q, num_kv_heads)
                impls = {"reference": attention_fn("reference", page_size),
                         "pallas": attention_fn("pallas", page_size)}
                if splits > 1:
                    impls["pallas_split"] = attention_fn("pallas", page_size, splits)
                k0, v0 = point["caches"][0]
                inputs = (point["q"], point["q_pos"], point["q_req"], k0, v0, point["table"],
                          point["seq_lens"])
                want = np.asarray(jax.jit(impls["reference"])(*inputs).astype(jnp.float32))
                row = dict(batch=batch, context=context, query_rows=rows, block_q=block_q,
                           block_k=block_k, kv_splits=splits, bytes=point["bytes"],
                           cache_copies=point["copies"],
                           floor_us=1e6 * point["bytes"] / COPY_BYTES_PER_S)
                for name, fn in impls.items():
                    got = np.asarray(jax.jit(fn)(*inputs).astype(jnp.float32))
                    median, low, high = time_fn(fn, point, reps, chain)
                    row[f"{name}_us"] = 1e6 * median
                    row[f"{name}_us_min_max"] = [1e6 * low, 1e6 * high]
                    row[f"{name}_max_abs_err"] = float(np.max(np.abs(got - want)))
                    row[f"{name}_nan"] = bool(np.isnan(got).any())
                    row[f"{name}_GBps"] = point["bytes"] / median / 1e9
                results.append(row)
                print(json.dumps(row), flush=True)
                del point

    record.write(dict(reps=reps, chain=chain, min_cache_bytes=min_cache_bytes,
                      shapes=dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                  page_size=page_size, dtype="bfloat16", rule="causal"),
                      timings=results))

    print(f"\nper call, median of {reps} chains of {chain}; err = max |kernel - reference|")
    print(f"{'B':>3} {'ctx':>5} {'q':>3} {'floor_us':>9} {'ref_us':>9} {'pallas_us':>9} "
          f"{'x_ref':>6} {'GB/s':>6} {'err':>8} {'S':>3} {'split_us':>9} {'x_ref':>6} {'err':>8}")
    for r in results:
        split = (f"{r['kv_splits']:>3} {r['pallas_split_us']:9.1f} "
                 f"{r['reference_us'] / r['pallas_split_us']:6.2f} "
                 f"{r['pallas_split_max_abs_err']:8.1e}") if "pallas_split_us" in r else \
            f"{1:>3} {'-':>9} {'-':>6} {'-':>8}"
        print(f"{r['batch']:>3} {r['context']:>5} {r['query_rows']:>3} {r['floor_us']:9.1f} "
              f"{r['reference_us']:9.1f} {r['pallas_us']:9.1f} "
              f"{r['reference_us'] / r['pallas_us']:6.2f} {r['pallas_GBps']:6.0f} "
              f"{r['pallas_max_abs_err']:8.1e} {split}")
    bad = [r for r in results for name in ("pallas", "pallas_split")
           if f"{name}_max_abs_err" in r and (r[f"{name}_nan"] or r[f"{name}_max_abs_err"] > 0.05)]
    print(f"results: {args.out}; points over 0.05 max abs error or NaN: {len(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
