"""Tensor parallelism on 8 fake CPU devices: greedy and seeded sampled tokens, the Engine's
included, are the same at every tensor-parallel size. Each test runs
`tensor_parallel_runs.py` in a fresh interpreter (the device count is fixed when jax starts)."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def run_case(case: str, *args: str, timeout: float = 400) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, str(HERE / "tensor_parallel_runs.py"), case, *args], env=env, cwd=HERE,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{case} ran past {timeout} s: {(error.stderr or b'')[-2000:]!r}")
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_greedy_tokens_equal_at_every_tensor_parallel_size():
    out = run_case("greedy")
    assert out["qwen3/1"][0] == out["qwen3/ar"]
    for tp in (2, 4, 8):
        assert out[f"qwen3/{tp}"] == out["qwen3/1"], tp
    assert out["llama/8"] == out["llama/1"]
    assert len({token for row in out["qwen3/1"][0] for token in row}) > 3  # not one repeated token


@pytest.mark.slow
def test_dflash2_drafters_decode_alike_at_every_tensor_parallel_size():
    out = run_case("dflash2")
    assert out["1"][0] == out["ar"]
    for tp in ("2", "4"):
        assert out[tp] == out["1"], tp
    assert any(n > 1 for lengths in out["1"][1] for n in lengths)
    assert out["sampled/4"] == out["sampled/1"]


@pytest.mark.slow
def test_qwen3_5_targets_decode_alike_at_every_tensor_parallel_size():
    """Its drafts are all rejected here: every cycle's state is rolled back to the anchor. The
    linear-attention heads split like attention heads: each device holds a slice of their
    projections and of every request's state, and the Pallas rule (in one-token steps also
    with the convolution and norms in its kernel) runs per shard; heads too
    few to split run whole (the rule's reference, whatever the choice)."""
    out = run_case("qwen3_5")
    assert out["1"][0] == out["ar"]
    assert out["split 1"] == [False] * 4  # one device holds everything
    for tp in ("2", "4"):
        assert out[tp] == out["1"], tp
        assert out[f"split {tp}"] == [True] * 4, tp
    assert out["pallas 2"] == out["1"][0]  # the rule per shard
    assert out["fused decode 2"] == out["ar"]
    tokens, cached, autoregressive = out["engine 2"]  # prefix caching restores a state split over the mesh
    assert tokens == autoregressive and cached == [0, 16, 16]
    assert out["long"][1] == out["long"][2] == out["long"][0]  # the chunked prefill, per shard of the heads
    tokens, cached, autoregressive = out["few heads"]  # a step returns the state as the next one takes it
    assert tokens == autoregressive and cached == [0, 16, 16]
    assert out["moe"][1] == out["moe"][0]  # experts split over "model" beside the linear heads


@pytest.mark.slow
def test_engine_and_seeded_sampling_equal_across_tensor_parallel_sizes():
    out = run_case("engine_and_sampling")
    assert out["engine/4"] == out["engine/1"]
    assert out["sampled/4"] == out["sampled/1"]


@pytest.mark.slow
def test_8_bit_targets_decode_alike_at_every_tensor_parallel_size():
    """Scales are sharded with their weights' columns (and reordered with them in the fused
    matrices): a misplaced one changes the tokens."""
    out = run_case("quantized")
    for name in ("int8", "fp8/16"):
        assert out[f"{name}/1"] == out[f"{name}/ar"]
        assert out[f"{name}/4"] == out[f"{name}/1"], name
        assert out[f"{name}/4/output-major"] == out[f"{name}/1"], name
    assert out["qwen3_5/2"] == out["qwen3_5/ar"]  # the convolution's channels reordered with their scales
    assert out["moe/2"] == out["moe/ar"]  # each device's experts with their own scales
    assert out["moe/2/scale-spec"] == ["model", None, None]


@pytest.mark.slow
def test_moe_targets_decode_alike_with_experts_split_over_the_mesh():
    """Qwen3-MoE at TP 1, 2, 4 and gpt-oss (sinks, windows) at TP 1 and 4."""
    out = run_case("moe")
    assert out["1"][0] == out["ar"]
    for tp in ("2", "4"):
        assert out[tp] == out["1"], tp
        assert out[f"{tp}/spec"] == ["model", None, None]  # each device holds its share of the experts
    assert any(n > 1 for lengths in out["1"][1] for n in lengths)
    assert out["gpt-oss/1"] == out["gpt-oss/4"] == out["gpt-oss/ar"]


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


@pytest.mark.slow
def test_pallas_kernels_per_shard_give_the_reference_tokens():
    out = run_case("pallas")
    assert out["2"] == out["1"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_processes_at_tensor_parallel_4_give_one_process_tokens(tmp_path):
    """`dflash-jax generate` over 2 processes of 2 fake devices each (gloo collectives on
    127.0.0.1), one model split 4 ways, prints the tokens one process prints at TP 1."""
    run_case("save", str(tmp_path))
    argv = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompt-ids", "5,6,7",
            "--prompt-ids", "20,21,22,23", "--max-new-tokens", "8", "--no-compile-cache"]

    def command(devices: int, *extra: str):
        env = {**os.environ, "FAKE_DEVICES": str(devices),
               "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
        return dict(args=[sys.executable, str(HERE / "tensor_parallel_runs.py"), "cli", *argv, *extra], env=env,
                    cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def tokens(stdout: str) -> list[str]:
        """The printed token-id lines (gloo may print its own lines, some starting with a digit)."""
        return [line for line in stdout.splitlines() if re.fullmatch(r"\d+(,\d+)*", line)]

    single = subprocess.run(**command(1), timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    coordinator = f"127.0.0.1:{free_port()}"
    processes = [subprocess.Popen(**command(2, "--tensor-parallel", "4", "--coordinator", coordinator,
                                            "--num-processes", "2", "--process-id", str(rank))) for rank in (0, 1)]
    try:
        outputs = [process.communicate(timeout=300) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, (stdout, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr[-3000:]
        assert tokens(stdout) == tokens(single.stdout) and len(tokens(stdout)) == 2


@pytest.mark.slow
def test_data_parallel_training_follows_the_one_device_loss_curve():
    out = run_case("train")
    assert out["4"] == pytest.approx(out["1"], rel=1e-4)
    assert out["1"][-1] < out["1"][0]
