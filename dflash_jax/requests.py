"""Checks shared by `generate` and the `Engine`: one wording for every refused request.

Everything here runs on the host before a request reaches the device, so a bad request is
refused with a sentence and never occupies a slot or a page.
"""

from __future__ import annotations

import json
import numbers
from pathlib import Path

import numpy as np

from dflash_jax import sampling
from dflash_jax.config import DrafterConfig

INT32_MAX = 2**31 - 1


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool (True would pass as 1) and not a float like 3.0."""
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_count(name: str, value, minimum: int = 1) -> int:
    """`value` as an int, or ValueError unless it is an integer >= `minimum`; for token counts,
    block sizes, page sizes and page counts (the engine's page_size and num_pages)."""
    if not is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}.")
    return int(value)


def _check_int_array(name: str, value, hint: str) -> np.ndarray:
    """A scalar or per-request array of integers (no bools, no floats), or ValueError."""
    try:
        flat = list(np.ravel(value))
    except ValueError:  # ragged nesting
        flat = [None]
    if not flat or not all(is_int(x) for x in flat) or sampling._holds_bool(value):  # ravel turns True into 1
        raise ValueError(f"{name} must be an integer{hint}, got {value!r}.")
    return np.asarray(flat, np.int64)


def resolve_block_size(drafter: DrafterConfig, block_size: int | None) -> int:
    """The block size to draft with: the trained B by default, anything in [2, B]."""
    trained = drafter.block_size
    block_size = trained if block_size is None else block_size
    if not is_int(block_size):
        raise ValueError(f"block_size must be an integer in [2, {trained}], got {block_size!r}.")
    if not 2 <= block_size <= trained:
        raise ValueError(
            f"block_size must lie in [2, {trained}] (the drafter was trained with {trained}), got {block_size}."
        )
    return block_size


def resolve_draft_block_size(drafter: DrafterConfig, block_size: int, draft_block_size: int | None) -> int:
    """The drafter's own block: the trained B by default, anything in [block_size, B]."""
    trained = drafter.block_size
    draft_block_size = trained if draft_block_size is None else draft_block_size
    if not is_int(draft_block_size):
        raise ValueError(f"draft_block_size must be an integer in [{block_size}, {trained}], got {draft_block_size!r}.")
    if not block_size <= draft_block_size <= trained:
        raise ValueError(
            f"draft_block_size must lie in [{block_size}, {trained}] (at least the verified block_size, at most "
            f"the trained block), got {draft_block_size}."
        )
    return draft_block_size


def check_prompt(prompt, vocab_size: int, name: str = "prompt") -> np.ndarray:
    """The prompt as int32 token ids, or ValueError: empty, not flat, not integers (floats and
    bools are refused as such, not as out-of-vocabulary ids), or outside the vocabulary."""
    if isinstance(prompt, (str, bytes)):
        raise ValueError(f"{name} is text; give a list of integer token ids (tokenize it first).")
    try:
        ids = np.asarray(prompt)
    except ValueError:  # ragged nesting
        raise ValueError(f"{name} is not a flat list of token ids; give one list of integers per prompt.") from None
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"{name} is empty or not a flat list of token ids; give at least one token.")
    if hasattr(prompt, "dtype"):  # numpy or jax array: its dtype says it
        bad = None if ids.dtype.kind in "iu" else ids[0].item()
    else:
        bad = next((t for t in prompt if not is_int(t)), None)
    if bad is not None or ids.dtype.kind not in "iu":
        raise ValueError(f"{name} holds {bad!r}, not an integer; token ids must be integers.")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{name} holds token ids outside the vocabulary [0, {vocab_size}).")
    return ids.astype(np.int32)


def check_stop_token_ids(stop_token_ids, vocab_size: int) -> list[int]:
    """The stop tokens as a list of ints (None: none), or ValueError: a single int or a string
    instead of a sequence, a non-integer, or an id outside the vocabulary."""
    if stop_token_ids is None:
        return []
    if isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__"):
        raise ValueError(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}; write [id] for one.")
    ids = list(stop_token_ids)
    for t in ids:
        if not is_int(t):
            raise ValueError(f"stop_token_ids holds {t!r}, not an integer; token ids must be integers.")
        if not 0 <= t < vocab_size:
            raise ValueError(f"stop_token_ids holds {t}, outside the vocabulary [0, {vocab_size}).")
    return [int(t) for t in ids]


def check_request(prompt_len: int, max_new_tokens: int, max_model_len: int, *, temperature, top_k, top_p, seed):
    """Lengths, sampling parameters and seed of one request (or of a whole batch)."""
    sampling.validate_sampling_params(temperature, top_k, top_p)
    check_count("max_new_tokens", max_new_tokens)
    if prompt_len + max_new_tokens > max_model_len:
        raise ValueError(
            f"a prompt of {prompt_len} tokens plus max_new_tokens={max_new_tokens} exceeds the "
            f"model's max length {max_model_len}; shorten the prompt or lower max_new_tokens."
        )
    seeds = _check_int_array("seed", seed, " in [-2**31 + 1, 2**31 - 1]")
    if np.any(np.abs(seeds) > INT32_MAX):
        raise ValueError(f"seed must be an integer in [-2**31 + 1, 2**31 - 1], got {seed}.")
    if np.any(np.asarray(top_k) > INT32_MAX):
        raise ValueError(f"top_k must be below 2**31 (0 turns it off), got {top_k}.")


def check_checkpoint_folder(path: str | Path) -> None:
    """A converted (orbax) folder's dflash_jax.json is readable and names a kind, a format and a
    float dtype, or ValueError; a HF folder or .gguf file (no dflash_jax.json) passes. For
    `load_checkpoint` to call first: otherwise a damaged file fails deep inside the loader."""
    meta_path = Path(path) / "dflash_jax.json"
    if not meta_path.is_file():
        return
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{meta_path} is not valid JSON ({err}); convert the checkpoint again.") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path} is not a JSON object; convert the checkpoint again.")
    dtype = meta.get("dtype")
    try:
        ok = isinstance(dtype, str) and np.issubdtype(np.dtype(_ml_dtype(dtype)), np.floating)
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{meta_path} names dtype {dtype!r}, not a float type; convert the checkpoint again.")
    if meta.get("kind") not in ("target", "drafter"):
        raise ValueError(f"{meta_path} names kind {meta.get('kind')!r}, not target or drafter; convert the checkpoint again.")
    if not (Path(path) / "params").is_dir():
        raise ValueError(f"{path} has no params/ folder (an incomplete copy?); convert the checkpoint again.")


def _ml_dtype(name: str):
    """numpy knows no bfloat16 by name; ml_dtypes (a jax dependency) does."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return name
