"""Start-up times of the demo pair: `dflash-jax demo`, `dflash-jax serve` and a first `generate`.

Each mode runs twice in fresh processes on one new cache folder: cold (its compilation cache
empty) and warm (the same folder again, as a second start finds it). The SmolLM2 target is
linked into that folder from --source-cache (converted there by an earlier `dflash-jax demo`),
so no run downloads or converts anything and nothing needs the network. Timed:

- demo: the command's wall time (it prints its answers at the end; no earlier token to time);
- serve: until the port answers /health ("accepting": one request's programs are compiled)
  and until /health says ready (every step program compiled), from the process start;
- generate: in a fresh Python process, the imports and model loading, the first
  `dflash_jax.generate` call (which compiles, or loads from the cache) and a second one.

    python -m bench.serving.startup --out bench/results/raw/startup.json            # H200: defaults
    python -m bench.serving.startup --modes serve,generate --server-args "--max-num-reqs 4" \\
        --demo-args "--max-new-tokens 32" --out /tmp/startup-cpu.json               # a smaller CPU run

Each run is bounded by --timeout seconds, and no run starts after --budget seconds in all.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.serving.server import Server, tree_env

MODES = ("demo", "serve", "generate")
LINKED = ("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf")  # demo.TARGET_DIR_NAME and its GGUF source

# The first generate call of a fresh process: argv is the cache folder, max new tokens, dtype.
GENERATE = """
import json, sys, time
start = time.perf_counter()
from pathlib import Path
from dflash_jax.compile_cache import enable_compile_cache
cache, max_new_tokens, dtype = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
enable_compile_cache(cache / "xla")
import jax
import dflash_jax
from dflash_jax import demo
from dflash_jax.tokenizer import ChatTokenizer
target_dir = demo.smollm2_target(cache)
target = dflash_jax.load_target(target_dir, dtype=dtype)
drafter = dflash_jax.load_drafter(demo.DEFAULT_DRAFTER, dtype=dtype)
tokenizer = ChatTokenizer(target_dir)
prompt = tokenizer.encode([{"role": "user", "content": demo.QUESTIONS[0]}])
block_size = drafter.cfg.trained_block_size
if jax.default_backend() == "cpu":  # the demo's CPU default
    block_size = min(block_size, 8 if dtype == "bfloat16" else 4)
loaded = time.perf_counter()
times = []
for _ in range(2):
    result = dflash_jax.generate(target, drafter, [prompt], block_size=block_size, max_new_tokens=max_new_tokens,
                                 stop_token_ids=tokenizer.stop_token_ids)
    times.append(time.perf_counter())
print(json.dumps({"load_s": loaded - start, "first_call_s": times[0] - loaded, "second_call_s": times[1] - times[0],
                  "tokens": result.num_tokens, "device": jax.devices()[0].device_kind, "block_size": block_size}))
"""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_output_arguments(parser, out_required=True)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--server-args", default="", help="more flags for `dflash-jax serve` (one string)")
    parser.add_argument("--demo-args", default="", help="more flags for `dflash-jax demo` (one string)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens of each generate call")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="for generate")
    parser.add_argument("--source-cache", type=Path,
                        default=Path(os.environ.get("DFLASH_JAX_CACHE") or "~/.cache/dflash-jax").expanduser(),
                        help="a cache folder where `dflash-jax demo` has converted SmolLM2 already")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds one run may take")
    parser.add_argument("--budget", type=float, default=5400, help="seconds after which no further run starts")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; pick of {list(MODES)}")
    if not (args.source_cache / LINKED[0]).is_dir():
        parser.error(f"{args.source_cache / LINKED[0]} is missing; run `dflash-jax demo` once (it needs the network "
                     "then) or pass --source-cache")
    # The runs' subprocesses own the device: this process asks a child what it is.
    record = harness.Record(__spec__.name, args, argv, packages=("fastapi", "uvicorn", "httpx"),
                            devices_in_subprocess=True)
    results = {"runs": {}}
    deadline = time.perf_counter() + args.budget
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix=f"dflash-startup-{mode}-") as cache:
            for name in LINKED:
                if (args.source_cache / name).exists():
                    (Path(cache) / name).symlink_to(args.source_cache / name)
            for start in ("cold", "warm"):
                if time.perf_counter() > deadline:
                    print(f"{mode} {start}: skipped, past --budget", flush=True)
                    continue
                load = os.getloadavg()[0]  # a shared machine's other work slows compilation too
                run = {**RUNS[mode](Path(cache), args), "load_avg_1m_before": load}
                results["runs"][f"{mode}/{start}"] = run
                print(f"{mode:8s} {start}: " + "  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                                        for k, v in run.items()), flush=True)
                record.write(results)


def run_demo(cache: Path, args) -> dict:
    start = time.perf_counter()
    done = _run([sys.executable, "-m", "dflash_jax.cli", "demo", "--cache-dir", str(cache),
                 *shlex.split(args.demo_args)], args.timeout)
    return {"wall_s": time.perf_counter() - start, "speedup_line": done.stdout.strip().splitlines()[-1]}


def run_serve(cache: Path, args) -> dict:
    flags = ["--cache-dir", str(cache), *shlex.split(args.server_args)]
    with Server(flags, args.timeout, poll_s=0.2) as server:
        return {"accepting_s": server.accepting_s, "ready_s": server.startup_s}


def run_generate(cache: Path, args) -> dict:
    start = time.perf_counter()
    done = _run([sys.executable, "-c", GENERATE, str(cache), str(args.max_new_tokens), args.dtype], args.timeout)
    return {"process_s": time.perf_counter() - start, **json.loads(done.stdout.strip().splitlines()[-1])}


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=tree_env(), cwd=harness.ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done


RUNS = {"demo": run_demo, "serve": run_serve, "generate": run_generate}

if __name__ == "__main__":
    main()
