"""The gated delta rule of one Qwen3.5-9B gated-delta-net layer on the GPU, per call: the
Pallas kernel against the jnp reference, at decode (rows of 1 token), verify (rows of 16)
and prefill (one row of many tokens) shapes.

    python -m bench.kernels.delta_rule --out $OUT/delta_rule.json
    python -m bench.kernels.delta_rule --small --out /tmp/dr.json   # CPU smoke test (interpret mode)

`--variants u1,u4v8w1` adds the kernel with other settings: tokens per run (whose inputs load
together), value columns per program (more programs, less state each) and warps.
`--chunked v32w4,v64w8` times the chunked form (`chunked_delta_rule_pallas`, what prefill rows
of at least its chunk take) with those value columns and warps, at rows of a chunk or more,
beside its jnp form (`chunked_reference`, what a CPU runs).
Each sample times a jitted chain of --chain calls, each starting from the state the one before
left, so one dispatch serves them all. Reports us per call and, for the kernel, the state's bytes read and written over the time
(each call reads and writes every row's [value heads, key dim, value dim] float32 state once).
"""

from __future__ import annotations

import argparse
import json
import re

from bench import harness
from bench.shapes import MODELS


def kernel_settings(variant: str) -> dict:
    """`delta_rule_pallas` keywords of a --variants entry such as "u4v8w1" (--chunked: no u)."""
    match = re.fullmatch(r"(?:u(\d+))?(?:v(\d+))?(?:w(\d+))?", variant)
    if not match or not variant:
        raise SystemExit(f"--variants entry {variant!r}: write it as u<tokens per run>v<value columns>w<warps>.")
    names = ("unroll", "block_v", "num_warps")
    return {name: int(value) for name, value in zip(names, match.groups()) if value is not None}


def main(argv=None):
    import functools

    import jax
    import jax.numpy as jnp

    from dflash_jax.config import parse_config
    from pallas_kernels.chunked_delta_rule import CHUNK, chunked_delta_rule_pallas, chunked_delta_rule_reference
    from pallas_kernels.delta_rule import delta_rule_pallas, delta_rule_reference

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_output_arguments(parser, out_default="delta_rule.json")
    parser.add_argument("--small", action="store_true", help="tiny shapes (small-qwen3_5): a CPU smoke test")
    parser.add_argument("--shapes", default="1x1,1x16,32x1,32x16,1x1024,1x8192",
                        help="rows x tokens per row, comma separated")
    parser.add_argument("--reference-limit", type=int, default=1024, help="the reference's most tokens per call")
    parser.add_argument("--variants", default="",
                        help="also time the kernel with other settings, comma separated, each as u<tokens per run>"
                             "v<value columns per program>w<warps> (e.g. u4v8w1), any part left out at its default")
    parser.add_argument("--chunked", default="v32w4",
                        help="the chunked form's settings to time at rows of a chunk or more, comma separated, each "
                             "as v<value columns per program>w<warps>; '' for none")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--chain", type=int, default=10,
                        help="calls per timed sample, each from the state the last one left (one call's dispatch "
                             "would hide a decode-shaped kernel)")
    args = parser.parse_args(argv)
    record = harness.Record(__spec__.name, args, argv)
    la = parse_config(MODELS["small-qwen3_5" if args.small else "qwen3_5-9b"].target).linear_attention
    Hk, Hv, K, V = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    if args.small:
        shapes = [(rows, min(tokens, 128)) for rows, tokens in shapes]
    interpret = jax.default_backend() != "gpu"
    variants = {"pallas": functools.partial(delta_rule_pallas, interpret=interpret), "reference": delta_rule_reference,
                "chunked_reference": chunked_delta_rule_reference}
    for variant in filter(None, args.variants.split(",")):
        variants[f"pallas_{variant}"] = functools.partial(delta_rule_pallas, interpret=interpret,
                                                          **kernel_settings(variant))
    for variant in filter(None, args.chunked.split(",")):
        settings = kernel_settings(variant)
        if "unroll" in settings:
            raise SystemExit(f"--chunked entry {variant!r}: the chunked form has no tokens per run (u).")
        variants[f"chunked_{variant}"] = functools.partial(chunked_delta_rule_pallas, interpret=interpret, **settings)
    key = jax.random.key(0)
    results = []
    for rows, per_row in shapes:
        T = rows * per_row
        key, *keys = jax.random.split(key, 7)
        q, k = (jax.random.normal(keys[i], (T, Hk, K), jnp.float32) for i in (0, 1))
        q, k = (x / jnp.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
        v = jax.random.normal(keys[2], (T, Hv, V), jnp.float32)
        g = -jnp.abs(jax.random.normal(keys[3], (T, Hv))) * 0.1
        beta = jax.random.uniform(keys[4], (T, Hv))
        state = jax.random.normal(keys[5], (rows, Hv, K, V), jnp.float32) * 0.1
        starts = jnp.arange(rows, dtype=jnp.int32) * per_row
        for name, rule in variants.items():
            if (name == "reference" and T > args.reference_limit) or (name.startswith("chunked") and per_row < CHUNK):
                continue
            def chained(q, k, v, g, beta, state, rule=rule):  # each call starts from the last one's state
                out, outs = q, []
                for _ in range(args.chain):  # and its queries depend on the last one's outputs (no terms shared)
                    out, state = rule(harness.after(q, out), k, v, g, beta, state, starts, starts + per_row)
                    outs.append(out)
                return sum(outs), state

            call = jax.jit(chained)
            timing = harness.time_calls(lambda: call(q, k, v, g, beta, state), reps=args.reps,
                                        calls_per_sample=args.chain)
            seconds = timing.median_s
            results.append(dict(rows=rows, tokens_per_row=per_row, variant=name, us=seconds * 1e6,
                                state_TBps=2 * state.nbytes / seconds / 1e12))
            print(json.dumps(results[-1]), flush=True)
    record.write(dict(heads=dict(key=Hk, value=Hv, key_dim=K, value_dim=V), timings=results))
    print(f"\n{'rows':>5} {'tokens':>7} {'variant':<18} {'us':>10} {'state TB/s':>10}")
    for r in results:
        print(f"{r['rows']:>5} {r['tokens_per_row']:>7} {r['variant']:<18} {r['us']:10.1f} {r['state_TBps']:10.2f}")


if __name__ == "__main__":
    main()
