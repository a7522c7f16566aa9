"""The kernel benchmarks' timing: a profiler trace's device time (kernels and copies on the
GPU's stream lines only, per call), and the product benchmarks' records, which say which
clock their "us" is (the device's where a GPU ran, the wall clock elsewhere)."""

import gzip
import json
import os
import re
import subprocess
import sys

import pytest

from bench.hlo_fusions import fused_computations, largest_program, repeated_ops
from bench.traces import count_trace_events, device_seconds


def write_trace(folder, events):
    """A perfetto-style trace as jax.profiler writes it: a GPU process with a stream line and
    a derived "XLA Ops" line, and the host."""
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    ]
    folder.mkdir(parents=True)
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def test_device_events_count_the_stream_lines_only(tmp_path):
    """Kernels on the stream are counted once (the "XLA Ops" line repeats them), host events
    never; copies to the host are told apart; ops are listed in the order of their first launch."""
    def span(name, tid, dur, ts, pid=1):
        return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}

    write_trace(tmp_path / "t", [span("rms_norm", 7, 3.0, 50), span("quantized_matmul", 7, 40.0, 10),
                                 span("quantized_matmul", 7, 44.0, 60), span("MemcpyD2H", 7, 2.0, 120),
                                 span("quantized_matmul", 8, 40.0, 0), span("python", 1, 900.0, 0, pid=2)])
    events = count_trace_events(str(tmp_path / "t"))
    assert events["device_events"] == 4 and events["busy_us"] == 89.0
    assert events["memcpy"] == events["memcpy_dtoh"] == 1
    assert events["ops"]["quantized_matmul"] == (2, 84.0)
    assert events["launch_order"] == ["quantized_matmul", "rms_norm", "MemcpyD2H"]


def test_device_seconds_are_none_without_a_gpu():
    import jax
    import jax.numpy as jnp

    if jax.default_backend() == "gpu":
        pytest.skip("a GPU's trace has device lines")
    x = jnp.ones((8, 8))
    step = jax.jit(lambda: x @ x)
    step()
    assert device_seconds(step, runs=1) is None


@pytest.mark.parametrize("module,args", [
    ("quantized_products", ["--rows", "1", "--matrices", "o", "--sweep", "128:64:1:4:3:64", "--sweep-rows", "1"]),
    ("moe_products", ["--rows", "1", "--variants", "ragged,pallas", "--sweep", "16:16,32:1,2:4:3", "--sweep-rows", "1"]),
])
def test_product_benchmarks_record_both_clocks(module, args, tmp_path):
    import importlib

    bench_module = importlib.import_module(f"bench.kernels.{module}")
    out = tmp_path / "record.json"
    assert bench_module.main(["--small", "--copies", "2", "--reps", "1", *args, "--out", str(out)]) == 0
    timings = json.loads(out.read_text())["results"]["timings"]
    assert timings and not [t for t in timings if "error" in t and not t["variant"].startswith("tokamax")]
    for t in (t for t in timings if "error" not in t):
        assert t["us"] == t["wall_us"] > 0 and t["device_us"] is None  # a CPU: the wall clock
    if module == "moe_products":  # its tilings: each of the two products, each checked against the reference
        swept = [t for t in timings if "matrix" in t]
        assert {(t["matrix"], t["variant"]) for t in swept} == {
            (m, v) for m in ("gate_up", "down") for v in ("default", "sweep")}
        assert all(t["max_error"] < 1e-4 for t in swept)


def test_hlo_fusions_name_what_a_profiled_kernel_runs(tmp_path):
    """A fusion named in a profile is found in an XLA dump with the computation it calls; a
    name the program lacks (a custom kernel's) comes back empty; a profile record's repeated
    ops are the ones asked for."""
    dump = tmp_path / "dump"
    program = ("import jax, jax.numpy as jnp\n"
               "f = jax.jit(lambda x, y: jnp.tanh(x * y + 1.0).sum(axis=1))\n"
               "f(jnp.ones((64, 32)), jnp.ones((64, 32))).block_until_ready()\n")
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", program], env=env, check=True, timeout=300)
    text = largest_program(str(dump))
    names = re.findall(r"%([\w.]*fusion[\w.]*) = ", text)
    assert names, "the dump has no fusion"
    found = fused_computations(text, [names[0], "paged_attention_ragged__1"])
    assert "calls=" in found[names[0]] and "tanh" in found[names[0]]
    assert found["paged_attention_ragged__1"] == ""
    record = tmp_path / "r.json"
    record.write_text(json.dumps({"results": {"profile": [{"ar": {"ops_per_iteration": [
        ["gemm_fusion_dot_1", 36.0, 900.0], ["loop_pad_fusion_2", 72.0, 80.0], ["loop_add_fusion", 1.0, 1.2]]}}]}}))
    assert repeated_ops(str(record)) == ["gemm_fusion_dot_1", "loop_pad_fusion_2"]
