"""bench/bench_decode.py end to end on the tiny CPU shapes, so the H200 benchmark cannot rot
between device sessions: every section runs and records its numbers, in both dtypes."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import bench_decode  # noqa: E402


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_small_run_records_every_section(tmp_path, dtype):
    out = tmp_path / "decode.json"
    bench_decode.main(["--small", "--points", "1x128", "--dtype", dtype, "--reps", "1", "--engine-steps", "3",
                       "--commit", "test", "--out", str(out)])
    run = json.loads(out.read_text())
    assert run["dtype"] == dtype and run["model"] == "small" and not run["skipped"]
    (point,) = run["points"]
    derived = point["derived"]
    # The generate timings are differences of two runs (n - m method): at these tiny sizes and
    # one repetition noise can make them negative, so only their presence is checked.
    assert derived["ar_s"] is not None and derived["blocks"]["16"]["cycle_s"] is not None
    assert derived["engine_s"] > 0 and derived["engine_sync_s"] > 0 and derived["engine_dflash_s"] > 0
    assert point["engine"]["dflash"]["new_traces_in_timed_steps"] == 0
    assert all(point["steps"][key] is not None for key in point["steps"])
    itemsize = {"bfloat16": 2, "float32": 4}[dtype]
    cfg = bench_decode.TARGET_SMALL  # the K/V bytes follow the dtype
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * itemsize
    mean_context = 128 + 0.75 * run["settings"]["n_tokens"]
    assert point["ar_bytes"] == pytest.approx(run["target_stream_bytes"] + mean_context * kv_per_token)
    assert out.with_suffix(".md").read_text().startswith(f"# Decode benchmark: small CPU shapes, {dtype}")


def test_torch_anchors_refuse_float32(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_decode.main(["--small", "--torch-anchors", "--dtype", "float32", "--out", str(tmp_path / "x.json")])
    assert "bfloat16" in capsys.readouterr().err
