"""Serving benchmark with shared prefixes: multi-turn chats behind one long system prompt, with
and without prefix caching, DFlash and autoregressive.

Every client holds its own conversation (its own questions, the server's answers appended
turn by turn) behind the same system prompt of about `--prefix-tokens` tokens, as chat
traffic does. For each mode and caching choice it starts `dflash-jax serve` (with
`--no-prefix-caching` for "off"), and at each concurrency level runs an untimed round (one
short request per client: the programs it needs compile, and with caching the system
prompt's pages are cached, as on a server that has been up a while), then `--turns` timed
turns per client. Reported per level: output tokens/s, TTFT and inter-token p50/p99, TTFT
p50 of the first turns alone (the system prompt and one question), the share of prompt
tokens served from the cache, and the mean accepted length. Writes JSON to --out.

    python -m bench.serving.shared_prefix --out bench/results/raw/shared-prefix.json   # H200: demo pair
    python -m bench.serving.shared_prefix --concurrency 1,2 --turns 2 --max-tokens 16 --prefix-tokens 300 \\
        --server-args "--dtype float32 --max-model-len 1024 --warmup none" --out /tmp/prefix-cpu.json  # CPU
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import time

import httpx

from bench import harness
from bench.serving.load_test import MODES, _pct, level_line, one_request, summary
from bench.serving.server import Server
from dflash_jax.demo import QUESTIONS

CACHING = {"on": [], "off": ["--no-prefix-caching"]}


def system_prompt(num_tokens: int) -> str:
    """A deterministic system prompt of about `num_tokens` tokens (four characters a token)."""
    lines, size, rule = [], 0, 0
    while size < 4 * num_tokens:
        line = f"Rule {rule + 1}: when asked '{QUESTIONS[rule % len(QUESTIONS)]}', answer plainly and briefly."
        lines.append(line)
        size, rule = size + len(line) + 1, rule + 1
    return "You are a careful assistant. Follow these house rules.\n" + "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_output_arguments(parser, out_required=True)
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated client counts")
    parser.add_argument("--turns", type=int, default=3, help="timed turns of each client's conversation")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--prefix-tokens", type=int, default=2048, help="about how long the shared system prompt is")
    parser.add_argument("--modes", default="dflash,autoregressive", help=f"comma-separated, of {sorted(MODES)}")
    parser.add_argument("--caching", default="on,off", help=f"comma-separated, of {sorted(CACHING)}")
    parser.add_argument("--server-args", default="", help="more flags for `dflash-jax serve` (one string)")
    parser.add_argument("--startup-timeout", type=float, default=1800, help="seconds for a server to get ready")
    parser.add_argument("--level-timeout", type=float, default=600, help="seconds one level may take")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    system = system_prompt(args.prefix_tokens)
    record = harness.Record(__spec__.name, args, argv, packages=("fastapi", "uvicorn", "httpx"),
                            devices_in_subprocess=True)
    results = {"runs": {}}
    for mode in args.modes.split(","):
        for caching in args.caching.split(","):
            name = f"{mode}, caching {caching}"
            with Server(MODES[mode] + CACHING[caching] + shlex.split(args.server_args), args.startup_timeout) as server:
                results["runs"][name] = {"startup_s": server.startup_s, "levels": [
                    asyncio.run(run_level(server.url, system, c, args.turns, args.max_tokens, args.level_timeout))
                    for c in levels]}
            for level in results["runs"][name]["levels"]:
                print(level_line(name, level, 28), flush=True)
    record.write(results)


async def run_level(url: str, system: str, concurrency: int, turns: int, max_tokens: int, timeout: float) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4)

    def opening(c: int, turn: int) -> dict:
        return {"role": "user", "content": f"(client {c}) {QUESTIONS[(c + turn) % len(QUESTIONS)]}"}

    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        await asyncio.gather(*(one_request(http, [{"role": "system", "content": system}, opening(c, -1)], 8)
                               for c in range(concurrency)))

        async def conversation(c: int) -> list[dict]:
            messages, done = [{"role": "system", "content": system}], []
            for turn in range(turns):
                messages.append(opening(c, turn))
                answer = await one_request(http, list(messages), max_tokens)
                messages.append({"role": "assistant", "content": answer["text"]})
                done.append({**answer, "turn": turn})
            return done

        start = time.perf_counter()
        try:
            per_client = await asyncio.wait_for(asyncio.gather(*map(conversation, range(concurrency))), timeout)
        except asyncio.TimeoutError:
            raise SystemExit(f"concurrency {concurrency} took over {timeout:.0f} s; lower --turns or --max-tokens")
        wall = time.perf_counter() - start
    done = [r for rs in per_client for r in rs]
    first_turns = [r["ttft_s"] for r in done if r["turn"] == 0]
    return {
        "concurrency": concurrency, **summary(done, wall), "first_turn_ttft_p50_s": _pct(first_turns, 50),
        "prompt_tokens_mean": sum(r["prompt_tokens"] for r in done) / len(done),
        "cached_share": sum(r["cached_tokens"] for r in done) / max(sum(r["prompt_tokens"] for r in done), 1),
    }


if __name__ == "__main__":
    main()
