"""The routed experts' product on the GPU: how a MoE layer's cost grows with the tokens of a
step (decode 1 row, verify blocks of 4-16 rows, batches of them), three ways.

    python -m bench.kernels.moe_products --out $OUT/moe_products.json
    python -m bench.kernels.moe_products --small --out /tmp/moe.json   # CPU smoke test

For the experts of one sparse layer of `--model` (Qwen3-30B-A3B: 128 experts of [2048 ->
2 x 768 -> 2048], top 8; gpt-oss-20b: 32 of [2880 -> 2 x 2880 -> 2880], top 4), M tokens
each routed to top_k distinct random experts, chained over `--copies` layers' distinct
weights (so every expert streams from HBM), times:
  - ragged: `dflash_jax.experts.experts_product`'s reference (XLA's `ragged_dot` over the
    (token, expert) pairs sorted by expert);
  - pallas: the same through the library's grouped-expert kernel (pairs in tiles of one
    expert, only the routed experts read: `pallas_kernels/grouped_matmul.py`);
  - tokamax-mosaic, tokamax-triton: the sorted pairs through openxla/tokamax's `ragged_dot`
    (Mosaic GPU and Triton kernels), where tokamax is installed;
  - gather: each pair's expert matrices gathered, then batched products (reads top_k experts
    per token, duplicates included);
  - each_pair: a loop over the pairs, each product reading its expert through a dynamic
    index (M <= 16);
  - dense: every expert applied to every token, the routed outputs kept (reads all experts).
Reports us per layer (the device's busy time from a profiler trace on a GPU, the wall time
elsewhere: `quantized_products.time_chain`), the distinct experts the tokens touch, and the
read rate over those experts' bytes (what a grouped-expert kernel must stream at least).

`--sweep` times the grouped kernel's tilings (`pallas_kernels.quantized_matmul.Tiling`) on
each of the two products alone (gate_up over the token rows, down over the tiles' rows) at
the rows of `--sweep-rows`, against the default (`grouped_tiling`).
"""

from __future__ import annotations

import argparse
import itertools
import json

from bench import harness
from bench.shapes import MODELS


def main(argv=None):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.kernels.quantized_products import time_chain
    from dflash_jax.config import parse_config
    from dflash_jax.experts import experts_product, sorted_pairs_product, swiglu
    from pallas_kernels.grouped_matmul import (expert_tiles, grouped_matmul_pallas, grouped_matmul_reference,
                                               grouped_tiling, tile_rows)
    from pallas_kernels.quantized_matmul import Tiling

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_output_arguments(parser, out_default="moe_products.json")
    parser.add_argument("--small", action="store_true", help="tiny shapes (small-moe): a CPU smoke test")
    parser.add_argument("--model", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "gpt-oss-20b"])
    parser.add_argument("--rows", default="1,4,16,32,64,256")
    parser.add_argument("--copies", type=int, default=6, help="distinct layers' experts chained")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--variants", default=None, help="comma list of the variants to time (default: all)")
    parser.add_argument("--sweep", default="", help="block_k : block_n : splits : warps : stages lists of the "
                        "grouped kernel's tilings, e.g. 64,128:64,128:1,2,4:4:3,4 ('' for none)")
    parser.add_argument("--sweep-rows", default="1", help="the tokens M the sweep runs at")
    args = parser.parse_args(argv)
    record = harness.Record(__spec__.name, args, argv)
    cfg = parse_config(MODELS["small-moe" if args.small else args.model].target)
    experts, D = cfg.experts, cfg.hidden_size
    dtype = jnp.float32 if args.small else jnp.bfloat16  # XLA CPU has no bf16 x bf16 -> f32 einsum
    E, inter, top_k = experts.num_experts, experts.intermediate_size, experts.top_k
    key = jax.random.key(0)
    layers = []
    for _ in range(args.copies):
        key, a, b, c, d = jax.random.split(key, 5)
        layer = {"gate_up": (0.02 * jax.random.normal(a, (E, D, 2 * inter))).astype(dtype),
                 "down": (0.02 * jax.random.normal(b, (E, inter, D))).astype(dtype)}
        if experts.bias:
            layer.update(gate_up_bias=jnp.zeros((E, 2 * inter), dtype), down_bias=jnp.zeros((E, D), dtype))
        layers.append((layer,))
    expert_bytes = sum(x.nbytes for x in layers[0][0].values()) // E

    def gather(x, params, weights, ids):
        gate_up = jnp.einsum("td,tkdf->tkf", x, params["gate_up"][ids], preferred_element_type=jnp.float32)
        hidden = swiglu(gate_up.astype(x.dtype).reshape(-1, 2 * inter), experts).reshape(*ids.shape, inter)
        out = jnp.einsum("tki,tkid->tkd", hidden, params["down"][ids], preferred_element_type=jnp.float32)
        return (out * weights[..., None]).sum(1).astype(x.dtype)

    def each_pair(x, params, weights, ids):
        """A loop over the (token, expert) pairs, each reading its expert by a dynamic index."""
        def one(pair):
            token, expert, weight = pair
            gate_up = jnp.dot(x[token], params["gate_up"][expert], preferred_element_type=jnp.float32)
            hidden = swiglu(gate_up.astype(x.dtype)[None], experts)[0]
            out = jnp.dot(hidden, params["down"][expert], preferred_element_type=jnp.float32)
            return out * weight.astype(jnp.float32)

        tokens = jnp.repeat(jnp.arange(x.shape[0]), top_k)
        outs = jax.lax.map(one, (tokens, ids.reshape(-1), weights.reshape(-1)))
        return outs.reshape(x.shape[0], top_k, -1).sum(1).astype(x.dtype)

    def dense(x, params, weights, ids):
        gate_up = jnp.einsum("td,edf->tef", x, params["gate_up"], preferred_element_type=jnp.float32)
        hidden = swiglu(gate_up.astype(x.dtype).reshape(-1, 2 * inter), experts).reshape(x.shape[0], E, inter)
        out = jnp.einsum("tei,eid->ted", hidden, params["down"], preferred_element_type=jnp.float32)
        chosen = jnp.zeros((x.shape[0], E), jnp.float32).at[jnp.arange(x.shape[0])[:, None], ids].set(weights)
        return jnp.einsum("ted,te->td", out, chosen).astype(x.dtype)

    variants = {
        "ragged": lambda x, params, weights, ids: experts_product(x, params, weights, ids, experts),
        "pallas": lambda x, params, weights, ids: experts_product(x, params, weights, ids, experts,
                                                                  grouped_matmul_pallas),
        **tokamax_variants(sorted_pairs_product, experts),
        "gather": gather,
        "each_pair": each_pair,
        "dense": dense,
    }
    if args.variants:
        unknown = set(args.variants.split(",")) - set(variants)
        if unknown:
            parser.error(f"unknown variants {sorted(unknown)}; choose among {', '.join(variants)}")
        variants = {name: variants[name] for name in args.variants.split(",")}
    rng = np.random.default_rng(0)
    results = []
    for M in [int(r) for r in args.rows.split(",")]:
        ids = np.stack([rng.permutation(E)[:top_k] for _ in range(M)]).astype(np.int32)
        touched = len(np.unique(ids))
        key, sub = jax.random.split(key)
        x = jax.random.normal(sub, (M, D), jnp.float32).astype(dtype)
        weights = jnp.full((M, top_k), 1.0 / top_k, dtype)
        for name, fn in variants.items():
            if name == "dense" and M * E * 2 * inter * 4 > 2**31:  # the dense intermediate outgrows memory
                continue
            if name == "each_pair" and M > 16:  # a loop of M * top_k steps: for decode and verify rows
                continue
            try:
                timed = time_chain(lambda x, params, fn=fn: fn(x, params, weights, jnp.asarray(ids)), x, layers,
                                   args.reps)
            except Exception as error:  # an optional library's kernel refusing a shape: recorded, not fatal
                results.append(dict(rows=M, variant=name, error=f"{type(error).__name__}: {str(error)[:300]}"))
                print(json.dumps(results[-1]), flush=True)
                continue
            results.append(dict(rows=M, variant=name, **timed, experts_touched=touched,
                                touched_TBps=touched * expert_bytes / timed["us"] / 1e6))
            print(json.dumps(results[-1]), flush=True)
    for M in [int(r) for r in args.sweep_rows.split(",")] if args.sweep else []:
        ids = jnp.asarray(np.stack([rng.permutation(E)[:top_k] for _ in range(M)]).reshape(-1).astype(np.int32))
        tiles = expert_tiles(ids, E, tile_rows(ids.size, E), top_k)
        touched = len(np.unique(np.asarray(ids)))
        for name, K, N in (("gate_up", D, 2 * inter), ("down", inter, D)):
            key, sub = jax.random.split(key)
            rows = (M, K) if name == "gate_up" else (*tiles.pair_GM.shape, K)  # token rows, or the tiles' rows
            x = jax.random.normal(sub, rows, jnp.float32).astype(dtype)
            chain = [(layer[name],) for (layer,) in layers]
            expected = grouped_matmul_reference(x, chain[0][0], tiles, top_k=top_k)
            default = grouped_tiling(K, N, top_k)
            if default is None:  # no tile fits: the kernel takes its reference
                results.append(dict(rows=M, variant="default", matrix=name, error=f"no tiling fits [{K}, {N}]"))
                continue
            tilings = [default] + [
                Tiling(*t) for t in itertools.product(*[[int(v) for v in part.split(",")]
                                                         for part in args.sweep.split(":")])]
            for i, tiling in enumerate(tilings):
                if i and (N % tiling.block_n or K % (tiling.block_k * tiling.splits) or tiling == default):
                    continue
                fn = lambda x, w, tiling=tiling: grouped_matmul_pallas(x, w, tiles, top_k=top_k, tiling=tiling)[0]
                variant = "default" if i == 0 else "sweep"
                try:
                    timed = time_chain(fn, x, chain, args.reps)
                except Exception as error:  # a tiling Triton cannot compile is reported, not fatal
                    results.append(dict(rows=M, variant=variant, matrix=name, tiling=list(tiling.__dict__.values()),
                                        error=f"{type(error).__name__}: {str(error)[:300]}"))
                    continue
                max_error = float(jnp.abs(grouped_matmul_pallas(x, chain[0][0], tiles, top_k=top_k, tiling=tiling)
                                          - expected).max())
                results.append(dict(rows=M, variant=variant, matrix=name, tiling=list(tiling.__dict__.values()),
                                    **timed, experts_touched=touched, max_error=max_error,
                                    touched_TBps=touched * K * N * jnp.dtype(dtype).itemsize / timed["us"] / 1e6))
                print(json.dumps(results[-1]), flush=True)
    record.write(dict(model=args.model, copies=args.copies, expert_bytes=expert_bytes, timings=results))
    print(f"\n{'M':>4} {'variant':<8} {'us':>9} {'experts':>8} {'TB/s':>6}")
    for r in [r for r in results if "matrix" not in r]:
        if "error" in r:
            print(f"{r['rows']:>4} {r['variant']:<8} failed: {r['error'][:80]}")
            continue
        print(f"{r['rows']:>4} {r['variant']:<8} {r['us']:9.1f} {r['experts_touched']:>8} {r['touched_TBps']:6.2f}")
    swept = [r for r in results if "matrix" in r and "us" in r]
    for matrix, M in sorted({(r["matrix"], r["rows"]) for r in swept}):
        timed = sorted((r for r in swept if (r["matrix"], r["rows"]) == (matrix, M)), key=lambda r: r["us"])
        first = next((r for r in timed if r["variant"] == "default"), None)
        print(f"\n{matrix} at {M} tokens: " + ("default failed" if first is None else
              f"default {first['us']:.1f} us ({first['touched_TBps']:.2f} TB/s) {first['tiling']}") + "; fastest:")
        for r in timed[:5]:
            print(f"  {r['us']:8.1f} us {r['touched_TBps']:6.2f} TB/s {r['tiling']} {r['variant']} "
                  f"max error {r['max_error']:.3g}")
    return 0


def tokamax_variants(sorted_pairs_product, experts) -> dict:
    """tokamax's `ragged_dot` kernels over the sorted pairs, where tokamax loads
    (`optional_tokamax`)."""
    import functools

    from bench.kernels.optional_tokamax import load_tokamax

    tokamax = load_tokamax()
    if tokamax is None:
        return {}
    return {f"tokamax-{impl}": lambda x, params, weights, ids, impl=impl: sorted_pairs_product(
        x, params, weights, ids, experts, ragged_dot=functools.partial(tokamax.ragged_dot, implementation=impl))
        for impl in ("mosaic", "triton")}


if __name__ == "__main__":
    raise SystemExit(main())
