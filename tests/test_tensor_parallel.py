"""Tensor parallelism on 8 fake CPU devices: greedy and seeded sampled tokens, the Engine's
included, are the same at every tensor-parallel size. Each test runs
`tensor_parallel_runs.py` in a fresh interpreter (the device count is fixed when jax starts)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def run_case(case: str, timeout: float = 400) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, str(HERE / "tensor_parallel_runs.py"), case], env=env, cwd=HERE,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{case} ran past {timeout} s: {(error.stderr or b'')[-2000:]!r}")
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_greedy_tokens_equal_at_every_tensor_parallel_size():
    out = run_case("greedy")
    assert out["qwen3/1"][0] == out["qwen3/ar"]
    for tp in (2, 4, 8):
        assert out[f"qwen3/{tp}"] == out["qwen3/1"], tp
    assert out["llama/8"] == out["llama/1"]
    assert len({token for row in out["qwen3/1"][0] for token in row}) > 3  # not one repeated token


def test_engine_and_seeded_sampling_equal_across_tensor_parallel_sizes():
    out = run_case("engine_and_sampling")
    assert out["engine/4"] == out["engine/1"]
    assert out["sampled/4"] == out["sampled/1"]


def test_compiled_step_has_two_all_reduces_per_layer_and_no_weight_gather():
    """At TP 4 the target's step holds one all-reduce after attention and one after the MLP per
    layer, plus the embedding lookup's; its only gathers are the greedy argmax's per-shard
    (max, index) pairs (the last axis is the 4 shards, far smaller than the vocabulary). The
    whole cycle (drafter included) gathers nothing bigger either. Each device holds 1/4 of
    the parameters."""
    out = run_case("hlo")
    target = out["target"]
    all_reduced = [shape for kind, shapes in target if kind == "all-reduce" for shape in shapes]
    assert len(all_reduced) == 2 * out["layers"] + 1, target
    assert {kind for kind, _ in out["cycle"]} <= {"all-reduce", "all-gather"}, out["cycle"]
    gathered = [shape for kind, shapes in out["target"] + out["cycle"] if kind == "all-gather" for shape in shapes]
    assert gathered and all(shape[-1] == 4 and math.prod(shape) < out["vocab"] for shape in gathered), gathered
    for kind in ("target", "drafter"):
        assert out[f"{kind}/per_device_bytes"] * 4 == pytest.approx(out[f"{kind}/total_bytes"], rel=0.05)
