"""What a request is (`SamplingParams`) and the checks `generate` and the `Engine` share: one
wording for every refused request.

Everything here runs on the host before a request reaches the device, so a bad request is
refused with a sentence and never occupies a slot or a page.
"""

from __future__ import annotations

import dataclasses
import numbers
import time

import numpy as np

from dflash_jax import sampling
from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.verify_block import default_block_size

INT32_MAX = 2**31 - 1
MAX_LOGIT_BIAS = 64  # logit bias entries one request may have (the width of the step's bias rows)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded: temperature 0 is greedy; top_k 0 and top_p 1.0 are off;
    the seed keys every random draw (with the position), so tokens do not depend on the batch.
    `logit_bias`: (token id, bias) pairs added to the target's logits (before temperature
    and truncation, in verify blocks as in single steps); `min_tokens`: the stop tokens
    cannot end the answer before that many tokens. The penalties are vLLM's (presence and
    frequency over the generated tokens, in [-2, 2]; repetition, > 0, over the prompt and
    them; 0, 0 and 1 are off). `logprobs`: report each generated token's log-probability under the target (its raw
    logits' log-softmax) and those of the `logprobs` most likely tokens there (0: the token's
    own only; at most `sampling.MAX_TOP_LOGPROBS`); None reports none."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability and the most likely tokens' at its position,
    as (id, log-probability) pairs, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop", "length" or "error"
    logprobs: list[TokenLogprobs] | None = None  # one per new token, if the request asked for them


@dataclasses.dataclass
class RequestStats:
    """Per-request statistics: tokens committed per verify cycle, and timing."""

    accepted_lengths: list[int] = dataclasses.field(default_factory=list)
    num_generated: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission
    arrival_s: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    finish_s: float | None = None
    error: str | None = None  # why the request ended with finish reason "error"

    @property
    def tokens_per_s(self) -> float:
        end = self.finish_s or time.perf_counter()
        return self.num_generated / max(end - self.arrival_s, 1e-9)

    @property
    def mean_accepted_length(self) -> float:
        return float(np.mean(self.accepted_lengths)) if self.accepted_lengths else 0.0


@dataclasses.dataclass
class DraftCounts:
    """An Engine's speculative-decoding totals, counted as vLLM's `spec_decode_*` metrics are:
    verify cycles that checked drafts, the drafts they checked, the drafts accepted and
    committed, and those per block position (0: the first draft after the anchor)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def add(self, num_checked: int, num_accepted: int) -> None:
        if num_checked == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_checked
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool (True would pass as 1) and not a float like 3.0."""
    return is_int_type(type(value))


def is_int_type(kind: type) -> bool:
    return issubclass(kind, (numbers.Integral, np.integer)) and not issubclass(kind, (bool, np.bool_))


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


def resolve_block_size(drafter: DrafterConfig, block_size: int | None, target: TargetConfig | None = None,
                       batch: int = 1, kernels=None) -> int:
    """The block size to draft with: anything in [2, B] (B the trained block); by default B, or
    for a mixture-of-experts `target` whose experts' product reads only the routed experts
    (`kernels`, resolved: experts "pallas") the block its cycle cost favours at `batch`
    requests (`verify_block.default_block_size`)."""
    trained = drafter.trained_block_size
    if block_size is None:
        routed_only = target is not None and kernels is not None and kernels.experts == "pallas"
        return default_block_size(target, trained, batch) if routed_only else trained
    if not is_int(block_size):
        raise ValueError(f"block_size must be an integer in [2, {trained}], got {block_size!r}.")
    if not 2 <= block_size <= trained:
        raise ValueError(
            f"block_size must lie in [2, {trained}] (the drafter was trained with {trained}), got {block_size}."
        )
    return block_size


def resolve_draft_block_size(drafter: DrafterConfig, block_size: int, draft_block_size: int | None) -> int:
    """The drafter's own block: the trained B by default, anything in [block_size, B]."""
    trained = drafter.trained_block_size
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
    else:  # each distinct type checked once: a long prompt is thousands of ints
        bad_types = {kind for kind in set(map(type, prompt)) if not is_int_type(kind)}
        bad = next((t for t in prompt if type(t) in bad_types), None)
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


def check_logprobs(logprobs) -> int | None:
    """The top log-probabilities asked for (None: none), or ValueError."""
    if logprobs is None:
        return None
    if not is_int(logprobs) or not 0 <= logprobs <= sampling.MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs must be None or an integer in [0, {sampling.MAX_TOP_LOGPROBS}] (the most likely "
                         f"tokens reported with each token), got {logprobs!r}.")
    return int(logprobs)


def check_logit_bias(logit_bias, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """The logit bias as sorted (token id, float bias) pairs, from pairs or a {id: bias} mapping,
    or ValueError: an id outside the vocabulary, a bias that is not a finite number in
    [-100, 100] (OpenAI's range), or more than MAX_LOGIT_BIAS entries."""
    pairs = list(logit_bias.items()) if isinstance(logit_bias, dict) else list(logit_bias or ())
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}.")
    checked = {}
    for pair in pairs:
        token, bias = pair
        if not is_int(token) or not 0 <= token < vocab_size:
            raise ValueError(f"logit_bias names token {token!r}, not an id in the vocabulary [0, {vocab_size}).")
        if not isinstance(bias, numbers.Real) or isinstance(bias, bool) or not -100 <= bias <= 100:
            raise ValueError(f"logit_bias for token {token} must be a number in [-100, 100], got {bias!r}.")
        checked[int(token)] = float(bias)
    return tuple(sorted(checked.items()))


def check_penalties(presence, frequency, repetition) -> tuple[float, float, float]:
    """The penalties as floats, or ValueError: presence and frequency must be finite numbers in
    [-2, 2] (OpenAI's range), repetition a finite number > 0."""
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not -2 <= value <= 2:
            raise ValueError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}.")
    if (not isinstance(repetition, numbers.Real) or isinstance(repetition, bool) or not np.isfinite(repetition)
            or repetition <= 0):
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {repetition!r}.")
    return float(presence), float(frequency), float(repetition)


def stop_id_array(stop_token_ids, width: int | None = None) -> np.ndarray:
    """int32 [width]: the distinct stop ids, padded with -1 (no token); width defaults to
    their count (at least 1)."""
    ids = sorted({int(t) for t in stop_token_ids})
    width = max(1, len(ids)) if width is None else width
    if len(ids) > width:
        raise ValueError(f"a request may have at most {width} distinct stop token ids, got {len(ids)}.")
    return np.asarray(ids + [-1] * (width - len(ids)), np.int32)
