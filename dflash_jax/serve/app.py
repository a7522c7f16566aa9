"""The FastAPI app: OpenAI's completions and chat routes, models, health and metrics.

A handler reads the body (up to a size limit: 413 beyond), validates it and turns it into
prompt ids and SamplingParams on a worker thread (parsing and tokenizing a large body must not
stall the event loop, which serves every other client and /health), submits it to the
EngineLoop and turns the token ids it gets back into text. Streaming answers are SSE events in
OpenAI's chunk format ending with `data: [DONE]`, whatever ends them. A client that goes away
aborts its request: a stream is cancelled by Starlette when the client disconnects, and a plain
answer watches the connection while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from dflash_jax.engine import SamplingParams
from dflash_jax.requests import check_logit_bias, check_prompt, check_stop_token_ids
from dflash_jax.serve import protocol
from dflash_jax.serve.detokenize import IncrementalDetokenizer
from dflash_jax.serve.engine_loop import EngineLoop, Finished, RequestHandle
from dflash_jax.serve.protocol import ChatRequest, CompletionRequest, RequestError
from dflash_jax.serve.warmup import Warmup

log = logging.getLogger("dflash_jax.serve")

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


class _EngineFailed(Exception):
    """The Engine ended the request with an error (a failed step or the server stopping)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def create_app(loop: EngineLoop, tokenizer, *, model_name: str, max_model_len: int,
               max_request_bytes: int, shutdown_timeout_s: float = 30.0, warmup: Warmup | None = None,
               api_key: str | None = None) -> FastAPI:
    """An app serving `loop`'s Engine under `model_name`; its lifespan starts and stops the
    loop, and `warmup` (the step programs compiled in the background) if given. Request
    bodies larger than `max_request_bytes` are answered 413. With `api_key`, the /v1 routes
    answer 401 unless the request carries `Authorization: Bearer <api_key>`."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        if warmup is not None:
            warmup.start()
        log.info("serving %s", model_name)
        yield
        if warmup is not None:
            warmup.stop(shutdown_timeout_s)  # waits for the program compiling, if any
        loop.stop(shutdown_timeout_s)

    app = FastAPI(title="dflash-jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    if api_key is not None:
        app.add_middleware(_RequireApiKey, api_key=api_key)
    app.add_middleware(_CountResponses, metrics=loop.metrics)  # added last: outermost, counts the 401s too
    server = _Server(loop, tokenizer, model_name, max_model_len, max_request_bytes)

    @app.exception_handler(RequestError)
    async def request_error(request, err: RequestError):
        headers = {"Retry-After": "1"} if err.status == 429 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        message = {404: f"no route {request.url.path}; see GET /v1/models and POST /v1/chat/completions.",
                   405: f"{request.method} is not allowed on {request.url.path}."}.get(err.status_code, str(err.detail))
        return JSONResponse(protocol.error_body(message, type=kind), status_code=err.status_code,
                            headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, err: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(protocol.error_body(f"internal server error: {err}", type="internal_error"), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.generate(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.generate(request, ChatRequest)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": protocol.now(),
                                            "owned_by": "dflash-jax", "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        if loop.crashed is not None:
            return JSONResponse({"status": "error", "error": str(loop.crashed)}, status_code=503)
        if loop.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        engine = loop.engine
        status = "warming" if warmup is not None and warmup.running else "ready"
        return {"status": status, "model": model_name, "open_requests": loop.num_open,
                "step_failures": loop.step_failures, "programs_ready": engine.num_compiled(),
                "programs_total": len(engine.programs)}

    @app.get("/metrics")
    async def metrics():
        return Response(loop.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class _Server:
    """What the generation routes share: the loop, the tokenizer and the model's limits."""

    def __init__(self, loop: EngineLoop, tokenizer, model_name: str, max_model_len: int, max_request_bytes: int):
        self.loop, self.tokenizer, self.model_name, self.max_model_len = loop, tokenizer, model_name, max_model_len
        self.max_request_bytes = max_request_bytes

    async def generate(self, http: Request, kind: type[CompletionRequest | ChatRequest]) -> Response:
        body = await self._body(http)
        request, prompt_ids, params = await asyncio.to_thread(self._prepare, kind, body)
        chat = kind is ChatRequest
        handle = await self.loop.submit(prompt_ids, params)
        hidden = set(params.stop_token_ids)  # stop tokens end the answer and are not part of its text
        detokenizer = IncrementalDetokenizer(lambda ids: self.tokenizer.decode([t for t in ids if t not in hidden]),
                                             request.stop_strings)
        kind = "chat.completion" if chat else "text_completion"
        answer = _Answer(protocol.new_id("chatcmpl" if chat else "cmpl"), kind, self.model_name, request,
                         len(prompt_ids), lambda token_id: self.tokenizer.decode([token_id]))
        pieces = self._pieces(handle, detokenizer)
        if request.stream:
            # The background abort also covers a client gone before the stream's first chunk
            # (its generator never starts); after a normal end it is a no-op.
            return StreamingResponse(answer.stream(pieces, lambda: self.loop.abort(handle)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(self.loop.abort, handle))
        return await self._whole(http, handle, answer, pieces)

    async def _body(self, http: Request) -> bytes:
        """The request body, or RequestError 413 once it passes `max_request_bytes`."""
        too_large = RequestError(f"the request body exceeds this server's limit of {self.max_request_bytes} bytes; "
                                 "send a shorter prompt (or start the server with a larger --max-request-bytes).",
                                 status=413, code="request_too_large")
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            raise too_large
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > self.max_request_bytes:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _prepare(self, kind, body: bytes) -> tuple[CompletionRequest | ChatRequest, list[int], SamplingParams]:
        """(request, prompt ids, sampling parameters) from the body, or RequestError: the
        request's CPU work (JSON, chat template, tokenizer), run off the event loop."""
        request = protocol.parse_request(kind, body)
        if request.model is not None and request.model != self.model_name:
            raise RequestError(f"the model {request.model!r} does not exist here; this server serves "
                               f"{self.model_name!r} (GET /v1/models).", param="model", status=404,
                               code="model_not_found")
        prompt_ids = self._prompt_ids(request)
        return request, prompt_ids, self._sampling_params(request, len(prompt_ids))

    def _prompt_ids(self, request) -> list[int]:
        if isinstance(request, ChatRequest):
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
            try:
                ids = self.tokenizer.encode(messages, **request.chat_template_kwargs)
            except ValueError as err:
                raise RequestError(str(err), param="messages") from None
        else:
            prompt = request.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise RequestError("prompt holds several prompts; send one prompt per request.", param="prompt")
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = self.tokenizer.encode_text(prompt)
            else:
                try:
                    ids = check_prompt(prompt, self.loop.engine.vocab_size).tolist() if prompt else []
                except ValueError as err:
                    raise RequestError(str(err), param="prompt") from None
        if not ids:
            raise RequestError("the prompt is empty; give at least one token.", param="prompt")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; this model takes at most {self.max_model_len - 1} "
                "(its max length, one left to generate); shorten it.",
                param="messages" if isinstance(request, ChatRequest) else "prompt", code="context_length_exceeded")
        return ids

    def _sampling_params(self, request, num_prompt_tokens: int) -> SamplingParams:
        room = self.max_model_len - num_prompt_tokens
        if isinstance(request, ChatRequest):
            max_tokens = request.max_completion_tokens or request.max_tokens or room
        else:
            max_tokens = request.max_tokens or min(DEFAULT_COMPLETION_TOKENS, room)
        if max_tokens > room:
            raise RequestError(
                f"the prompt's {num_prompt_tokens} tokens plus max_tokens={max_tokens} exceed the model's max "
                f"length {self.max_model_len}; lower max_tokens to at most {room}.", param="max_tokens",
                code="context_length_exceeded")
        try:
            requested_stops = check_stop_token_ids(request.stop_token_ids, self.loop.engine.vocab_size)
        except ValueError as err:
            raise RequestError(str(err), param="stop_token_ids") from None
        ends = () if request.ignore_eos else self.tokenizer.stop_token_ids
        stop_ids = tuple(sorted(set(ends) | set(requested_stops)))
        if request.min_tokens > max_tokens:
            raise RequestError(f"min_tokens={request.min_tokens} exceeds max_tokens={max_tokens}; lower min_tokens.",
                               param="min_tokens")
        try:
            logit_bias = check_logit_bias({_token_id(key): bias for key, bias in (request.logit_bias or {}).items()},
                                          self.loop.engine.vocab_size)
        except ValueError as err:
            raise RequestError(str(err), param="logit_bias") from None
        return SamplingParams(max_new_tokens=max_tokens, temperature=request.temperature, top_k=max(request.top_k, 0),
                              top_p=request.top_p, seed=request.draw_seed(), stop_token_ids=stop_ids,
                              logprobs=request.num_logprobs, logit_bias=logit_bias, min_tokens=request.min_tokens,
                              presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
                              repetition_penalty=request.repetition_penalty)

    async def _pieces(self, handle: RequestHandle, detokenizer: IncrementalDetokenizer) -> AsyncIterator:
        """(new text, None, logprobs) as tokens come, then ("", Finished, []); a stop string
        ends the request early, and its Finished counts the tokens up to the one that completed
        the stop string. `logprobs`: (token id, `TokenLogprobs`) of the new tokens the text
        covers, if the request asked for them.
        A request ended without a token (queued when the server began to stop) raises
        _EngineFailed; one ended after some keeps them, its finish reason "abort"."""
        stopped_here = False
        while True:
            event = await handle.events.get()
            if isinstance(event, Finished):
                if event.reason == "error":
                    raise _EngineFailed(event.error, 500)
                if event.reason == "abort" and not stopped_here and not event.num_generated:
                    raise _EngineFailed(event.error or "the request was aborted.", 503)
                tail = "" if stopped_here else detokenizer.flush()
                yield tail, (Finished("stop", detokenizer.num_tokens, event.accepted_lengths,
                                      num_cached_tokens=event.num_cached_tokens) if stopped_here else event), []
                return
            if stopped_here:
                continue  # tokens of the steps before the abort took effect
            before = detokenizer.num_tokens
            delta = detokenizer.push(event.ids)
            if detokenizer.stopped:
                stopped_here = True
                self.loop.abort(handle, "stop")
            logprobs = list(zip(event.ids, event.logprobs or []))[: detokenizer.num_tokens - before]
            if delta or logprobs:
                yield delta, None, logprobs

    async def _whole(self, http: Request, handle: RequestHandle, answer: _Answer, pieces) -> Response:
        """The whole answer as one JSON body; the request is aborted if the client leaves first."""

        async def collect():
            text, finished, logprobs = [], None, []
            async for delta, finished, new_logprobs in pieces:
                text.append(delta)
                logprobs += new_logprobs
            return "".join(text), finished, logprobs

        collector = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collector.done():
                collector.cancel()
                self.loop.abort(handle)
                await asyncio.wait({collector})  # let the cancellation finish: no result to read
        if collector.cancelled():
            return Response(status_code=499)  # nobody reads it
        try:
            text, finished, logprobs = collector.result()
        except _EngineFailed as err:
            return JSONResponse(protocol.error_body(str(err), type="internal_error" if err.status == 500
                                                    else "server_unavailable"), status_code=err.status)
        return JSONResponse(answer.whole(text, finished, logprobs))


class _Answer:
    """Builds one request's response objects (whole, or as stream chunks)."""

    def __init__(self, answer_id: str, kind: str, model: str, request, num_prompt_tokens: int, token_text):
        self.id, self.kind, self.model, self.request = answer_id, kind, model, request
        self.chat = isinstance(request, ChatRequest)
        self.num_prompt_tokens = num_prompt_tokens
        self.created = protocol.now()
        self._token_text = token_text  # a token id's text, for log-probabilities
        self._text_offset = 0  # characters of a streamed completion's tokens already reported

    def _logprobs(self, logprobs) -> dict | None:
        """The choice's `logprobs` object for (token id, TokenLogprobs) pairs (None: not asked for)."""
        if self.request.num_logprobs is None:
            return None
        if self.chat:
            return protocol.chat_logprobs(logprobs, self._token_text)
        report = protocol.completion_logprobs(logprobs, self._token_text, self._text_offset)
        self._text_offset += sum(map(len, report["tokens"]))
        return report

    def _base(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _extras(self, finished: Finished) -> dict:
        extras = {"usage": protocol.usage(self.num_prompt_tokens, finished.num_generated, finished.num_cached_tokens)}
        if self.request.return_meta_info:
            extras["meta_info"] = protocol.meta_info(list(finished.accepted_lengths), self.num_prompt_tokens,
                                                     finished.num_generated)
        return extras

    def whole(self, text: str, finished: Finished, logprobs) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": self._logprobs(logprobs), "finish_reason": finished.reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(logprobs), "finish_reason": finished.reason}
        return {**self._base(self.kind), "choices": [choice], **self._extras(finished)}

    def _chunk(self, delta: str | None, finish_reason: str | None = None, *, role: bool = False,
               logprobs=None) -> dict:
        logprobs = None if logprobs is None else self._logprobs(logprobs)
        if self.chat:
            content = {} if delta is None else {"content": delta}
            if role:
                content = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": delta or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._base("text_completion"), "choices": [choice]}

    async def stream(self, pieces, abort) -> AsyncIterator[str]:
        """SSE events; `abort` ends the request if the stream stops early (the client left)."""
        ended = False
        try:
            if self.chat:
                yield _sse(self._chunk(None, role=True))
            async for delta, finished, logprobs in pieces:
                if finished is None:
                    yield _sse(self._chunk(delta, logprobs=logprobs))
                    continue
                ended = True
                if delta:
                    yield _sse(self._chunk(delta))
                last = self._chunk(None, finished.reason)
                extras = self._extras(finished)
                if self.request.return_meta_info:
                    last["meta_info"] = extras["meta_info"]
                yield _sse(last)
                if self.request.include_usage:
                    yield _sse({**self._base(last["object"]), "choices": [], "usage": extras["usage"]})
            yield "data: [DONE]\n\n"
        except _EngineFailed as err:
            ended = True
            kind = "internal_error" if err.status == 500 else "server_unavailable"
            yield _sse(protocol.error_body(str(err), type=kind))
            yield "data: [DONE]\n\n"
        finally:
            if not ended:
                abort()


def _token_id(key: str):
    """A logit_bias key as a token id (the key itself if it is not one, for the check to name)."""
    return int(key) if key.strip().lstrip("-").isdigit() else key


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _disconnected(http: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


class _RequireApiKey:
    """401 for a /v1 route without the server's Bearer token; /health and /metrics stay open
    (load balancers and scrapers carry no key). Compared in constant time."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                body = protocol.error_body("missing or wrong API key; send the header 'Authorization: Bearer <key>' "
                                           "with the key the server was started with.",
                                           type="invalid_request_error", code="invalid_api_key")
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _CountResponses:
    """ASGI middleware counting answered requests by route and status code (streams too); an
    exception that escapes the app before a response began counts as the 500 Starlette sends."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in (*GENERATION_ROUTES, "/v1/models", "/health", "/metrics") else "other"

        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.requests.labels(endpoint=endpoint, status=str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:
                self.metrics.requests.labels(endpoint=endpoint, status="500").inc()
            raise
