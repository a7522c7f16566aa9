"""`dflash-jax serve` against `generate` on the same prompts, one request at a time: the
server's output tokens/s as a share of `generate`'s at batch 1 (DFlash) and of
`generate_autoregressive`'s (the server with --no-drafter).

The prompts are the demo's questions in the target's chat template, sent to /v1/completions as
token ids, so the server and `generate` decode the same ids, greedy, up to `--max-tokens` and
the tokenizer's stop tokens. `generate` runs first, in this process, on the models the server's
own loader builds from `--server-args` (compilation untimed: one untimed call per prompt);
then the server, in a subprocess with the same flags, once /health says every program is
compiled. A request's time is from sending it to its whole answer; tokens/s is all tokens over
all timed requests' time, per mode.

    python -m bench.serving.versus_generate --out J                                 # serve's defaults
    python -m bench.serving.versus_generate --server-args "--max-model-len 512" --out J
"""

from __future__ import annotations

import argparse
import shlex
import time

import httpx

from bench import harness
from bench.serving.server import Server
from dflash_jax.demo import QUESTIONS

MODES = {"dflash": [], "autoregressive": ["--no-drafter"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_output_arguments(parser, out_required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="timed passes over the prompts")
    parser.add_argument("--modes", default="dflash,autoregressive", help=f"comma-separated, of {sorted(MODES)}")
    parser.add_argument("--server-args", default="", help="flags of `dflash-jax serve` for both sides (one string)")
    parser.add_argument("--startup-timeout", type=float, default=3600, help="seconds for the server to get ready")
    args = parser.parse_args(argv)
    record = harness.Record(__spec__.name, args, argv, packages=("fastapi", "uvicorn", "httpx"))
    results = {}
    for mode in args.modes.split(","):
        flags = [*shlex.split(args.server_args), *MODES[mode]]
        offline, prompts = generate_side(flags, args.max_tokens, args.rounds)
        with Server(flags, args.startup_timeout) as server:
            served = server_side(server.url, prompts, args.max_tokens, args.rounds)
        results[mode] = {"generate": offline, "serve": served, "startup_s": server.startup_s,
                         "serve_over_generate": served["tokens_per_s"] / offline["tokens_per_s"]}
        print(f"{mode:15s} generate {offline['tokens_per_s']:8.1f} tok/s  serve {served['tokens_per_s']:8.1f} tok/s"
              f"  ratio {results[mode]['serve_over_generate']:.3f}", flush=True)
    record.write(results)


def generate_side(flags: list[str], max_tokens: int, rounds: int) -> tuple[dict, list[list[int]]]:
    """(tokens/s of `generate` or `generate_autoregressive` on the served models, the prompts' ids)."""
    import dflash_jax
    from dflash_jax.cli import parse_args
    from dflash_jax.serve.cli import load_models

    args = parse_args(["serve", *flags])
    models = load_models(args)
    prompts = [models.tokenizer.encode([{"role": "user", "content": q}]) for q in QUESTIONS]
    stops = sorted(models.tokenizer.stop_token_ids)

    def decode(ids):
        if models.drafter is None:
            return dflash_jax.generate_autoregressive(models.target, [ids], max_new_tokens=max_tokens,
                                                      stop_token_ids=stops)
        return dflash_jax.generate(models.target, models.drafter, [ids], max_new_tokens=max_tokens,
                                   stop_token_ids=stops, block_size=models.info.block_size,
                                   draft_sampling=args.draft_sampling)

    for ids in prompts:
        decode(ids)  # compiles, untimed
    tokens, seconds = 0, 0.0
    for _ in range(rounds):
        for ids in prompts:
            start = time.perf_counter()
            out = decode(ids)
            seconds += time.perf_counter() - start
            tokens += len(out.token_ids[0])
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}, prompts


def server_side(url: str, prompts: list[list[int]], max_tokens: int, rounds: int) -> dict:
    """Tokens/s of the server answering the prompts one at a time (one untimed pass first)."""
    with httpx.Client(base_url=url, timeout=3600) as http:

        def ask(ids) -> int:
            body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0}
            response = http.post("/v1/completions", json=body)
            if response.status_code != 200:
                raise SystemExit(f"the server answered {response.status_code}: {response.text[:300]}")
            return response.json()["usage"]["completion_tokens"]

        for ids in prompts:
            ask(ids)
        tokens, seconds = 0, 0.0
        for _ in range(rounds):
            for ids in prompts:
                start = time.perf_counter()
                tokens += ask(ids)
                seconds += time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


if __name__ == "__main__":
    main()
