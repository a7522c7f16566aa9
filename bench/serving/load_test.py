"""Load test of `dflash-jax serve`: N concurrent streaming chat clients on 127.0.0.1.

For each mode (DFlash, and autoregressive with --no-drafter, in the same run) it starts a
server subprocess on a free port, waits for /health to say ready, and at each concurrency level runs a
warm-up round (untimed: with --warmup none it compiles what the level needs) and then
`--rounds` requests per client. Reported per level: output tokens/s (all completion tokens
over the level's wall time), time to first token and inter-token latency p50/p99 over
requests (inter-token latency of a request: (last chunk - first chunk) / (tokens - 1)), and
the mean accepted length (tokens per verify cycle, from `meta_info`). With --engine-baseline it
also runs the DFlash Engine alone (no HTTP) in a subprocess with the same flags, one request at
a time over the same prompts, and reports the same inter-token latency, so the server's own
cost at concurrency 1 reads as a ratio. Writes JSON to --out.

    python -m bench.serving.load_test --out bench/results/raw/serve.json        # H200: demo pair, 1/4/16/64
    python -m bench.serving.load_test --concurrency 1,4 --rounds 2 --max-tokens 32 \\
        --server-args "--dtype float32 --max-num-reqs 4 --max-num-tokens 32 --max-model-len 512 --warmup none" \\
        --out /tmp/serve-cpu.json                                                # a small CPU run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench import harness
from bench.serving.server import Server, tree_env
from dflash_jax.demo import QUESTIONS

MODES = {"dflash": [], "autoregressive": ["--no-drafter"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_output_arguments(parser, out_required=True)
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated client counts")
    parser.add_argument("--rounds", type=int, default=4, help="timed requests per client at each level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=Path, help="a file of prompts, one a line (default: the demo's questions)")
    parser.add_argument("--modes", default="dflash,autoregressive", help=f"comma-separated, of {sorted(MODES)}")
    parser.add_argument("--server-args", default="", help="more flags for `dflash-jax serve` (one string)")
    parser.add_argument("--startup-timeout", type=float, default=1800, help="seconds for a server to get ready")
    parser.add_argument("--level-timeout", type=float, default=600, help="seconds one level may take")
    parser.add_argument("--engine-baseline", action="store_true",
                        help="also time the Engine alone at concurrency 1 (a subprocess, the same flags)")
    parser.add_argument("--engine-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    prompts = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()] if args.prompts \
        else list(QUESTIONS)
    if args.engine_worker:
        print(json.dumps(engine_alone(prompts, args.rounds, args.max_tokens, shlex.split(args.server_args))))
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    # The server subprocesses own the device: this process asks a child what it is.
    record = harness.Record(__spec__.name, args, argv, packages=("fastapi", "uvicorn", "httpx"),
                            devices_in_subprocess=True)
    results = {"modes": {}}
    for mode in args.modes.split(","):
        with Server(MODES[mode] + shlex.split(args.server_args), args.startup_timeout) as server:
            results["modes"][mode] = {"startup_s": server.startup_s, "levels": [
                asyncio.run(run_level(server.url, prompts, c, args.rounds, args.max_tokens, args.level_timeout))
                for c in levels]}
        for level in results["modes"][mode]["levels"]:
            print(level_line(mode, level, 15), flush=True)
    if args.engine_baseline:
        worker = subprocess.run([sys.executable, "-m", __spec__.name, "--engine-worker", "--out", str(args.out),
                                 "--rounds", str(args.rounds), "--max-tokens", str(args.max_tokens), "--server-args",
                                 args.server_args, *(["--prompts", str(args.prompts)] if args.prompts else [])],
                                capture_output=True, text=True, env=tree_env(), cwd=harness.ROOT,
                                timeout=args.startup_timeout + args.level_timeout)
        if worker.returncode:
            raise SystemExit(f"the Engine baseline failed:\n{worker.stderr[-2000:]}")
        results["engine_alone"] = json.loads(worker.stdout.strip().splitlines()[-1])
        print("engine alone    " + "  ".join(f"{k}={v:.4g}" for k, v in results["engine_alone"].items()), flush=True)
    record.write(results)


async def run_level(url: str, prompts: list[str], concurrency: int, rounds: int, max_tokens: int,
                    timeout: float) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        warm = [prompts[i % len(prompts)] for i in range(concurrency)]
        await asyncio.gather(*(one_request(http, chat(p), min(max_tokens, 16)) for p in warm))

        async def client(c: int) -> list[dict]:
            return [await one_request(http, chat(prompts[(c * rounds + r) % len(prompts)]), max_tokens)
                    for r in range(rounds)]

        start = time.perf_counter()
        try:
            per_client = await asyncio.wait_for(asyncio.gather(*(client(c) for c in range(concurrency))), timeout)
        except asyncio.TimeoutError:
            raise SystemExit(f"concurrency {concurrency} took over {timeout:.0f} s; lower --rounds or --max-tokens")
        wall = time.perf_counter() - start
    return {"concurrency": concurrency, **summary([r for rs in per_client for r in rs], wall)}


def summary(done: list[dict], wall: float) -> dict:
    """Requests' throughput, TTFT and inter-token percentiles and mean accepted length."""
    tokens = sum(r["tokens"] for r in done)
    cycles = sum(r["cycles"] for r in done)
    ttft = [r["ttft_s"] for r in done]
    itl = [r["itl_s"] for r in done if r["itl_s"] is not None]
    return {
        "requests": len(done), "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99),
        "mean_accepted_length": sum(r["accepted"] for r in done) / cycles if cycles else 0.0,
    }


def level_line(name: str, level: dict, width: int) -> str:
    """One printed line of a level's results."""
    return f"{name:{width}s} " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in level.items())


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


async def one_request(http: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> dict:
    """One greedy streamed chat request: its tokens, TTFT, inter-token latency, verify cycles
    and accepted tokens, cached prompt tokens and text."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "return_meta_info": True}
    sent = time.perf_counter()
    first = last = None
    usage, meta, text = {}, {}, []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"the server answered {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"the server failed a request: {chunk['error']['message']}")
            usage = chunk.get("usage") or usage
            meta = chunk.get("meta_info") or meta
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
                text.append(chunk["choices"][0]["delta"]["content"])
    tokens = usage.get("completion_tokens", 0)
    cycles = meta.get("spec_verify_ct", 0)
    return {"tokens": tokens, "ttft_s": (first or time.perf_counter()) - sent, "cycles": cycles,
            "accepted": meta.get("spec_accept_length", 0.0) * cycles,
            "itl_s": (last - first) / (tokens - 1) if first is not None and tokens > 1 else None,
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "prompt_tokens": usage.get("prompt_tokens", 0), "text": "".join(text)}


def engine_alone(prompts: list[str], rounds: int, max_tokens: int, server_args: list[str]) -> dict:
    """The server's Engine (built by `serve`'s own loader from the same flags) decoding the
    same greedy chat requests one at a time, timed per step as the stream would see them."""
    from dflash_jax import SamplingParams
    from dflash_jax.cli import parse_args
    from dflash_jax.serve.cli import load_engine

    engine, tokenizer, _ = load_engine(parse_args(["serve", *server_args]))
    engine.precompile()
    itl, tokens_total, wall_total, cycles, accepted = [], 0, 0.0, 0, 0.0
    for i in range(-1, rounds):  # request -1 warms up, untimed; then client 0's prompts of a level
        ids = tokenizer.encode([{"role": "user", "content": prompts[max(i, 0) % len(prompts)]}])
        params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0,
                                stop_token_ids=tuple(sorted(tokenizer.stop_token_ids)))
        start = time.perf_counter()
        request_id = engine.add_request(ids, params)
        first = last = None
        while engine.has_unfinished():
            if any(o.request_id == request_id and o.new_token_ids for o in engine.step()):
                last = time.perf_counter()
                first = first or last
        tokens = len(engine.output(request_id))
        stats = engine.stats(request_id)
        engine.release(request_id)
        if i < 0:
            continue
        tokens_total, wall_total = tokens_total + tokens, wall_total + (last - start)
        cycles, accepted = cycles + len(stats.accepted_lengths), accepted + sum(stats.accepted_lengths)
        if tokens > 1:
            itl.append((last - first) / (tokens - 1))
    return {"requests": rounds, "output_tokens": tokens_total, "output_tokens_per_s": tokens_total / wall_total,
            "itl_p50_s": _pct(itl, 50), "mean_accepted_length": accepted / cycles if cycles else 0.0}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if q < 100 else max(values)


if __name__ == "__main__":
    main()
