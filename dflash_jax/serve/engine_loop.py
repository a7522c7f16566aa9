"""The Engine on a thread of its own, fed and read by asyncio handlers through queues.

The Engine is not thread-safe and its steps block while the device works, so one thread owns
it: it takes commands (add, abort, stop) from a thread-safe queue, steps while any request is
open, and hands each request's new tokens to that request's asyncio queue on the event loop.
Every open request is in every step (continuous batching): a request arriving mid-generation
joins the next step.

Draining (SIGTERM) refuses new requests, ends those still queued at once, before any token,
and gives the running ones until a deadline to finish; what is left then is ended with a
finish reason.

Failures stay with their requests: a request the Engine refuses gets its ValueError back. If
`Engine.step()` raises, the public API does not say which requests that step held, so every
request open at that moment ends with an error (and is aborted); requests submitted after it
run normally, on the Engine as the failed step left it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time

from dflash_jax.engine import Engine, SamplingParams
from dflash_jax.requests import TokenLogprobs
from dflash_jax.serve.metrics import ServerMetrics
from dflash_jax.serve.protocol import RequestError

log = logging.getLogger("dflash_jax.serve")


@dataclasses.dataclass(frozen=True)
class Tokens:
    """A step's new tokens of one request, with their log-probabilities if it asked for them."""

    ids: list[int]
    logprobs: list[TokenLogprobs] | None = None


@dataclasses.dataclass(frozen=True)
class Finished:
    """The last event of a request: why it ended, and its statistics."""

    reason: str  # "stop", "length", "abort" (asked for, or the server shut down) or "error"
    num_generated: int = 0
    accepted_lengths: tuple[int, ...] = ()
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache


class RequestHandle:
    """The asyncio side of one request: `events` yields Tokens, then one Finished."""

    def __init__(self, event_loop: asyncio.AbstractEventLoop, num_prompt_tokens: int):
        self.events: asyncio.Queue = asyncio.Queue()
        self.num_prompt_tokens = num_prompt_tokens
        self._event_loop = event_loop
        self._admitted = event_loop.create_future()
        self.request_id: int | None = None  # the Engine's id; set on the engine thread

    def _send(self, event) -> None:
        """From the engine thread."""
        _call_soon(self._event_loop, self.events.put_nowait, event)

    def _resolve(self, error: Exception | None) -> None:
        def resolve():
            if not self._admitted.done():
                self._admitted.set_exception(error) if error else self._admitted.set_result(None)

        _call_soon(self._event_loop, resolve)


@dataclasses.dataclass
class _Open:
    handle: RequestHandle
    submitted_s: float
    last_output_s: float | None = None


class EngineLoop:
    """Owns `engine` on a thread; `submit` and `abort` are called from the event loop."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, *, max_open: int):
        self.engine = engine
        self.metrics = metrics
        self.max_open = max_open  # submitted and unfinished requests, beyond which submit answers 429
        self.idle = threading.Event()  # set while no request is open
        self.idle.set()
        self.step_failures = 0
        self.crashed: BaseException | None = None
        self._commands: queue.Queue = queue.Queue()
        self._open: dict[int, _Open] = {}  # by Engine request id; engine thread only
        self._lock = threading.Lock()
        self._num_open = 0
        self._draining = False
        self._thread: threading.Thread | None = None

    @property
    def num_open(self) -> int:
        with self._lock:
            return self._num_open

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
            self._thread.start()

    async def submit(self, prompt_ids: list[int], params: SamplingParams,
                     prefill_after: RequestHandle | None = None) -> RequestHandle:
        """Queue a request for the Engine; returns once the Engine has taken it. RequestError
        when the Engine refuses it (400), the queue is full (429) or the server is stopping (503).
        `prefill_after`: an earlier request of the same prompt (`Engine.add_request`'s)."""
        with self._lock:
            if self._draining or not self.running:
                raise RequestError("the server is shutting down; retry on another instance.", status=503,
                                   type="server_unavailable")
            if self._num_open >= self.max_open:
                raise RequestError(f"the server already holds {self.max_open} requests; retry shortly.", status=429,
                                   type="rate_limit_error", code="queue_full")
            self._num_open += 1
            self.idle.clear()
        handle = RequestHandle(asyncio.get_running_loop(), len(prompt_ids))
        self._commands.put(("add", handle, list(prompt_ids), params, time.perf_counter(), prefill_after))
        try:
            await asyncio.shield(handle._admitted)
        except asyncio.CancelledError:
            self.abort(handle)
            raise
        return handle

    def abort(self, handle: RequestHandle, reason: str = "abort") -> None:
        """End the request (a no-op once it has ended); its Finished event says `reason`."""
        self._commands.put(("abort", handle, reason))

    def drain(self, timeout_s: float) -> None:
        """Refuse new requests, end the queued ones now (an error, before any token), let the
        running ones finish for up to timeout_s, end the rest, then end the thread; returns at
        once (`wait` waits)."""
        with self._lock:
            self._draining = True
        self._commands.put(("stop", time.perf_counter() + timeout_s))

    def wait(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for the thread to end (after `drain`); whether it has."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return not self.running

    def stop(self, timeout_s: float) -> None:
        """`drain`, and wait for it: the thread ends within timeout_s plus one step."""
        self.drain(timeout_s)
        self.wait(timeout_s + 30)

    # ---- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as err:  # a bug in this loop: fail what is open, let /health say so
            log.exception("the engine loop stopped")
            self.crashed = err
            with self._lock:
                self._draining = True
            for request_id in list(self._open):
                self._end(request_id, "error", f"the engine loop stopped: {err}")

    def _serve(self) -> None:
        deadline = None
        while True:
            block = not self._open and deadline is None
            for command in self._take_commands(block):
                if command[0] == "add":
                    self._add(*command[1:])
                elif command[0] == "abort":
                    self._abort(*command[1:])
                else:  # a second stop may only bring the deadline closer
                    if deadline is None:
                        self._end_queued()
                    deadline = command[1] if deadline is None else min(deadline, command[1])
            if deadline is not None:
                if not self._open:
                    return
                if time.perf_counter() > deadline:
                    for request_id in list(self._open):
                        self._abort_id(request_id, "abort", "the server shut down before the request finished.")
                    return
            if self.engine.has_unfinished():
                self._step()
            self._update_gauges()

    def _take_commands(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, handle: RequestHandle, prompt_ids, params: SamplingParams, submitted_s: float,
             prefill_after: RequestHandle | None) -> None:
        first = prefill_after.request_id if prefill_after is not None else None
        try:  # a first request already ended and forgotten leaves nothing to wait for
            request_id = self.engine.add_request(prompt_ids, params, prefill_after=first if first in self._open else None)
        except ValueError as err:
            self._release()
            handle._resolve(RequestError(str(err)))
            return
        except Exception as err:
            log.exception("add_request failed")
            self._release()
            handle._resolve(RequestError(f"the engine could not take the request: {err}", status=500,
                                         type="internal_error"))
            return
        handle.request_id = request_id
        self._open[request_id] = _Open(handle, submitted_s)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        handle._resolve(None)

    def _end_queued(self) -> None:
        """End every request that waits for a slot and has had no token yet."""
        for request_id, request in list(self._open.items()):
            if request.last_output_s is None and self.engine.is_waiting(request_id):
                self._abort_id(request_id, "abort", "the server is shutting down; retry on another instance.")

    def _abort(self, handle: RequestHandle, reason: str) -> None:
        if handle.request_id in self._open:
            self._abort_id(handle.request_id, reason)

    def _abort_id(self, request_id: int, reason: str, error: str | None = None) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception("abort of request %d failed", request_id)
        self._end(request_id, reason, error)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as err:
            log.exception("Engine.step() failed; ending the %d open requests with an error", len(self._open))
            self.step_failures += 1
            for request_id in list(self._open):
                self._abort_id(request_id, "error", f"the engine failed while generating: {err}")
            return
        now = time.perf_counter()
        self.metrics.step_time.observe(now - start)
        self.metrics.count_drafts(self.engine.draft_counts)  # before the answers go out
        self.metrics.count_prefix_cache(self.engine.prefix_cache_stats)
        for out in outputs:
            request = self._open.get(out.request_id)
            if request is None:
                continue  # aborted while its step ran
            if out.new_token_ids:
                if request.last_output_s is None:
                    self.metrics.time_to_first_token.observe(now - request.submitted_s)
                else:
                    self.metrics.inter_token_latency.observe((now - request.last_output_s) / len(out.new_token_ids))
                request.last_output_s = now
                self.metrics.completion_tokens.inc(len(out.new_token_ids))
                request.handle._send(Tokens(list(out.new_token_ids), out.logprobs))
            if out.finished:
                self._end(out.request_id, out.finish_reason or "stop")

    def _end(self, request_id: int, reason: str, error: str | None = None) -> None:
        request = self._open.pop(request_id)
        try:
            stats = self.engine.stats(request_id)
            num_generated, accepted, preemptions = stats.num_generated, tuple(stats.accepted_lengths), stats.num_preemptions
            cached = stats.num_cached_tokens
            error = error or stats.error
            self.engine.release(request_id)  # its tokens went to the client: the engine forgets it
        except Exception:
            num_generated, accepted, preemptions, cached = 0, (), 0, 0
        self.metrics.finished.labels(reason=reason).inc()
        self.metrics.preemptions.inc(preemptions)
        for length in accepted:
            self.metrics.accepted_length.observe(length)
        request.handle._send(Finished(reason, num_generated, accepted, error, cached))
        self._release()

    def _release(self) -> None:
        with self._lock:
            self._num_open -= 1
            if self._num_open == 0:
                self.idle.set()

    def _update_gauges(self) -> None:
        self.metrics.kv_cache_usage.set(self.engine.kv_cache_usage)
        self.metrics.open_requests.set(len(self._open))
        self.metrics.queue_depth.set(sum(r.last_output_s is None for r in self._open.values()))


def _call_soon(event_loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    try:
        event_loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the event loop has closed: nobody is waiting any more
        pass
