"""The Engine's DFlash decode step split into its host and device parts (Qwen3-8B shape by
default; random weights, `bench.random_models`): the median step with asynchronous scheduling
and without, and the host's share of a synchronous step (choosing the program, filling its
inputs, dispatching: `Engine.last_launch_s`), per step and per verify cycle, for each
`--cycles` (the Engine's `cycles_per_step`). Each tree runs its own copy, so one device call
can compare two commits (bench/plans/compare.sh, step `split`):

    python -m bench.decode.engine_step_split --points 1x1k,8x1k --cycles 1,4 --out split.json

`--profile N` prints the N host functions with the most own time in as many more synchronous
steps (cProfile), to compare two trees line by line.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics

from bench import harness
from bench.decode.points import parse_points, prompts_for
from bench.random_models import build_pair
from bench.shapes import MODELS


def time_steps(pair, prompts, kernels, *, async_scheduling: bool, steps: int, cycles: int | None = None,
               profile: int = 0) -> dict:
    """Median wall seconds of `Engine.step()` and of its launch, over `steps` decode steps
    after the prefill and two warm-up steps (the first decode step compiles its program),
    and the mean seconds per verify cycle over them (`cycles` per step at most)."""
    from dflash_jax.engine import Engine, SamplingParams
    from pallas_kernels.common import next_pow2

    batch, context = len(prompts), len(prompts[0])
    budget = max(next_pow2(batch), min(next_pow2(batch * context), 8192))
    max_new = 2 * (cycles or 1) * (2 * steps + 4 + -(-batch * context // budget))
    engine = Engine(pair.target, pair.drafter, max_num_reqs=next_pow2(batch), max_num_tokens=budget,
                    max_model_len=context + max_new + 32, kernels=kernels, async_scheduling=async_scheduling,
                    cycles_per_step=cycles)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=max_new)) for p in prompts]
    while any(not engine.output(i) for i in ids):
        engine.step()
    for _ in range(2):
        engine.step()
    launch_s = []
    cycles_before = len(engine.stats(ids[0]).accepted_lengths)

    def step():
        engine.step()  # waits for the device itself: a step reads back committed tokens
        launch_s.append(engine.last_launch_s)

    timing = harness.time_calls(step, reps=steps, warmup=0)
    cycles_run = len(engine.stats(ids[0]).accepted_lengths) - cycles_before
    if profile:  # after the timed steps, so that they carry no profiling cost
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [engine.step() for _ in range(steps)])
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
    return dict(step_s=timing.median_s, spread_s=timing.spread_s, launch_s=statistics.median(launch_s),
                cycles_per_step=engine.cycles_per_step, cycle_s=sum(timing.samples_s) / max(cycles_run, 1),
                samples_s=list(timing.samples_s))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_output_arguments(parser, out_required=True)
    parser.add_argument("--points", default="1x1k,8x1k")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS))
    parser.add_argument("--attention-impl", default="pallas")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--cycles", default="default",
                        help="comma-separated cycles_per_step values to time (default: the Engine's own)")
    args = parser.parse_args(argv)
    import numpy as np

    from dflash_jax.kernels import Kernels

    record = harness.Record(__spec__.name, args, argv)
    pair = build_pair(args.model, args.dtype)
    kernels = Kernels(attention=args.attention_impl)
    rng = np.random.default_rng(0)
    results = []
    cycle_choices = [None if c == "default" else int(c) for c in args.cycles.split(",")]
    for batch, context in parse_points(args.points):
        prompts = prompts_for(rng, pair.target.cfg.vocab_size, batch, context)
        for cycles in cycle_choices:
            row = dict(point=f"{batch}x{context}")
            for name, async_scheduling in (("async", True), ("sync", False)):
                row[name] = time_steps(pair, prompts, kernels, async_scheduling=async_scheduling, steps=args.steps,
                                       cycles=cycles, profile=0 if async_scheduling else args.profile)
            results.append(row)
            record.write(results)
            a, s = row["async"], row["sync"]
            print(f"{row['point']} cycles/step {a['cycles_per_step']}: async {a['step_s'] * 1e3:.2f} ms/step "
                  f"{a['cycle_s'] * 1e3:.2f} ms/cycle, sync {s['step_s'] * 1e3:.2f} ms/step "
                  f"{s['cycle_s'] * 1e3:.2f} ms/cycle, host launch {s['launch_s'] * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
