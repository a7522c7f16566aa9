"""What every benchmark shares: the record of where it ran, one way to time calls, and one
JSON schema for its results.

A benchmark parses its flags with `add_output_arguments` (--out, --commit), opens a
`Record` and writes its results into it as they come:

    {"benchmark": "bench.kernels.sampling", "command": "python -m bench.kernels.sampling ...",
     "env": {"date", "commit", "device", "python", "jax", ...}, "args": {...}, "results": ...}

Each write replaces the whole file, so a run cut short keeps what it measured. Timings come
from `time_calls`: warm-up calls, then timed calls that each wait for their outputs, and the
median and spread of the timed ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Versions every record holds; a benchmark names more (`packages`) where they matter to it.
PACKAGES = ("jax", "jaxlib", "flax")
# Settings of the environment that change what XLA does.
VARIABLES = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "JAX_PLATFORMS")
# A fresh interpreter's devices, for benchmarks whose subprocesses own the accelerator.
DEVICES_SCRIPT = ("import json, jax; d = jax.devices(); "
                  "print(json.dumps([jax.default_backend(), str(d[0].device_kind), len(d)]))")


def add_output_arguments(parser: argparse.ArgumentParser, *, out_default: str | None = None,
                         out_required: bool = False) -> None:
    """--out (the JSON record) and --commit."""
    where = f" (default {out_default})" if out_default else "" if out_required else " (none: stdout only)"
    parser.add_argument("--out", type=Path, default=out_default, required=out_required,
                        help="the JSON record of the run" + where)
    add_commit_argument(parser)


def add_commit_argument(parser: argparse.ArgumentParser) -> None:
    """--commit, recorded as given: a device copy of the tree has no .git."""
    parser.add_argument("--commit", help="the commit to record (default: this tree's, `git rev-parse`)")


def commit_of(root: Path = ROOT) -> str:
    """The checked-out commit of `root`, "-dirty" if tracked files differ from it."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if head and changed else head or "unknown"


def version_of(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unavailable"


def devices(in_subprocess: bool = False) -> dict:
    """The backend, the first device's kind and the device count; `in_subprocess` asks a
    fresh interpreter, so that this process never takes the accelerator from its children."""
    if in_subprocess:
        env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        done = subprocess.run([sys.executable, "-c", DEVICES_SCRIPT], capture_output=True, text=True, env=env,
                              timeout=300)
        if done.returncode:
            return {"device": f"unknown ({done.stderr.strip()[-200:]})"}
        backend, kind, count = json.loads(done.stdout.strip().splitlines()[-1])
    else:
        import jax

        backend, kind, count = jax.default_backend(), str(jax.devices()[0].device_kind), jax.device_count()
    return {"backend": backend, "device": kind, "num_devices": count}


def environment(commit: str | None = None, *, packages: Sequence[str] = (), devices_in_subprocess: bool = False
                ) -> dict:
    """Where and on what a run happened: date, commit, device, versions, host and the XLA
    settings of the environment."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit or commit_of(),
        **devices(devices_in_subprocess),
        "python": platform.python_version(),
        **{name: version_of(name) for name in (*PACKAGES, *packages)},
        "platform": platform.platform(),
        "host": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "variables": {name: os.environ[name] for name in VARIABLES if name in os.environ},
    }


class Record:
    """One run's JSON record at `path` (default: --out; see the module docstring);
    `write(results)` rewrites the file whole. Without a path nothing is written."""

    def __init__(self, benchmark: str, args: argparse.Namespace, argv: Sequence[str] | None = None, *,
                 path: Path | None = None, **env_options):
        self.path: Path | None = path or (args.out and Path(args.out))
        argv = sys.argv[1:] if argv is None else argv
        self.data = {"benchmark": benchmark, "command": " ".join(["python -m", benchmark, *argv]),
                     "env": environment(args.commit, **env_options), "args": vars(args).copy(), "results": None}

    @property
    def env(self) -> dict:
        return self.data["env"]

    def write(self, results) -> None:
        self.data["results"] = results
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(self.data, indent=1, default=str))
        partial.replace(self.path)  # a reader never sees half a file


def after(inputs, previous):
    """`inputs` (a pytree of arrays) made to depend on `previous` (another pytree), so that a
    jitted chain `out = fn(after(x, out))` runs every call, one after another.

    The link adds zero times one element of `previous` to the first leaf of `inputs`: XLA cannot
    fold a float product with zero (NaN times zero is NaN), so the data dependence survives.
    An optimisation barrier does not: XLA expands it away and every call but the last is
    dead code (a chain of 10 calls then times one call and divides by 10)."""
    import jax
    import jax.numpy as jnp

    leaves, tree = jax.tree.flatten(inputs)
    link = jnp.ravel(jax.tree.leaves(previous)[0])[0].astype(jnp.float32) * 0
    leaves[0] = leaves[0] + link.astype(leaves[0].dtype)
    return jax.tree.unflatten(tree, leaves)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call: the median of the timed samples and their spread; `first_s`, the
    first warm-up call's whole seconds (compilation included), None without warm-up."""

    median_s: float
    min_s: float
    max_s: float
    samples_s: tuple[float, ...]
    first_s: float | None

    @property
    def spread_s(self) -> list[float]:
        return [self.min_s, self.max_s]


def time_calls(fn: Callable[[], object], *, reps: int, warmup: int = 1, calls_per_sample: int = 1) -> Timing:
    """`warmup` calls of `fn()` (compilation, clocks ramping up; only the first one's time is
    kept, as `first_s`), then `reps` timed ones. Each call waits for what `fn` returns (`jax.block_until_ready`: dispatch is
    asynchronous; an `fn` that waits itself returns None), and a sample is its seconds over
    `calls_per_sample`, the calls `fn` makes or chains."""
    import jax

    def call() -> float:
        start = time.perf_counter()
        outputs = fn()
        if outputs is not None:
            jax.block_until_ready(outputs)
        return time.perf_counter() - start

    warm = [call() for _ in range(warmup)]
    samples = [call() / calls_per_sample for _ in range(reps)]
    first = warm[0] if warm else None
    return Timing(statistics.median(samples), min(samples), max(samples), tuple(samples), first)
