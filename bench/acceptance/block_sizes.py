"""Expected accepted length for each (drafter block, verified drafts) pair, greedy, CPU-friendly.

Every anchor position of the target's own greedy answers is drafted at once with the dense
training forward (`train.forward.block_drafts`), with the drafter run on blocks of 4, 8 or 16
tokens; the accepted length of verifying the first N drafts is 1 + the matching prefix, capped
at N. Averaged over anchors, not over the cycles of a real run, but the same for every pair.

  python -m bench.acceptance.block_sizes --target SMOLLM2_DIR [--drafter DIR] [--out J]
"""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

import dflash_jax
from bench import harness
from dflash_jax.demo import DEFAULT_DRAFTER, QUESTIONS
from dflash_jax.models import model_from_params
from dflash_jax.tokenizer import ChatTokenizer
from dflash_jax.train.forward import block_drafts, target_logits_and_features
from dflash_jax.train.prompts import everyday_prompts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="converted SmolLM2 folder (tokenizer included)")
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER))
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--everyday", type=int, default=8, help="everyday requests added to the demo's questions")
    harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    record = harness.Record(__spec__.name, args, argv)
    target = dflash_jax.load_target(args.target)
    drafter = dflash_jax.load_drafter(args.drafter, dtype=target.dtype)
    tokenizer = ChatTokenizer(args.target)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS] + everyday_prompts(1690, 0)[-args.everyday :]
    prompts = [tokenizer.encode(m) for m in messages]
    answers = dflash_jax.generate_autoregressive(
        target, prompts, max_new_tokens=args.max_new_tokens, stop_token_ids=tokenizer.stop_token_ids
    ).token_ids
    params = nnx.to_pure_dict(nnx.state(drafter, nnx.Param))
    trained = drafter.cfg.trained_block_size
    print("| drafter block | " + " | ".join(f"verify {n} drafts" for n in (3, 7, 15) if n < trained) + " |")
    results = {}  # drafter block -> verified drafts -> expected accepted length
    for block in sorted({4, 8, trained}):
        sized = model_from_params(dataclasses.replace(drafter.cfg, trained_block_size=block), drafter.dtype, params)
        matched = []  # per anchor: drafts matching the greedy text before the first miss
        for prompt, answer in zip(prompts, answers):
            ids = np.asarray(prompt + answer, np.int32)
            _, features = target_logits_and_features(target, jnp.asarray(ids), sized.cfg.target_layer_ids)
            anchors = np.arange(len(prompt), len(ids) - 1, dtype=np.int32)
            drafts = np.asarray(block_drafts(target, sized, jnp.asarray(ids), features, jnp.asarray(anchors)))
            for row, anchor in enumerate(anchors):
                truth = ids[anchor + 1 : anchor + block]
                hits = np.flatnonzero(drafts[row, : len(truth)] != truth)
                matched.append((hits[0] if hits.size else len(truth), len(truth)))
        results[block] = {n: float(np.mean([1 + min(m, n, t) for m, t in matched])) for n in (3, 7, 15)
                          if n < min(block, trained)}
        cells = [f"{results[block][n]:.3f}" if n in results[block] else "" for n in (3, 7, 15) if n < trained]
        print(f"| {block} | " + " | ".join(cells) + " |", flush=True)
        record.write(results)


if __name__ == "__main__":
    main()
