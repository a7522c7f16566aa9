"""Everyday chat requests written by the target itself (self-instruct), as training prompts.

The template x topic requests of `prompts.everyday_prompts` run out at 1690, and a drafter
learns a target's answers to the requests it is trained on. So the target writes more: it
continues a numbered list of three template requests ("Messages that people sent to an AI
assistant ... 4."), in plain text, sampled. Its lines 4, 5, ... become new requests,
phrased the way this target phrases them; `build_drafter_data` then has the target answer
each one like any other prompt. Asked directly ("Write one question about bread") in its
chat template, SmolLM2-135M mostly wrote about itself instead; the list gave usable
requests on nearly every row.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

import numpy as np

from dflash_jax.models import Target
from dflash_jax.train.prompts import ACTIVITIES, TOPICS, template_requests

EXTRA_SUBJECTS = (
    "cooking", "travel", "health", "history", "science", "writing", "work", "school", "sports", "nature",
    "animals", "space", "art", "films", "books", "games", "family", "weather", "language", "technology",
    "the ocean", "cities", "food", "holidays", "jobs", "physics", "chemistry", "biology", "geography", "poetry",
)
LIST_PROMPT = ("Messages that people sent to an AI assistant, one per line. The last one is about {subject}.\n"
               "1. {0}\n2. {1}\n3. {2}\n4.")
_NUMBERED = re.compile(r"^\s*\d+\s*[.)]\s*(.*)$")


def self_instruct_prompts(
    target: Target,
    encode_text: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    count: int,
    *,
    seed: int = 0,
    exclude: Iterable[str] = (),
    temperature: float = 0.8,
    max_new_tokens: int = 64,
    batch_size: int = 256,
    max_rounds: int = 20,
) -> list[list[dict[str, str]]]:
    """`count` distinct chat requests written by `target`, none equal to one in `exclude`
    (held-out or demo prompts; compared case- and space-insensitively) or to a template
    request.

    Each round continues `batch_size` lists (three random template requests, a random
    subject) at `temperature` and keeps the new lines `clean_request` accepts. ValueError if
    `max_rounds` rounds do not give `count` (a target too small to continue a list)."""
    from dflash_jax import generate_autoregressive  # looked up per call: tests stand a fake in

    examples = template_requests()
    subjects = TOPICS + ACTIVITIES + EXTRA_SUBJECTS
    rng = np.random.default_rng(seed)
    seen = {_key(text) for text in (*exclude, *examples)}
    requests: list[str] = []
    for round_index in range(max_rounds):
        lists = [LIST_PROMPT.format(*(examples[i] for i in rng.choice(len(examples), 3, replace=False)),
                                    subject=subjects[rng.integers(len(subjects))])
                 for _ in range(batch_size)]
        result = generate_autoregressive(
            target, [encode_text(text) for text in lists], max_new_tokens=max_new_tokens,
            temperature=temperature, seed=seed * max_rounds + round_index,
        )
        for token_ids in result.token_ids:
            for request in requests_in_reply(decode(list(token_ids))):
                if _key(request) not in seen:
                    seen.add(_key(request))
                    requests.append(request)
                    if len(requests) == count:
                        return [[{"role": "user", "content": r}] for r in requests]
    raise ValueError(
        f"the target wrote {len(requests)} usable distinct requests in {max_rounds} rounds of {batch_size} "
        f"lists, not {count}: ask for fewer, or raise max_rounds."
    )


def requests_in_reply(reply: str) -> list[str]:
    """The list's new items: the reply's first line (item 4), then each following numbered
    line up to the first line that is not one. Only lines that end (a newline follows) count:
    the last may be cut by the token limit. Items `clean_request` rejects are dropped."""
    lines = reply.split("\n")[:-1]
    if not lines:
        return []
    items = [lines[0]]
    for line in lines[1:]:
        numbered = _NUMBERED.match(line)
        if numbered is None:
            break
        items.append(numbered.group(1))
    return [r for r in map(clean_request, items) if r is not None]


def clean_request(text: str) -> str | None:
    """`text` stripped of quotes; None unless it reads like a request: 10 to 300
    characters, mostly letters, at least three words."""
    line = text.strip().strip("\"'“”*").strip()
    letters = sum(c.isalpha() for c in line)
    if not 10 <= len(line) <= 300 or letters < 0.6 * len(line) or len(line.split()) < 3:
        return None
    return line


def _key(text: str) -> str:
    return " ".join(text.lower().split())
