"""Tensor parallelism on 8 fake CPU devices: greedy and seeded sampled tokens, the Engine's
included, are the same at every tensor-parallel size. Each test runs
`tensor_parallel_runs.py` in a fresh interpreter (the device count is fixed when jax starts)."""

from __future__ import annotations

import json
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
