"""Where a batch-1 `generate` call's time goes besides its decode steps: SmolLM2-135M shape
(random weights), one 64-token prompt, autoregressive and DFlash (block 16).

    python -m bench.decode.generate_overhead [--dtype bfloat16] [--model smollm2-135m] [--profile DIR] [--out J]

Times `elapsed_s` (the whole call, input checks to the tokens on the host) at several
max_new_tokens n and fits elapsed = fixed + n * per-token (random drafts accept nothing, so a
DFlash call runs n cycles); then host work per call: flattening both models into jit's
arguments, and, for comparison, what `generate` did per call before (flattening them as
pytrees; before that `nnx.split` of both models and a hash of their graph definitions for
jit's cache). Medians of --reps calls.
"""

import argparse
import os
import statistics

import numpy as np

from bench import harness
from bench.traces import count_trace_events
from bench.random_models import build_pair
from bench.shapes import MODELS


def median_ms(fn, reps: int) -> float:
    """Median wall milliseconds of `fn()`, whose result is host data (nothing to wait for)."""
    def call():
        fn()

    return 1e3 * harness.time_calls(call, reps=reps, warmup=0).median_s


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_output_arguments(parser)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--lengths", default="2,17,65,129")
    parser.add_argument("--profile", metavar="DIR",
                        help="also trace one call of the shortest length per decoder (jax.profiler, under DIR): "
                             "device busy time and events against the call's elapsed_s, i.e. how much of the "
                             "fixed cost is device work")
    args = parser.parse_args(argv)
    import jax
    from flax import nnx

    from dflash_jax.flat_models import flatten_models
    from dflash_jax.generate import generate, generate_autoregressive

    record = harness.Record(__spec__.name, args, argv)
    pair = build_pair(args.model, args.dtype)
    prompt = [list(np.random.default_rng(0).integers(100, 1000, 64))]
    lengths = [int(n) for n in args.lengths.split(",")]
    runs = {
        "autoregressive": lambda n: generate_autoregressive(pair.target, prompt, max_new_tokens=n),
        "dflash b16": lambda n: generate(pair.target, pair.drafter, prompt, max_new_tokens=n, block_size=16),
    }
    results = {}
    print(f"{record.env['device']}, jax {jax.__version__}, {args.model} {args.dtype}, ms (medians of {args.reps})")
    for name, run in runs.items():
        points = []
        for n in lengths:
            result = run(n)  # compile
            steps = max(len(a) for a in result.accepted_lengths)
            elapsed = statistics.median(run(n).elapsed_s for _ in range(args.reps)) * 1e3
            wall = median_ms(lambda: run(n), args.reps)
            points.append((steps, elapsed, wall))
            print(f"  {name:<15} n={n:<4} steps={steps:<4} elapsed {elapsed:8.2f}  call wall {wall:8.2f}")
        slope, fixed = np.polyfit([p[0] for p in points], [p[1] for p in points], 1)
        wall_slope, wall_fixed = np.polyfit([p[0] for p in points], [p[2] for p in points], 1)
        print(f"  {name:<15} fit: elapsed = {fixed:.2f} + steps x {slope:.3f}; call wall = {wall_fixed:.2f} + steps x "
              f"{wall_slope:.3f}")
        results[name] = dict(points=[dict(steps=s, elapsed_ms=e, call_wall_ms=w) for s, e, w in points],
                             fixed_ms=fixed, per_step_ms=slope, call_wall_fixed_ms=wall_fixed,
                             call_wall_per_step_ms=wall_slope)
        if args.profile:
            folder = os.path.join(args.profile, name.replace(" ", "-"))
            with jax.profiler.trace(folder, create_perfetto_trace=True):
                elapsed = run(lengths[0]).elapsed_s * 1e3
            events = count_trace_events(folder)
            print(f"  {name:<15} traced n={lengths[0]}: elapsed {elapsed:.2f}, device busy {events['busy_us'] / 1e3:.2f} "
                  f"in {events['device_events']} events, {events['memcpy']} memcpys ({events['memcpy_dtoh']} to host)")
            results[name]["traced"] = dict(elapsed_ms=elapsed, busy_ms=events["busy_us"] / 1e3,
                                           device_events=events["device_events"], memcpy=events["memcpy"],
                                           memcpy_dtoh=events["memcpy_dtoh"])
        record.write(results)
    models = (pair.target, pair.drafter)
    host = results["host_ms"] = {"flatten_models": median_ms(lambda: flatten_models(models), args.reps),
                                 "jax.tree.flatten": median_ms(lambda: jax.tree.flatten(models), args.reps),
                                 "nnx.split": median_ms(lambda: [nnx.split(m) for m in models], args.reps)}
    host["graphdef hash"] = (median_ms(lambda: hash(tuple(nnx.split(m)[0] for m in models)), args.reps)
                             - host["nnx.split"])
    print(f"  flatten_models of both models (what generate does per call): {host['flatten_models']:.2f}")
    print(f"  jax.tree.flatten of both models (what jit did per call before): {host['jax.tree.flatten']:.2f}")
    print(f"  nnx.split of both models (what generate did per call before that): {host['nnx.split']:.2f}")
    print(f"  hash of fresh graph definitions (jit's cache lookup then): {host['graphdef hash']:.2f}")
    record.write(results)


if __name__ == "__main__":
    main()
