"""--profile: device events per loop iteration of the generate loops, from jax.profiler
traces (bench.decode.speed's docstring)."""

from __future__ import annotations

import os

from bench.traces import count_trace_events


def profile_generate(pair, prompts, impl: str, opts, log_dir: str) -> dict:
    """Device events per DFlash cycle and per AR step from two jax.profiler traces (an m-run
    and an n-run of the compiled program): (events(n) - events(m)) / (iterations apart), in
    all and per op (calls and busy us, the 40 busiest; and those in the order of their first
    launch, a layer's kernels in its order), so prefill and compile-time work cancel."""
    import jax

    from dflash_jax.generate import generate, generate_autoregressive

    runs = {
        "ar": lambda n: generate_autoregressive(pair.target, prompts, max_new_tokens=n, kernels=opts.kernels_for(impl)),
        "dflash": lambda n: generate(pair.target, pair.drafter, prompts, max_new_tokens=n,
                                     block_size=max(opts.block_sizes), kernels=opts.kernels_for(impl)),
    }
    out = {}
    for name, run in runs.items():
        n_long = opts.n_tokens
        n_short = n_long // 2 + 1
        run(n_short)  # compiled outside the traces
        counts = []
        for n in (n_short, n_long):
            folder = os.path.join(log_dir, f"{name}-{n}")
            with jax.profiler.trace(folder, create_perfetto_trace=True):
                result = run(n)
            iterations = max(len(a) for a in result.accepted_lengths)
            counts.append((iterations, count_trace_events(folder)))
        (i0, c0), (i1, c1) = counts
        per = {k: (c1[k] - c0[k]) / max(i1 - i0, 1) for k in ("device_events", "busy_us", "memcpy", "memcpy_dtoh")}
        apart = max(i1 - i0, 1)
        ops = {op: ((calls - c0["ops"].get(op, (0, 0.0))[0]) / apart, (us - c0["ops"].get(op, (0, 0.0))[1]) / apart)
               for op, (calls, us) in c1["ops"].items()}
        top = sorted(ops.items(), key=lambda item: -item[1][1])[:40]
        busiest = {op for op, _ in top}
        out[name] = dict(per_iteration=per, iterations=[i0, i1], events_per_line_long_run=c1["lines"],
                         ops_per_iteration=[(op, round(calls, 2), round(us, 1)) for op, (calls, us) in top],
                         ops_in_launch_order=[op for op in c1["launch_order"] if op in busiest],
                         op_details={op: c1["details"].get(op, "") for op, _ in top})
    return out
