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
import dataclasses
import hmac
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
from dflash_jax.serve.answer import Answer, EngineFailed
from dflash_jax.serve.detokenize import IncrementalDetokenizer
from dflash_jax.serve.engine_loop import EngineLoop, Finished, RequestHandle
from dflash_jax.serve.protocol import ChatRequest, CompletionRequest, RequestError
from dflash_jax.serve.warmup import Warmup

log = logging.getLogger("dflash_jax.serve")

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


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

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.generate(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.generate(request, ChatRequest)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": protocol.now(), "owned_by": "dflash-jax",
                "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        server.check_model(model_id)
        return model_card()

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
        handles = await self._submit_choices(request, prompt_ids, params)
        hidden = set(params.stop_token_ids)  # stop tokens end the answer and are not part of its text
        pieces = [self._pieces(handle, IncrementalDetokenizer(
            lambda ids: self.tokenizer.decode([t for t in ids if t not in hidden]), request.stop_strings,
            request.min_tokens))
            for handle in handles]
        kind = "chat.completion" if chat else "text_completion"
        answer = Answer(protocol.new_id("chatcmpl" if chat else "cmpl"), kind, self.model_name, request,
                         len(prompt_ids), lambda token_id: self.tokenizer.decode([token_id]))

        def abort():
            for handle in handles:
                self.loop.abort(handle)

        if request.stream:
            # The background abort also covers a client gone before the stream's first chunk
            # (its generator never starts); after a normal end it is a no-op.
            return StreamingResponse(answer.stream(pieces, abort), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"}, background=BackgroundTask(abort))
        return await self._whole(http, abort, answer, pieces)

    async def _submit_choices(self, request, prompt_ids: list[int], params: SamplingParams) -> list[RequestHandle]:
        """The request's `n` choices on the Engine: the first, then the others, which start from
        its prompt's cached pages; each with a seed of its own (the request's plus the choice's
        index, if it gave one)."""
        handles = [await self.loop.submit(prompt_ids, params)]
        try:
            for index in range(1, request.n):
                seed = params.seed + index if request.seed is not None else request.draw_seed()
                handles.append(await self.loop.submit(prompt_ids, dataclasses.replace(params, seed=seed),
                                                      prefill_after=handles[0]))
        except BaseException:
            for handle in handles:
                self.loop.abort(handle)
            raise
        return handles

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
        if request.model is not None:
            self.check_model(request.model)
        prompt_ids = self._prompt_ids(request)
        return request, prompt_ids, self._sampling_params(request, len(prompt_ids))

    def check_model(self, name: str) -> None:
        """RequestError 404 unless `name` is the model this server serves."""
        if name != self.model_name:
            raise RequestError(f"the model {name!r} does not exist here; this server serves {self.model_name!r} "
                               "(GET /v1/models).", param="model", status=404, code="model_not_found")

    def _prompt_ids(self, request) -> list[int]:
        if isinstance(request, ChatRequest):
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
            try:
                ids = self.tokenizer.encode(messages, request.chat_template_kwargs)
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
        EngineFailed; one ended after some keeps them, its finish reason "abort"."""
        stopped_here = False
        while True:
            event = await handle.events.get()
            if isinstance(event, Finished):
                if event.reason == "error":
                    raise EngineFailed(event.error, 500)
                if event.reason == "abort" and not stopped_here and not event.num_generated:
                    raise EngineFailed(event.error or "the request was aborted.", 503)
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

    async def _whole(self, http: Request, abort, answer: Answer, pieces: list) -> Response:
        """The whole answer as one JSON body; the request is aborted if the client leaves first."""

        async def collect(choice):
            text, finished, logprobs = [], None, []
            async for delta, finished, new_logprobs in choice:
                text.append(delta)
                logprobs += new_logprobs
            return "".join(text), finished, logprobs

        async def collect_all():
            try:
                return await asyncio.gather(*map(collect, pieces))
            except EngineFailed:
                abort()  # the other choices end too
                raise

        collector = asyncio.ensure_future(collect_all())
        watcher = asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collector.done():
                collector.cancel()
                abort()
                await asyncio.wait({collector})  # let the cancellation finish: no result to read
        if collector.cancelled():
            return Response(status_code=499)  # nobody reads it
        try:
            choices = collector.result()
        except EngineFailed as err:
            return JSONResponse(protocol.error_body(str(err), type="internal_error" if err.status == 500
                                                    else "server_unavailable"), status_code=err.status)
        return JSONResponse(answer.whole(choices))


def _token_id(key: str):
    """A logit_bias key as a token id (the key itself if it is not one, for the check to name)."""
    return int(key) if key.strip().lstrip("-").isdigit() else key


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
    """ASGI middleware counting answered requests by route and status code (streams too). An
    exception that escapes the app before a response began is answered here as a JSON 500, an
    ordinary response: Starlette's own handler for `Exception` replies and then re-raises, and
    the server drops the connection (a client's next request on it fails)."""

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
        except Exception as err:
            if started:  # a stream already under way: nothing left to answer with
                raise
            log.exception("unhandled error on %s", path)
            body = protocol.error_body(f"internal server error: {err}", type="internal_error")
            await JSONResponse(body, status_code=500)(scope, receive, counting_send)
