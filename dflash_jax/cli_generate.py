"""`dflash-jax generate`: decode prompts with a target (and a drafter, for DFlash) and print the answers."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from dflash_jax.cli_devices import add_device_arguments, start_devices
from dflash_jax.compile_cache import add_cache_arguments
from dflash_jax.kernels import add_kernels_argument


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="answer prompts with a target, speculatively when a drafter is given",
        description="Tokenize the prompts with the target's tokenizer (its chat template by default), "
        "generate (DFlash with --drafter, autoregressive without), print each answer and a stats line. "
        "TARGET and DRAFTER may be converted (orbax) or HF folders; TARGET may be a .gguf file.",
    )
    parser.add_argument("--target", type=Path, required=True, help="target model folder or .gguf file")
    parser.add_argument("--drafter", type=Path, help="DFlash drafter folder (default: autoregressive decoding)")
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", help="a text prompt; repeat for a batch")
    prompts.add_argument("--prompt-ids", action="append", help="comma-separated token ids; repeat for a batch")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="longest answer per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 keeps every one")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample among the most likely tokens holding this much probability; 1 keeps every one")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled tokens (with --temperature above 0)")
    parser.add_argument("--block-size", type=int, help="verified block: last token + drafts (default: the drafter's; "
                        "on a mixture-of-experts target the block its cycle cost favours)")
    parser.add_argument("--draft-block-size", type=int,
                        help="block the drafter fills, of which --block-size - 1 drafts are verified (default: the drafter's)")
    parser.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=None,
        help="wrap text prompts in the chat template (default: when the tokenizer has one)",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="compute dtype of both models (default: the target's stored dtype; bfloat16 is "
                        "faster on GPUs and, for SmolLM2-135M, on a 2-core CPU too; float32 is where DFlash's greedy "
                        "tokens always equal autoregressive decoding's)")
    add_draft_sampling_argument(parser)
    add_kernels_argument(parser)
    add_device_arguments(parser)
    add_cache_arguments(parser)
    parser.add_argument(
        "--warmup", action="store_true",
        help="run once untimed first, so the stats line measures generation without compilation",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    import dflash_jax
    from dflash_jax.cli_errors import quiet_checkpoint_reads
    from dflash_jax.tokenizer import load_tokenizer

    if (args.block_size is not None or args.draft_block_size is not None) and args.drafter is None:
        raise ValueError("--block-size and --draft-block-size set the draft blocks; they need --drafter.")
    check_args(args)
    mesh = start_devices(args)
    tokenizer = load_tokenizer(args.target)
    if args.prompt and tokenizer is None:
        raise ValueError(f"{args.target} has no tokenizer.json to tokenize text with; pass --prompt-ids instead.")
    prompts = _text_prompts(tokenizer, args.prompt, args.chat) if args.prompt else _id_prompts(args.prompt_ids)
    with quiet_checkpoint_reads():
        target = dflash_jax.load_target(args.target, dtype=args.dtype, mesh=mesh)
    sampling = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop_token_ids=tokenizer.stop_token_ids if tokenizer else None, kernels=args.kernels,
    )
    if args.drafter:
        with quiet_checkpoint_reads():
            drafter = dflash_jax.load_drafter(args.drafter, dtype=target.dtype, mesh=mesh)
        decode = functools.partial(dflash_jax.generate, target, drafter, prompts, block_size=args.block_size,
                                   draft_block_size=args.draft_block_size, draft_sampling=args.draft_sampling,
                                   **sampling)
    else:
        decode = functools.partial(dflash_jax.generate_autoregressive, target, prompts, **sampling)
    if args.warmup:
        decode()
    result = decode()
    for token_ids in result.token_ids:
        print(tokenizer.decode(token_ids) if tokenizer else ",".join(map(str, token_ids)))
        print()
    print(stats_line(result, compiled_in=not args.warmup))


def add_draft_sampling_argument(parser) -> None:
    """--draft-sampling, for every command that decodes with a drafter."""
    from dflash_jax.sampling import DEFAULT_DRAFT_SAMPLING, DRAFT_SAMPLING

    parser.add_argument(
        "--draft-sampling", choices=DRAFT_SAMPLING, default=DEFAULT_DRAFT_SAMPLING,
        help="how sampled requests (temperature > 0) propose drafts: 'sample' draws each from the drafter's "
        "distribution, 'argmax' takes its most likely tokens; the output follows the target's distribution "
        "either way, and greedy decoding is the same with both",
    )


def check_args(args: argparse.Namespace) -> None:
    """Values and model folders refused before anything is loaded (generate checks them again)."""
    from dflash_jax.checkpoint import check_checkpoint_folder
    from dflash_jax.sampling import validate_sampling_params

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}.")
    for flag, value in (("--block-size", args.block_size), ("--draft-block-size", args.draft_block_size)):
        if value is not None and value < 2:
            raise ValueError(f"{flag} must be at least 2 (the last token and one draft), got {value}.")
    validate_sampling_params(args.temperature, args.top_k, args.top_p)
    for path in (args.target, args.drafter):
        if path is not None:
            if not path.exists():
                raise FileNotFoundError(f"{path} does not exist; give a converted or a HF model folder.")
            check_checkpoint_folder(path)


def stats_line(result, *, compiled_in: bool) -> str:
    """Tokens, seconds, tokens/s and mean accepted length of one generate call."""
    speed = result.num_tokens / result.elapsed_s if result.elapsed_s > 0 else float("inf")
    note = " (includes compilation; --warmup excludes it)" if compiled_in else ""
    return (
        f"{result.num_tokens} tokens in {result.elapsed_s:.2f} s: {speed:.1f} tokens/s{note}, "
        f"mean accepted length {result.mean_accepted_length:.2f}"
    )


def _text_prompts(tokenizer, texts: list[str], chat: bool | None) -> list[list[int]]:
    """Token ids of each text, through the chat template unless chat is off (or there is none)."""
    if chat and tokenizer.template is None:
        raise ValueError("the target's tokenizer has no chat template; drop --chat or pass --no-chat.")
    if chat is False or tokenizer.template is None:
        return [tokenizer.encode_text(text) for text in texts]
    return [tokenizer.encode([{"role": "user", "content": text}]) for text in texts]


def _id_prompts(specs: list[str]) -> list[list[int]]:
    try:
        return [[int(t) for t in spec.split(",") if t.strip()] for spec in specs]
    except ValueError:
        raise ValueError(f"--prompt-ids takes comma-separated integers like 1,2,3; got {specs!r}.") from None
