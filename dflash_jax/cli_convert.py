"""`dflash-jax convert HF_DIR OUT_DIR`: the conversion subcommand."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash_jax.formats.hf_to_nnx import convert_checkpoint
from dflash_jax.quantization import DEFAULT_QUANTIZE_BLOCK, QUANTIZE_CHOICES

DTYPES = ("bfloat16", "float16", "float32")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert a HF target or z-lab DFlash drafter folder, or a GGUF file, to an orbax checkpoint",
        description="Convert a HF folder (config.json + safetensors, or .bin/.pt with the torch "
        "extra) to an orbax checkpoint. Target or drafter is read from config.json's architectures. "
        "HF_DIR may also be a llama.cpp .gguf file (Llama targets; needs the gguf extra): it is "
        "dequantized, and its tokenizer is written as tokenizer.json next to the weights.",
    )
    parser.add_argument("hf_dir", type=Path, help="HF model folder, or a .gguf file")
    parser.add_argument("out_dir", type=Path, help="output folder (must not exist unless --force)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="dtype of the activations and of the float parameters (default: as stored)")
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES,
                        help="store the weights of a float model's products (a target's decoder layers, a drafter's "
                        "fc and layers) in 8 bits, weight-only: int8, or fp8 (e4m3); FP8 and Q8_0 checkpoints stay "
                        "8-bit without it")
    parser.add_argument("--quantize-block", type=int, default=DEFAULT_QUANTIZE_BLOCK,
                        help="input rows sharing a scale (per output channel) with --quantize; 0: one scale per "
                        f"output channel (default {DEFAULT_QUANTIZE_BLOCK}, the more accurate on SmolLM2)")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    parser.set_defaults(run=run, writes_files=True)


def run(args: argparse.Namespace) -> None:
    cfg, dtype = convert_checkpoint(args.hf_dir, args.out_dir, dtype=args.dtype, force=args.force, progress=True,
                                    quantize=args.quantize, quantize_block=args.quantize_block or None)
    weights = cfg.quantization
    eight_bit = f", {weights.weights} weights" if weights is not None else ""
    print(f"wrote {cfg.kind} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {dtype}{eight_bit}) to {args.out_dir}")
