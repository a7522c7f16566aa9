"""Training prompts for the requests a drafter meets where users decode and the Shakespeare
and everyday sets do not cover: math word problems and short code requests from templates,
and follow-ups built on the target's own answers (a second user turn after the answer, or a
request to rewrite or summarise it). A drafter learns the target's answers to the prompts it
trains on, so these widen what it has seen the target write: numbers and units, code, a
reply that refers to an earlier turn, text that restates a given passage.

Written for training only and independently of the held-out `bench/prompts/diverse.jsonl`
(`tests/test_bench_prompts.py` checks that no held-out prompt is one of these).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from dflash_jax.train.prompts import everyday_prompts, template_requests

Messages = list[dict[str, str]]

# Word problems: each template's fields are drawn from the ranges beside it (integers, inclusive).
MATH_TEMPLATES = (
    ("A {item} costs {price} dollars and is on sale for {pct}% off. How much does it cost now?",
     dict(price=(8, 400), pct=(5, 60))),
    ("A car travels {km} kilometres in {hours} hours. What is its average speed, and how far would it go in {more} hours?",
     dict(km=(60, 900), hours=(2, 9), more=(1, 12))),
    ("{name} is {age} years old, and her brother is {gap} years older. How old will her brother be in {later} years?",
     dict(age=(4, 60), gap=(1, 15), later=(2, 30))),
    ("How many {small} are there in {count} {large}? Show the conversion step by step.", dict(count=(2, 90))),
    ("Dinner for {people} people cost {bill} dollars. With a {tip}% tip, how much does each person pay?",
     dict(people=(2, 12), bill=(30, 600), tip=(10, 25))),
    ("A recipe for {serves} people needs {grams} grams of flour. How much flour is needed for {guests} people?",
     dict(serves=(2, 8), grams=(100, 900), guests=(3, 30))),
    ("{name} saves {save} dollars a week. How many weeks until she has {goal} dollars?",
     dict(save=(5, 120), goal=(200, 5000))),
    ("A rectangle is {w} cm wide and {h} cm long. What are its area and its perimeter?", dict(w=(2, 80), h=(3, 120))),
    ("A tank holds {litres} litres and fills at {rate} litres a minute. How long does it take to fill from empty?",
     dict(litres=(50, 2000), rate=(2, 40))),
    ("The price of a {item} went from {old} to {new} dollars. By what percentage did it change?",
     dict(old=(10, 300), new=(5, 400))),
    ("A train leaves at {hour}:{minute:02d} and the trip takes {mins} minutes. When does it arrive?",
     dict(hour=(1, 11), minute=(0, 59), mins=(25, 300))),
    ("{name} read {pages} pages in {days} days. At the same pace, how long will a {book}-page book take?",
     dict(pages=(40, 400), days=(2, 14), book=(150, 900))),
    ("What is {a}% of {b}, and what is {b} increased by {a}%?", dict(a=(3, 95), b=(20, 5000))),
    ("A shop sells pens in packs of {pack}. How many packs are needed for {pupils} pupils who need {each} pens each?",
     dict(pack=(3, 24), pupils=(10, 200), each=(1, 5))),
    ("Solve for x: {a}x + {b} = {c}. Explain each step.", dict(a=(2, 19), b=(1, 60), c=(61, 400))),
)
ITEMS = ("jacket", "lamp", "bicycle", "laptop", "pair of shoes", "sofa", "kettle", "backpack", "camera", "desk")
NAMES = ("Maria", "Aisha", "Lena", "Priya", "Sofia", "Hannah", "Mei", "Zara", "Nora", "Chloe")
CONVERSIONS = (("minutes", "days"), ("centimetres", "metres"), ("grams", "kilograms"), ("millilitres", "litres"),
               ("seconds", "hours"), ("inches", "feet"), ("ounces", "pounds"), ("metres", "kilometres"))

CODE_TEMPLATES = (
    "Write a {language} function that {task}.",
    "How do I write {language} code that {task}? Show a short example.",
    "Write a {language} function that {task}, with a comment explaining each step.",
    "Write a small {language} program that {task}, and explain how it works.",
)
LANGUAGES = ("Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "Ruby")
CODE_TASKS = (
    "reverses the words in a sentence", "counts the vowels in a string", "returns the largest number in a list",
    "removes duplicates from a list while keeping the order", "checks whether a number is prime",
    "converts Celsius to Fahrenheit", "returns the n-th Fibonacci number", "sorts a list of names alphabetically",
    "merges two sorted lists into one sorted list", "counts how often each word appears in a text",
    "checks whether two strings are anagrams", "returns the sum of the digits of a number",
    "flattens a nested list", "finds the second smallest number in a list", "capitalises the first letter of each word",
    "computes the factorial of a number", "checks whether a year is a leap year", "reads a file and counts its lines",
    "returns the common elements of two lists", "converts a number of seconds to hours, minutes and seconds",
    "validates that a string looks like an email address", "finds the longest word in a sentence",
    "rotates a list by k positions", "computes the average of a list of numbers, ignoring empty lists",
    "turns a list of pairs into a dictionary", "generates a random password of a given length",
    "checks whether brackets in a string are balanced", "returns the index of a value with binary search",
    "converts a string to title case", "splits a list into chunks of a given size",
)

# A second user turn after the target's answer, and requests to rework that answer as a passage.
FOLLOW_UPS = (
    "Can you make that shorter?", "Thanks! Can you give me an example?", "Now explain it as if I were ten.",
    "What else should I know about this?", "Can you turn that into a bulleted list?",
    "Which part of that is the most important?", "Could you say that in a more formal tone?",
    "Great. What would be a good next step?", "Can you add one more tip?", "Is there a common mistake to avoid here?",
)
REWRITES = (
    "Rewrite this in a more formal tone:\n\n{passage}", "Summarise this in two sentences:\n\n{passage}",
    "Condense this into three bullet points:\n\n{passage}", "Rewrite this so a child could understand it:\n\n{passage}",
    "Make this shorter without losing the main points:\n\n{passage}", "Give this text a title and a one-line summary:\n\n{passage}",
)


def math_prompts(count: int, seed: int) -> list[Messages]:
    """`count` distinct word problems (every template in turn, numbers drawn at random)."""
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    prompts: list[Messages] = []
    for attempt in range(20 * count):
        template, ranges = MATH_TEMPLATES[attempt % len(MATH_TEMPLATES)]
        small, large = CONVERSIONS[rng.integers(len(CONVERSIONS))]
        fields = {k: int(rng.integers(lo, hi + 1)) for k, (lo, hi) in ranges.items()}
        text = template.format(item=ITEMS[rng.integers(len(ITEMS))], name=NAMES[rng.integers(len(NAMES))],
                               small=small, large=large, **fields)
        if text not in seen:
            seen.add(text)
            prompts.append([{"role": "user", "content": text}])
            if len(prompts) == count:
                return prompts
    raise ValueError(f"asked for {count} math prompts; the templates gave {len(prompts)} distinct ones: ask for fewer.")


def code_requests() -> list[str]:
    """Every code template with every language and task (960 requests)."""
    return [t.format(language=lang, task=task) for t in CODE_TEMPLATES for lang in LANGUAGES for task in CODE_TASKS]


def code_prompts(count: int, seed: int) -> list[Messages]:
    """`count` distinct code requests (template x language x task), in a random order."""
    requests = code_requests()
    if count > len(requests):
        raise ValueError(f"asked for {count} code prompts; there are {len(requests)} distinct ones: ask for at most that many.")
    picks = np.random.default_rng(seed).choice(len(requests), size=count, replace=False)
    return [[{"role": "user", "content": requests[i]}] for i in picks]


def task_prompts(count: int, seed: int) -> list[Messages]:
    """`count` prompts, math word problems and code requests alternating; past the distinct
    code requests, word problems alone."""
    num_code = min(count // 2, len(code_requests()))
    math, code = math_prompts(count - num_code, seed), code_prompts(num_code, seed)
    return [m for pair in zip(math, code) for m in pair] + math[len(code):]


def first_turns(count: int, seed: int) -> list[Messages]:
    """First turns for follow-ups: half everyday requests (as many as there are distinct
    ones), the rest task prompts."""
    num_everyday = min((count + 1) // 2, len(template_requests()))
    return everyday_prompts(num_everyday, seed) + task_prompts(count - num_everyday, seed)


def follow_up_prompts(conversations: Sequence[tuple[Messages, str]], seed: int) -> list[Messages]:
    """For each (messages, the target's answer) with a non-empty answer: either the
    conversation continued by a follow-up user turn, or the answer alone as a passage to
    rewrite; the two alternate, each drawn at random from its list."""
    rng = np.random.default_rng(seed)
    prompts: list[Messages] = []
    for messages, answer in conversations:
        answer = answer.strip()
        if not answer:
            continue
        if len(prompts) % 2 == 0:
            prompts.append([*messages, {"role": "assistant", "content": answer},
                            {"role": "user", "content": FOLLOW_UPS[rng.integers(len(FOLLOW_UPS))]}])
        else:
            prompts.append([{"role": "user", "content": REWRITES[rng.integers(len(REWRITES))].format(passage=answer)}])
    return prompts


def follow_ups_from_target(
    target,
    encode: Callable[[Messages], list[int]],
    decode: Callable[[list[int]], str],
    turns: Sequence[Messages],
    *,
    seed: int = 0,
    max_new_tokens: int = 160,
    batch_size: int = 256,
    stop_token_ids: Sequence[int] | None = None,
) -> list[Messages]:
    """`follow_up_prompts` on the target's own greedy answers to `turns` (first turns: chat
    messages, encoded with the target's template by `encode`)."""
    from dflash_jax import generate_autoregressive  # looked up per call: tests stand a fake in

    answers: list[str] = []
    for start in range(0, len(turns), batch_size):
        batch = turns[start : start + batch_size]
        result = generate_autoregressive(target, [encode(m) for m in batch], max_new_tokens=max_new_tokens,
                                         stop_token_ids=stop_token_ids)
        answers += [decode(list(ids)) for ids in result.token_ids]
    return follow_up_prompts(list(zip(turns, answers)), seed)
