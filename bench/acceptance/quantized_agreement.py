"""How close an 8-bit target stays to its float original: along the float model's own greedy
answers (teacher forcing), how often the quantized model picks the same next token, and the
DFlash acceptance length with the quantized target against the float one.

Each variant is the float target with its decoder-layer weights quantized
(`dflash_jax.models.quantize_model`): int8 or fp8 (e4m3), one scale per output channel, or per
output channel and block of 128 input rows ("int8/128"). A "+head" suffix ("int8/128+head/32")
also rounds the LM head to 8-bit values, per vocabulary row and block of input rows (the
numbers an 8-bit head would compute, not a kernel of its own). "@MATRIX/B" suffixes before it
("int8@down_proj/128") give named decoder matrices their own block of input rows: such a
variant is the float target with every quantized matrix's weight replaced by the float value
of its 8-bit rounding (the numbers a target with per-matrix blocks would compute, up to the
float rounding of each scaled product), since a checkpoint holds one block for all. The
compute dtype is --dtype for all.

    python -m bench.acceptance.quantized_agreement --prompts diverse --out J            # the demo's SmolLM2
    python -m bench.acceptance.quantized_agreement --limit 1 --max-new-tokens 32 --out J  # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import harness
from bench.acceptance.prompt_sets import add_prompt_arguments, encoded_prompts, tau_per_category


def main(argv=None, adapt=None) -> None:
    """`adapt`: a function applied to each quantized variant's target before it runs (other
    benchmarks' probes: `bench.acceptance.activation_rounding`)."""
    from dflash_jax.demo import DEFAULT_DRAFTER

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_prompt_arguments(parser, "diverse")
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--variants", default="int8,fp8,int8/128,fp8/128",
                        help="comma-separated WEIGHTS[/BLOCK_IN][@MATRIX/BLOCK_IN...][+head[/BLOCK_IN]] "
                             "(weights int8 or fp8; MATRIX a decoder matrix, e.g. down_proj)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16, help="the verified block (the drafter's 16)")
    harness.add_output_arguments(parser)
    args = parser.parse_args(argv)
    import dflash_jax

    record = harness.Record(__spec__.name, args, argv)
    target_dir, tokenizer, prompts, categories = encoded_prompts(args, parser)
    float_target = dflash_jax.load_target(target_dir, dtype=args.dtype)
    drafter = dflash_jax.load_drafter(args.drafter, dtype=args.dtype)
    stops = sorted(tokenizer.stop_token_ids)
    answers = dflash_jax.generate_autoregressive(float_target, prompts, max_new_tokens=args.max_new_tokens,
                                                 stop_token_ids=stops).token_ids
    results = {"prompts": len(prompts), "tokens": int(sum(map(len, answers))), "variants": {}}
    for name in ["float", *args.variants.split(",")]:
        start = time.perf_counter()
        target = float_target if name == "float" else quantized_variant(float_target, name)
        if adapt is not None and name != "float":
            target = adapt(target)
        spec = dflash_jax.generate(target, drafter, prompts, max_new_tokens=args.max_new_tokens, stop_token_ids=stops,
                                   block_size=args.block_size)
        results["variants"][name] = {
            "agreement": agreement(target, prompts, answers),
            "tau": float(np.mean([a for lengths in spec.accepted_lengths for a in lengths])),
            "tau_per_category": tau_per_category(spec.accepted_lengths, categories),
            "seconds": time.perf_counter() - start,
        }
        print(f"{name:9s} " + json.dumps({k: v for k, v in results["variants"][name].items()
                                          if k != "tau_per_category"}), flush=True)
        record.write(results)


@dataclasses.dataclass(frozen=True)
class Variant:
    layers: Any  # the decoder matrices' WeightQuantization
    head: Any = None  # the LM head's, or None (float)
    matrices: tuple = ()  # (matrix name, its WeightQuantization) pairs that differ from `layers`


def parse_variant(name: str) -> Variant:
    """"WEIGHTS[/BLOCK][@MATRIX/BLOCK...][+head[/BLOCK]]" -> its `Variant`."""
    from dflash_jax.quantization import WeightQuantization

    layers, _, head = name.partition("+")
    layers, *overrides = layers.split("@")
    weights, _, block = layers.partition("/")
    _, _, head_block = head.partition("/")
    matrices = [override.partition("/") for override in overrides]
    if (weights not in ("int8", "fp8") or head.partition("/")[0] not in ("", "head")
            or not all(b.isdigit() for b in (block, head_block) if b)
            or not all(matrix.isidentifier() and b.isdigit() for matrix, _, b in matrices)):
        raise ValueError(f"variant {name!r}: write WEIGHTS[/BLOCK_IN][@MATRIX/BLOCK_IN...][+head[/BLOCK_IN]], e.g. "
                         "int8@down_proj/128+head/32 (weights int8 or fp8, blocks whole numbers of input rows)")
    return Variant(WeightQuantization(weights, int(block) if block else None),
                   WeightQuantization(weights, int(head_block) if head_block else None) if head else None,
                   tuple((matrix, WeightQuantization(weights, int(b))) for matrix, _, b in matrices))


def quantized_variant(float_target, name: str):
    """The float target with its decoder layers quantized as `name` says (with per-matrix
    blocks: rounded through 8 bits and kept float), and its LM head's weight replaced by its
    8-bit values' float equivalent where `name` has "+head"."""
    import jax.numpy as jnp

    from dflash_jax.models import quantize_model
    from dflash_jax.quantization import dequantize, quantize

    variant = parse_variant(name)
    target = rounded_in_float(float_target, variant) if variant.matrices else quantize_model(float_target,
                                                                                             variant.layers)
    if variant.head is not None:
        dtype = float_target.dtype
        weight_DV = target.unembed(jnp.eye(float_target.cfg.hidden_size, dtype=dtype)).astype(jnp.float32)
        values, scales = quantize(weight_DV, variant.head)
        target.use_head_weight(dequantize(values, scales, variant.head.block_in, dtype))
    return target


def rounded_in_float(float_target, variant: Variant):
    """`float_target` with each matrix that its 8-bit form holds in 8 bits (the abstract
    quantized model's layout, which has scales beside them) replaced by the float value of its
    rounding, per `variant.matrices`' block where named, else the layers'."""
    import jax
    from flax import nnx

    from dflash_jax.models import abstract_model, model_from_params
    from dflash_jax.quantization import dequantize, params_of, quantize

    quantized_cfg = dataclasses.replace(float_target.cfg, quantization=variant.layers)
    layout = nnx.to_pure_dict(nnx.state(abstract_model(quantized_cfg, float_target.dtype), nnx.Param))
    params = params_of(float_target)
    named = dict(variant.matrices)
    rounded = set()

    def round_matrices(tree: dict, shape: dict) -> None:
        for key, sub in shape.items():
            if isinstance(sub, dict) and "scale" in sub:
                quantization = named.get(key, variant.layers)
                values, scales = quantize(tree[key]["kernel"], quantization)
                tree[key]["kernel"] = dequantize(values, scales, quantization.block_in, tree[key]["kernel"].dtype)
                rounded.add(key)
            elif isinstance(sub, dict):
                round_matrices(tree[key], sub)
            elif key.endswith("_scale"):  # routed experts [E, in, out]: each expert alone
                name = key.removesuffix("_scale")
                quantization = named.get(name, variant.layers)
                tree[name] = jax.vmap(lambda w, q=quantization: dequantize(*quantize(w, q), q.block_in, w.dtype))(
                    tree[name])
                rounded.add(name)

    round_matrices(params, layout)
    if set(named) - rounded:
        raise ValueError(f"variant names {sorted(set(named) - rounded)}, which this target has no 8-bit form of; "
                         f"its 8-bit matrices are {sorted(rounded)}")
    return model_from_params(float_target.cfg, float_target.dtype, params)


def agreement(target, prompts: list[list[int]], answers: list[list[int]]) -> float:
    """The share of answer tokens that `target` also ranks first, given the answer before them."""
    from dflash_jax.dense import target_forward
    from pallas_kernels.common import next_pow2

    same = []
    for prompt, answer in zip(prompts, answers):
        ids = prompt + answer
        padded = np.zeros(next_pow2(len(ids)), np.int32)  # causal: padding after a position does not change it
        padded[: len(ids)] = ids
        logits = np.asarray(target_forward(target, padded)[0][len(prompt) - 1 : len(ids) - 1])
        same.append(logits.argmax(-1) == np.asarray(answer))
    return float(np.mean(np.concatenate(same)))


if __name__ == "__main__":
    main()
