"""What a jax.profiler trace says the device did: kernels, copies and busy time per op
(`count_trace_events`), and a function's device seconds per call (`device_seconds`), which
leave out the host's dispatch that wall-clock chains of short kernels carry."""

from __future__ import annotations

import glob
import gzip
import json
import os
import tempfile
from collections import Counter


def count_trace_events(folder: str) -> dict:
    """Device-side event counts in the perfetto trace under `folder`: kernels on the GPU's
    stream lines (derived lines such as "XLA Ops" repeat them and are left out), memcpys
    (device to host ones are host syncs), events per line, calls and busy time per op name, and
    the op names in the order of their first launch (a repeated layer's kernels in its order)."""
    paths = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        return dict(device_events=0, busy_us=0.0, memcpy=0, memcpy_dtoh=0, lines={}, ops={}, details={},
                    launch_order=[])
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
    busy, calls, first = Counter(), Counter(), {}
    for e in device:
        name = e.get("name", "?")[:60]
        busy[name] += float(e.get("dur", 0))
        calls[name] += 1
        first[name] = min(first.get(name, float("inf")), float(e.get("ts", 0)))
    details = {}  # per op, the longest args any line gives it (HLO text, kernel launch shape)
    for e in spans:
        name, args = e.get("name", "?")[:60], json.dumps(e.get("args", {}), default=str)[:600]
        if name in busy and len(args) > len(details.get(name, "")):
            details[name] = args
    return dict(device_events=len(device), busy_us=sum(busy.values()), memcpy=len(memcpy), memcpy_dtoh=len(dtoh),
                lines=dict(lines), ops={name: (calls[name], us) for name, us in busy.items()}, details=details,
                launch_order=sorted(first, key=first.get))


def device_seconds(fn, *, runs: int = 3, calls_per_run: int = 1) -> float | None:
    """Busy device seconds per call of `fn` (compiled and warm already): `runs` runs of it in a
    jax.profiler trace, the summed durations of every kernel and copy on the GPU's streams over
    runs x calls_per_run (the calls `fn` chains); None where the trace shows no GPU (a CPU run)."""
    import jax

    with tempfile.TemporaryDirectory(prefix="bench_device_seconds_") as folder:
        with jax.profiler.trace(folder):
            for _ in range(runs):
                jax.block_until_ready(fn())
        events = count_trace_events(folder)
    if not events["device_events"]:
        return None
    return events["busy_us"] * 1e-6 / (runs * calls_per_run)
