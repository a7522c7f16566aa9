"""The Engine's DFlash decode step split into its host and device parts (Qwen3-8B shape,
by default; random weights, bench_decode's models): the median step with asynchronous scheduling and
without, and the host's share of a synchronous step (scheduling, batch building, dispatch:
the time inside `Engine._launch`). Runs from any tree of this project (it imports that
tree's `bench_decode`), so one device call can compare two commits:

    python3 bench/engine_step_split.py --points 1x1k,8x1k --out split.json

`--plain-key` (this tree only) times the program lookup with its key hashed at every step,
as before the key was hashed once. `--profile N` prints the N host functions with the most
own time in as many more synchronous steps (cProfile), to compare two trees line by line.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode  # noqa: E402


def time_steps(pair, prompts, kernels, *, async_scheduling: bool, steps: int, profile: int = 0) -> dict:
    from dflash_jax.engine import Engine, SamplingParams
    from pallas_kernels.common import next_pow2

    batch, context = len(prompts), len(prompts[0])
    budget = max(next_pow2(batch), min(next_pow2(batch * context), 8192))
    max_new = 2 * (2 * steps + 4 + -(-batch * context // budget))
    engine = Engine(pair.target, pair.drafter, max_num_reqs=next_pow2(batch), max_num_tokens=budget,
                    max_model_len=context + max_new + 32, kernels=kernels, async_scheduling=async_scheduling)
    launch_s = []
    launch = engine._launch

    def timed_launch(work):
        t0 = time.perf_counter()
        out = launch(work)
        launch_s.append(time.perf_counter() - t0)
        return out

    engine._launch = timed_launch
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=max_new)) for p in prompts]
    while any(not engine.output(i) for i in ids):
        engine.step()
    for _ in range(2):  # the first decode step compiles its program
        engine.step()
    launch_s.clear()
    samples = []
    profiler = cProfile.Profile() if profile else None
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        samples.append(time.perf_counter() - t0)
    if profiler is not None:  # after the timed steps, so that they carry no profiling cost
        profiler.runcall(lambda: [engine.step() for _ in range(steps)])
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
    return dict(step_s=statistics.median(samples), spread_s=[min(samples), max(samples)],
                launch_s=statistics.median(launch_s), samples_s=samples)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default="1x1k,8x1k")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(bench_decode.MODELS))
    parser.add_argument("--attention-impl", default="pallas")
    parser.add_argument("--plain-key", action="store_true")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import numpy as np

    from dflash_jax.kernels import Kernels

    if args.plain_key:
        from dflash_jax import engine

        engine._HashedOnce = lambda value: value
    pair = bench_decode.build_pair(args.model, args.dtype)
    kernels = Kernels(attention=args.attention_impl)
    rng = np.random.default_rng(0)
    results = []
    for batch, context in bench_decode.parse_points(args.points):
        prompts = bench_decode.prompts_for(rng, pair.target.cfg.vocab_size, batch, context)
        row = dict(point=f"{batch}x{context}")
        for name, async_scheduling in (("async", True), ("sync", False)):
            row[name] = time_steps(pair, prompts, kernels, async_scheduling=async_scheduling, steps=args.steps,
                                   profile=0 if async_scheduling else args.profile)
        results.append(row)
        print(f"{row['point']}: async {row['async']['step_s'] * 1e3:.2f} ms, sync {row['sync']['step_s'] * 1e3:.2f} ms,"
              f" host launch {row['sync']['launch_s'] * 1e3:.2f} ms", flush=True)
    args.out.write_text(json.dumps(dict(plain_key=args.plain_key, results=results), indent=1))


if __name__ == "__main__":
    main()
