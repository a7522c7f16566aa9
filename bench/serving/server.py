"""`dflash-jax serve` in a subprocess, for the serving benchmarks: ready when /health says
so, stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from bench.harness import ROOT


def tree_env() -> dict[str, str]:
    """This environment with this tree first on PYTHONPATH: a subprocess runs this tree's
    library whatever is installed."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


class Server:
    """`dflash-jax serve` in a subprocess on a free port, stopped with SIGTERM on exit;
    `accepting_s`: seconds until it answered /health, `startup_s`: until /health said ready
    (every step program compiled)."""

    def __init__(self, flags: list[str], startup_timeout: float, poll_s: float = 1.0):
        self.flags, self.startup_timeout, self.poll_s = flags, startup_timeout, poll_s
        self.accepting_s: float | None = None

    def __enter__(self):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        start = time.perf_counter()
        self.process = subprocess.Popen([sys.executable, "-m", "dflash_jax.cli", "serve", "--port", str(port),
                                         *self.flags], env=tree_env())
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited with code {self.process.returncode} before it was ready")
            if time.perf_counter() - start > self.startup_timeout:
                self.process.kill()
                raise SystemExit(f"the server was not ready after {self.startup_timeout:.0f} s")
            try:
                health = httpx.get(self.url + "/health", timeout=5)
            except httpx.TransportError:
                health = None  # not listening yet: it compiles what one request needs first
            if health is not None and health.status_code == 200:
                self.accepting_s = self.accepting_s or time.perf_counter() - start
                if health.json()["status"] == "ready":  # not "warming": every step program is compiled
                    break
            time.sleep(self.poll_s)
        self.startup_s = time.perf_counter() - start
        return self

    def __exit__(self, *exc):
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
