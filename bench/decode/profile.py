"""--profile: device events per loop iteration of the generate loops, from jax.profiler
traces (bench.decode.speed's docstring), and the trace reader bench.decode.generate_overhead
shares."""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections import Counter


def profile_generate(pair, prompts, impl: str, opts, log_dir: str) -> dict:
    """Device events per DFlash cycle and per AR step from two jax.profiler traces (an m-run
    and an n-run of the compiled program): (events(n) - events(m)) / (iterations apart), in
    all and per op (calls and busy us, the 40 busiest), so prefill and compile-time work cancel."""
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
        out[name] = dict(per_iteration=per, iterations=[i0, i1], events_per_line_long_run=c1["lines"],
                         ops_per_iteration=[(op, round(calls, 2), round(us, 1)) for op, (calls, us) in top],
                         op_details={op: c1["details"].get(op, "") for op, _ in top})
    return out


def count_trace_events(folder: str) -> dict:
    """Device-side event counts in the perfetto trace under `folder`: kernels on the GPU's
    stream lines (derived lines such as "XLA Ops" repeat them and are left out), memcpys
    (device to host ones are host syncs), events per line, and calls and busy time per op name."""
    paths = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        return dict(device_events=0, busy_us=0.0, memcpy=0, memcpy_dtoh=0, lines={}, ops={}, details={})
    with gzip.open(sorted(paths)[-1], "rt") as f:
        trace = json.load(f)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    meta = [e for e in events if e.get("ph") == "M"]
    device_pids = {e["pid"] for e in meta if e.get("name") == "process_name"
                   and "GPU" in str(e.get("args", {}).get("name", ""))}
    threads = {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", "")) for e in meta
               if e.get("name") == "thread_name" and e.get("pid") in device_pids}
    spans = [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids]
    lines = Counter(threads.get((e["pid"], e.get("tid")), "?") for e in spans)
    streams = {key for key, name in threads.items() if "stream" in name.lower()}
    device = [e for e in spans if not streams or (e["pid"], e.get("tid")) in streams]
    memcpy = [e for e in device if "memcpy" in e.get("name", "").lower()]
    dtoh = [e for e in memcpy if any(s in e["name"].lower() for s in ("dtoh", "d2h", "devicetohost"))]
    busy, calls = Counter(), Counter()
    for e in device:
        busy[e.get("name", "?")[:60]] += float(e.get("dur", 0))
        calls[e.get("name", "?")[:60]] += 1
    details = {}  # per op, the longest args any line gives it (HLO text, kernel launch shape)
    for e in spans:
        name, args = e.get("name", "?")[:60], json.dumps(e.get("args", {}), default=str)[:600]
        if name in busy and len(args) > len(details.get(name, "")):
            details[name] = args
    return dict(device_events=len(device), busy_us=sum(busy.values()), memcpy=len(memcpy), memcpy_dtoh=len(dtoh),
                lines=dict(lines), ops={name: (calls[name], us) for name, us in busy.items()}, details=details)
