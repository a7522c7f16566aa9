"""`python -m bench.decode.speed` end to end on the tiny CPU shapes, so the H200 benchmark
cannot rot between device sessions: every section runs and records its numbers, in both
dtypes, and on a tensor-parallel mesh of fake devices."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from bench import shapes
from bench.decode import speed

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_small_run_records_every_section(tmp_path, dtype):
    """Every section in bfloat16; in float32 (what changes is the bytes counted) generate's."""
    every = dtype == "bfloat16"
    out = tmp_path / "decode.json"
    speed.main(["--small", "--points", "1x128", "--dtype", dtype, "--reps", "1", "--engine-steps", "3",
                "--commit", "test", "--out", str(out), *([] if every else ["--sections", "generate"])])
    record = json.loads(out.read_text())
    assert record["benchmark"] == "bench.decode.speed" and record["env"]["commit"] == "test"
    run = record["results"]
    assert run["dtype"] == dtype and run["model"] == "small" and not run["skipped"]
    (point,) = run["points"]
    errors = {name: section["error"] for name, section in point.items() if isinstance(section, dict) and "error" in section}
    assert not errors, errors  # a failing section is recorded and the run goes on: the test must not
    derived = point["derived"]
    # The generate timings are differences of two runs (n - m method): at these tiny sizes and
    # one repetition noise can make them negative, so only their presence is checked.
    assert derived["ar_s"] is not None and derived["blocks"]["16"]["cycle_s"] is not None
    if every:
        assert derived["engine_s"] > 0 and derived["engine_sync_s"] > 0 and derived["engine_dflash_s"] > 0
        assert point["engine"]["dflash"]["new_traces_in_timed_steps"] == 0
        assert point["steps"]["ar_step"] is not None and all(
            part is not None for part in point["steps"]["dflash"]["16"].values())
    itemsize = {"bfloat16": 2, "float32": 4}[dtype]
    cfg = shapes.SMALL  # the K/V bytes follow the dtype
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * itemsize
    mean_context = 128 + 0.75 * run["settings"]["n_tokens"]
    assert point["ar_bytes"] == pytest.approx(run["target_stream_bytes"] + mean_context * kv_per_token)
    assert out.with_suffix(".md").read_text().startswith(f"# Decode benchmark: small CPU shapes, {dtype}")


def test_torch_anchors_refuse_float32(tmp_path, capsys):
    with pytest.raises(SystemExit):
        speed.main(["--small", "--torch-anchors", "--dtype", "float32", "--out", str(tmp_path / "x.json")])
    assert "bfloat16" in capsys.readouterr().err


@pytest.mark.slow
def test_tensor_parallel_run_records_its_size(tmp_path):
    """The sections bench/plans/tensor_parallel.sh runs, at --tensor-parallel 2 over 2 fake CPU
    devices, in a fresh interpreter (the device count is fixed when jax starts)."""
    out = tmp_path / "decode.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2",
           "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}  # compile time dominates this run
    done = subprocess.run([sys.executable, "-m", "bench.decode.speed", "--small", "--tensor-parallel", "2",
                           "--points", "1x128", "--sections", "generate,engine", "--reps", "1", "--engine-steps", "3",
                           "--copy-gb", "0.004", "--commit", "test", "--out", str(out)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    record = json.loads(out.read_text())
    run = record["results"]
    assert run["tensor_parallel"] == 2 and record["env"]["num_devices"] == 2 and not run["skipped"]
    derived = run["points"][0]["derived"]
    assert derived["ar_s"] is not None and derived["blocks"]["16"]["cycle_s"] is not None
    assert derived["engine_s"] > 0 and derived["engine_dflash_s"] > 0
    assert "x 2 (tensor parallel)" in out.with_suffix(".md").read_text().splitlines()[0]


def test_one_device_measures_refuse_tensor_parallel(tmp_path, capsys):
    with pytest.raises(SystemExit):
        speed.main(["--small", "--profile", "--tensor-parallel", "2", "--out", str(tmp_path / "x.json")])
    assert "--tensor-parallel" in capsys.readouterr().err


def test_moe_stream_bytes_count_the_experts_the_tokens_touch():
    """One token reads top_k of each sparse layer's experts; a block reads more; the memory a
    point needs counts every expert."""
    from bench.random_models import build_pair

    pair = build_pair("small-moe", "float32")
    experts = pair.target.cfg.experts
    one = pair.target_stream_bytes(1)
    assert one == pytest.approx(pair.target_weight_bytes - pair.expert_bytes * (1 - experts.top_k / experts.num_experts),
                                abs=1)
    assert one < pair.target_stream_bytes(4) < pair.target_stream_bytes(64) <= pair.target_weight_bytes
    assert pair.expert_bytes > 0 and build_pair("small", "float32").expert_bytes == 0
