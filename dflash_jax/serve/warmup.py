"""Compiling the Engine's step programs while the server already answers.

The server compiles one program that runs any one request before it opens its port
(`--warmup minimal`, the default) and the rest on this thread afterwards. Meanwhile the Engine
admits only as many requests as its compiled programs hold and runs each batch on the smallest
compiled program that holds it (`Engine.admit_within_compiled`): requests beyond that wait in
the queue, none fails. `/health` says "warming" until the last program is compiled.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

if TYPE_CHECKING:
    from dflash_jax.buckets import Program
    from dflash_jax.engine import Engine

log = logging.getLogger("dflash_jax.serve")

WARMUP_CHOICES = ("minimal", "all", "none")


def split_programs(engine: Engine, warmup: str) -> tuple[tuple[Program, ...], tuple[Program, ...]]:
    """(programs to compile before the port opens, programs to compile after) for `--warmup`:
    minimal: the first (`buckets.programs`: it runs any batch of one request); all: everything
    first; none: nothing (each compiles when a step first needs it)."""
    first = {"none": 0, "minimal": 1, "all": len(engine.programs)}[warmup]
    return engine.programs[:first], engine.programs[first:] if warmup == "minimal" else ()


class Warmup:
    """Compiles `programs` in warm-up order on `threads` threads of its own (XLA compiles
    without the GIL, so a machine with cores to spare compiles several at once); `stop` ends
    it after the programs compiling."""

    def __init__(self, engine: Engine, programs: Sequence[Program],
                 progress: Callable[[Iterable], Iterable] | None = None, threads: int = 1):
        self.engine = engine
        self.programs = tuple(programs)
        self.threads = max(1, threads)
        self._progress = progress or iter
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.programs and self._thread is None:
            self.engine.admit_within_compiled = True
            self._thread = threading.Thread(target=self._run, name="dflash-warmup", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        start = time.perf_counter()
        pending, taking = iter(self._progress(self.programs)), threading.Lock()
        failed = []

        def compile_pending() -> None:
            while not self._stop.is_set():
                with taking:
                    program = next(pending, None)
                if program is None:
                    return
                try:
                    self.engine.precompile(programs=[program])
                except Exception as err:
                    log.exception("compiling %s in the background failed; it compiles when a step needs it", program)
                    failed.append(err)

        workers = [threading.Thread(target=compile_pending, name=f"dflash-warmup-{i}", daemon=True)
                   for i in range(self.threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        self.engine.admit_within_compiled = False
        if not self._stop.is_set() and not failed:
            log.info("compiled the remaining %d step programs in %.1f s; all are ready", len(self.programs),
                     time.perf_counter() - start)
