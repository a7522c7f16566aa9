"""One answer's response objects in OpenAI's shapes: whole, or as server-sent events, with its
choices (`n`) numbered and their streams merged as their tokens come."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from dflash_jax.serve import protocol
from dflash_jax.serve.engine_loop import Finished
from dflash_jax.serve.protocol import ChatRequest


class EngineFailed(Exception):
    """The Engine ended the request with an error (a failed step or the server stopping)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class Answer:
    """Builds one request's response objects (whole, or as stream chunks), its choices
    numbered by `index`."""

    def __init__(self, answer_id: str, kind: str, model: str, request, num_prompt_tokens: int, token_text):
        self.id, self.kind, self.model, self.request = answer_id, kind, model, request
        self.chat = isinstance(request, ChatRequest)
        self.num_prompt_tokens = num_prompt_tokens
        self.created = protocol.now()
        self._token_text = token_text  # a token id's text, for log-probabilities
        self._text_offsets = [0] * request.n  # characters of each streamed completion's tokens reported so far

    def _base(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, index: int, logprobs) -> dict | None:
        """A choice's `logprobs` object for (token id, TokenLogprobs) pairs (None: not asked for)."""
        if self.request.num_logprobs is None:
            return None
        if self.chat:
            return protocol.chat_logprobs(logprobs, self._token_text)
        report = protocol.completion_logprobs(logprobs, self._token_text, self._text_offsets[index])
        self._text_offsets[index] += sum(map(len, report["tokens"]))
        return report

    def _extras(self, finished: list[Finished]) -> dict:
        """Usage (the prompt once, every choice's tokens; the first choice's cached tokens, the
        others reuse its pages) and meta_info over all choices."""
        completion_tokens = sum(f.num_generated for f in finished)
        extras = {"usage": protocol.usage(self.num_prompt_tokens, completion_tokens, finished[0].num_cached_tokens)}
        if self.request.return_meta_info:
            extras["meta_info"] = protocol.meta_info([n for f in finished for n in f.accepted_lengths],
                                                     self.num_prompt_tokens, completion_tokens)
        return extras

    def whole(self, choices: list) -> dict:
        """The response of every choice's (text, Finished, logprobs)."""
        out = []
        for index, (text, finished, logprobs) in enumerate(choices):
            body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            out.append({"index": index, **body, "logprobs": self._logprobs(index, logprobs),
                        "finish_reason": finished.reason})
        return {**self._base(self.kind), "choices": out, **self._extras([f for _, f, _ in choices])}

    def _chunk(self, index: int, delta: str | None, finish_reason: str | None = None, *, role: bool = False,
               logprobs=None) -> dict:
        logprobs = None if logprobs is None else self._logprobs(index, logprobs)
        if self.chat:
            content = {} if delta is None else {"content": delta}
            if role:
                content = {"role": "assistant", "content": ""}
            choice = {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._base("text_completion"), "choices": [choice]}

    async def stream(self, pieces: list, abort) -> AsyncIterator[str]:
        """SSE events of every choice; `abort` ends the choices if the stream stops early (the
        client left, or one choice failed)."""
        finished: list[Finished] = []
        try:
            if self.chat:
                for index in range(len(pieces)):
                    yield sse(self._chunk(index, None, role=True))
            async for index, delta, done, logprobs in _merged(pieces):
                if done is None:
                    yield sse(self._chunk(index, delta, logprobs=logprobs))
                    continue
                if delta:
                    yield sse(self._chunk(index, delta))
                finished.append(done)
                last = self._chunk(index, None, done.reason)
                if len(finished) == len(pieces) and self.request.return_meta_info:
                    last["meta_info"] = self._extras(finished)["meta_info"]
                yield sse(last)
            if self.request.include_usage:
                yield sse({**self._base(last["object"]), "choices": [], "usage": self._extras(finished)["usage"]})
            yield "data: [DONE]\n\n"
        except EngineFailed as err:
            kind = "internal_error" if err.status == 500 else "server_unavailable"
            yield sse(protocol.error_body(str(err), type=kind))
            yield "data: [DONE]\n\n"
        finally:
            if len(finished) < len(pieces):
                abort()


async def _merged(pieces: list) -> AsyncIterator:
    """(choice index, *item) of every choice's pieces as they come; a choice's exception is
    raised here, the others' pieces are then left."""
    if len(pieces) == 1:
        async for item in pieces[0]:
            yield (0, *item)
        return
    queue: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def pump(index, choice):
        try:
            async for item in choice:
                await queue.put((index, *item))
        except Exception as err:
            await queue.put(err)
        finally:
            await queue.put(ended)

    tasks = [asyncio.ensure_future(pump(index, choice)) for index, choice in enumerate(pieces)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is ended:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
