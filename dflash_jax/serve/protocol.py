"""OpenAI request bodies (pydantic) and the response objects built from a finished request.

Requests are validated strictly, from the JSON text itself: a field of the wrong JSON type is
refused, never coerced (`"stream": "yes"`, `"max_tokens": "4"` or `true`), numbers must be
finite, and text that is not valid JSON (a lone UTF-16 surrogate, nesting past the parser's
depth limit) is a 400 like any other malformed body. A field this server does not know, or knows but cannot
honour (tools, response_format, ...), is refused by name rather than ignored, since
ignoring it would silently change what the client gets. `logprobs` (and chat's `top_logprobs`)
report the target's raw log-probabilities of the returned tokens. Fields that cannot change the tokens
(`user`, `metadata`, ...) are accepted and ignored; so are unsupported ones left at their
neutral value (`presence_penalty: 0`, `tools: null`), which some clients send by default.
"""

from __future__ import annotations

import secrets
import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from dflash_jax.sampling import MAX_TOP_LOGPROBS

INT32_MAX = 2**31 - 1
MAX_CHOICES = 16  # `n` at most: each choice is a request of its own on the Engine

# Fields with no effect on the output.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "stream_options"})
# Unsupported fields, each with the values that mean "off" (accepted as if absent).
UNSUPPORTED_FIELDS = {
    "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "min_p": (None, 0, 0.0),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,),
}


class RequestError(ValueError):
    """A request this server refuses: the HTTP status, the message and the offending field."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Sampling(BaseModel):
    """Fields common to both endpoints."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX)  # -1 or 0: off
    seed: int | None = Field(default=None, ge=-INT32_MAX, le=INT32_MAX)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False  # vLLM's: the tokenizer's end tokens do not stop the answer (stop_token_ids still do)
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON's keys) -> bias in [-100, 100]
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)  # vLLM's: no stop token before this many tokens
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)  # vLLM's
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # choices, sharing the prompt's cached pages
    return_meta_info: bool = False

    @field_validator("n")
    @classmethod
    def _choice_seeds_fit(cls, n: int, info: ValidationInfo) -> int:
        """Choice i samples with seed + i: each must be a seed a lone request may give."""
        seed = info.data.get("seed")
        if seed is not None and seed + n - 1 > INT32_MAX:
            raise ValueError(f"seed + n - 1 must be at most {INT32_MAX} (choice i samples with seed + i)")
        return n

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def draw_seed(self) -> int:
        """The request's seed; a fresh one when none is given, so unseeded requests differ."""
        return self.seed if self.seed is not None else secrets.randbelow(INT32_MAX)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # the top alternatives per token

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """Images and other media are refused by name, not as a malformed part."""
        kinds = {part.get("type") for part in content if isinstance(part, dict)} if isinstance(content, list) else set()
        media = sorted(str(kind) for kind in kinds - {"text", None})
        if media:
            raise ValueError(f"content parts of type {', '.join(media)} are not read: this server decodes text only (a "
                             "vision-language checkpoint runs as its text model); send text parts")
        return content

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top_logprobs

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# What each union-typed field takes, for its type errors (pydantic names the union's members).
UNION_FIELDS = {"prompt": "a string, a list of strings or a list of token ids",
                "stop": "a string or a list of strings", "content": "a string or a list of text parts"}


def parse_request(kind: type[_Sampling], body: bytes) -> _Sampling:
    """The validated request from the body's JSON text, or RequestError naming the first bad
    or unsupported field."""
    try:
        request = kind.model_validate_json(body, strict=True)
    except ValidationError as err:
        raise _request_error(err.errors()[0]) from None
    for name, value in (request.model_extra or {}).items():
        if name in IGNORED_FIELDS:
            continue
        if name in UNSUPPORTED_FIELDS:
            if value not in UNSUPPORTED_FIELDS[name]:
                raise RequestError(f"{name} is not supported by this server; remove it from the request.", param=name)
            continue
        raise RequestError(f"{name} is not a field this server knows; remove it from the request.", param=name)
    return request


def _union_member(part) -> bool:
    """Whether a part of pydantic's error path names a union's member type (`str`, `list[int]`), not a field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "none"))


def _request_error(first: dict) -> RequestError:
    """The RequestError of pydantic's first validation error, named by the request's own field path."""
    if first["type"] == "json_invalid":
        detail = first["ctx"]["error"] if "ctx" in first else first["msg"]
        return RequestError(f"the request body is not valid JSON ({detail}).")
    if not first["loc"]:
        return RequestError("the request body must be a JSON object.")
    path = [part for part in first["loc"] if not _union_member(part)]
    param = ".".join(map(str, path))
    field = next((part for part in reversed(path) if isinstance(part, str)), "")
    if len(path) < len(first["loc"]) and field in UNION_FIELDS:
        return RequestError(f"{param} must be {UNION_FIELDS[field]}.", param=param)
    message = first["msg"].removeprefix("Value error, ")
    return RequestError(f"{param}: {message}.", param=param)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens found in the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprobs(tokens, text_of) -> dict:
    """Chat's `logprobs` object for (token id, `TokenLogprobs`) pairs; `text_of(id)` is a token's text."""
    def entry(token_id, logprob):
        text = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                        for token_id, t in tokens]}


def completion_logprobs(tokens, text_of, offset: int = 0) -> dict:
    """The completions endpoint's `logprobs` object for (token id, `TokenLogprobs`) pairs,
    text offsets counted from `offset` characters into the answer."""
    texts = [text_of(token_id) for token_id, _ in tokens]
    offsets = [offset + sum(map(len, texts[:k])) for k in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [t.logprob for _, t in tokens],
            "top_logprobs": [{text_of(i): lp for i, lp in t.top} for _, t in tokens], "text_offset": offsets}


def meta_info(accepted_lengths: list[int], prompt_tokens: int, completion_tokens: int) -> dict:
    """SGLang's `meta_info` for speculative decoding: verify cycles and mean tokens per cycle."""
    cycles = len(accepted_lengths)
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "spec_verify_ct": cycles,
        "spec_accept_length": sum(accepted_lengths) / cycles if cycles else 0.0,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
