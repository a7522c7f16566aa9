"""Where a request's time to first token goes, without HTTP: the chat template and tokenizer,
`Engine.add_request`, and each `Engine.step()` until the request's first token, for a prompt
behind a long system prompt that misses the prefix cache, one that hits it, and a short
prompt alone. With `--model` a random-weight pair of a larger shape (token-id prompts, no
tokenizer) shows the same at a target whose prefill costs more than the host's fixed work.

The Engine is the one `dflash-jax serve` builds from `--server-args` (its defaults unless
given; repeat the flag to compare variants in one run), every program compiled first; requests run one at a time, each to its end, as at one
client. A step's time is split into its launch (scheduling, inputs, dispatch:
`Engine.last_launch_s`) and the rest (waiting for the step before to finish, then reading its
tokens). Medians over `--reps` requests of each kind.

    python -m bench.serving.first_token --out bench/results/raw/first-token.json                    # H200: demo pair
    python -m bench.serving.first_token --model qwen3-8b --out bench/results/raw/first-token-8b.json     # H200
    python -m bench.serving.first_token --reps 2 --prefix-tokens 300 --server-args "--dtype float32 --max-model-len 1024" --out /tmp/ft.json  # CPU
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time

from bench import harness
from bench.serving.shared_prefix import system_prompt
from bench.shapes import MODELS
from dflash_jax.demo import QUESTIONS


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_output_arguments(parser, out_required=True)
    parser.add_argument("--model", choices=["demo", *sorted(MODELS)], default="demo",
                        help="the demo pair (chat prompts through its tokenizer), or random models of these shapes "
                        "(random token-id prompts, nothing to tokenize)")
    parser.add_argument("--reps", type=int, default=8, help="timed requests of each kind")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument("--prefix-tokens", type=int, default=2048, help="about how long the system prompt is")
    parser.add_argument("--server-args", action="append",
                        help="flags of `dflash-jax serve` (one string); repeated: one Engine each, in turn")
    args = parser.parse_args(argv)
    record = harness.Record(__spec__.name, args, argv)
    results = {}
    for server_args in args.server_args or [""]:
        engine, prompts = (demo_engine if args.model == "demo" else random_engine)(server_args, args)
        results[server_args] = measure(engine, prompts, args, label=server_args or "defaults")
        record.write(results)
        del engine


def demo_engine(server_args: str, args: argparse.Namespace):
    """The Engine `serve` builds from `server_args`, every program compiled, and chat prompts
    (kind, i) -> a function that tokenizes them as the server does, with the tokenizer's stops."""
    from dflash_jax.cli import parse_args
    from dflash_jax.serve.cli import load_engine

    engine, tokenizer, _ = load_engine(parse_args(["serve", *shlex.split(server_args)]))
    engine.precompile()
    system, stops = system_prompt(args.prefix_tokens), sorted(tokenizer.stop_token_ids)

    def prompt(kind: str, i: int):
        question = {"role": "user", "content": f"(request {i}) {QUESTIONS[i % len(QUESTIONS)]}"}
        # A miss starts its system prompt differently, so not even its first page is cached.
        head = f"Session {i}. " if kind == "miss" else ""
        messages = [question] if kind == "short" else [{"role": "system", "content": head + system}, question]
        return lambda: tokenizer.encode(messages), stops

    return engine, prompt


def random_engine(server_args: str, args: argparse.Namespace):
    """An Engine of random models of `--model`'s shapes with `serve`'s sizes from
    `server_args`, and random token-id prompts (no stops: every answer runs its length, so the
    untimed request of a kind compiles what its timed ones run)."""
    import numpy as np

    import dflash_jax
    from bench.random_models import build_pair
    from dflash_jax.cli import parse_args

    flags = parse_args(["serve", *shlex.split(server_args)])
    pair = build_pair(args.model)
    engine = dflash_jax.Engine(pair.target, pair.drafter, max_num_reqs=flags.max_num_reqs,
                               max_num_tokens=flags.max_num_tokens,
                               max_model_len=flags.max_model_len or 2 * (args.prefix_tokens + 64 + args.max_tokens),
                               cycles_per_step=flags.cycles_per_step, prefix_caching=flags.prefix_caching)
    vocab = pair.target.cfg.vocab_size
    system = np.random.default_rng(0).integers(0, vocab, args.prefix_tokens).tolist()

    def prompt(kind: str, i: int):
        question = np.random.default_rng([1, i + 2]).integers(0, vocab, 32).tolist()
        head = [] if kind != "miss" else np.random.default_rng([2, i + 2]).integers(0, vocab, 1).tolist()
        ids = question if kind == "short" else head + system + question
        return lambda: ids, []

    return engine, prompt


def measure(engine, prompt, args: argparse.Namespace, label: str) -> dict:
    """The kinds' medians, each request alone; a first request caches the shared system prompt."""
    run_one(engine, *prompt("hit", -1), args.max_tokens)
    results = {}
    for kind in ("short", "miss", "hit"):
        run_one(engine, *prompt(kind, -2), args.max_tokens)  # untimed
        results[kind] = summarize([run_one(engine, *prompt(kind, i), args.max_tokens) for i in range(args.reps)])
        print(f"[{label}] " + line(kind, results[kind]), flush=True)
    return results


def run_one(engine, encode, stops: list[int], max_tokens: int) -> dict:
    """One request alone, timed part by part up to its first token, then run to its end."""
    from dflash_jax.engine import SamplingParams

    start = time.perf_counter()
    ids = encode()
    encoded = time.perf_counter()
    request_id = engine.add_request(ids, SamplingParams(max_new_tokens=max_tokens, stop_token_ids=stops))
    added = time.perf_counter()
    steps, first = [], None
    while first is None:
        before = time.perf_counter()
        outputs = engine.step()
        after = time.perf_counter()
        steps.append((after - before, engine.last_launch_s))
        if any(o.request_id == request_id and o.new_token_ids for o in outputs):
            first = after
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats(request_id)
    engine.release(request_id)
    return {"prompt_tokens": len(ids), "cached_tokens": stats.num_cached_tokens, "encode_s": encoded - start,
            "add_s": added - encoded, "steps": len(steps), "launch_s": sum(s[1] for s in steps),
            "wait_s": sum(s[0] - s[1] for s in steps), "ttft_s": first - start}


def summarize(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def line(kind: str, r: dict) -> str:
    ms = {k: 1e3 * r[k] for k in ("encode_s", "add_s", "launch_s", "wait_s", "ttft_s")}
    return (f"{kind:6s} prompt {r['prompt_tokens']:6.0f} cached {r['cached_tokens']:6.0f}  TTFT {ms['ttft_s']:7.2f} ms"
            f" = encode {ms['encode_s']:6.2f} + add {ms['add_s']:5.2f} + {r['steps']:.0f} steps"
            f" (launch {ms['launch_s']:6.2f} + wait {ms['wait_s']:6.2f})")


if __name__ == "__main__":
    main()
