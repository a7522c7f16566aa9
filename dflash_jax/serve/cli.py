"""`dflash-jax serve`: an OpenAI-compatible HTTP server over one Engine.

Start-up checks everything that can be wrong before the port is bound (flags, models,
tokenizer, Engine sizes: any of them stops it with one line and exit code 2), binds the port
without listening, compiles one step program that runs any one request (`--warmup minimal`;
`all` compiles every one first), and only then accepts connections: the first request never
waits for compilation. The other programs compile in the background (`warmup`).

SIGTERM or Ctrl-C drains: the port stays open with /health answering "draining", new requests
get 503, queued ones end at once with an error (a 503, or an error event and `[DONE]` on a
stream), running ones get most of --shutdown-timeout to finish and are then ended with finish
reason "abort"; the process exits within the timeout. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import logging
import os
import socket
import threading
import time
from pathlib import Path

from tqdm import tqdm

from dflash_jax.cli_generate import add_draft_sampling_argument
from dflash_jax.cli_devices import add_device_arguments, start_devices
from dflash_jax.compile_cache import add_cache_arguments
from dflash_jax.demo import drafter_argument
from dflash_jax.serve.warmup import WARMUP_CHOICES, Warmup, split_programs

log = logging.getLogger("dflash_jax.serve")

# The HTTP side's packages: the `serve` extra, beyond the library's own dependencies.
SERVE_EXTRA_MODULES = ("fastapi", "uvicorn", "prometheus_client")

DEFAULT_MAX_REQUEST_BYTES = 4 << 20
# Of --shutdown-timeout, the share that requests in flight get to finish; the rest is for
# their last events, uvicorn's shutdown and the background compilation's thread.
DRAIN_SHARE = 0.8
# The environment variable --api-key falls back to, read by `dflash_jax.cli` (a key on the
# command line shows in `ps`).
API_KEY_VARIABLE = "DFLASH_JAX_API_KEY"


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the HTTP side needs to know of the served models."""

    name: str
    max_model_len: int
    block_size: int  # verified block (1 without a drafter): the accepted-length histogram's range


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (chat and completions, streaming, metrics)",
        description="Serve a target (with a DFlash drafter, or autoregressively) over HTTP with OpenAI's "
        "/v1/chat/completions and /v1/completions, plus /v1/models, /health and /metrics. Without --target it "
        "serves the demo pair: SmolLM2-135M-Instruct (fetched and converted once, as `demo` does) and the "
        "drafter shipped with the package.",
    )
    parser.add_argument("--target", type=Path, help="target model folder or .gguf file (default: the demo's SmolLM2)")
    parser.add_argument("--drafter", type=drafter_argument,
                        help="DFlash drafter folder, or a SmolLM2 drafter shipped with the package by name (dflash1, "
                        "dflash2) (default: dflash1 for the demo target, none otherwise)")
    parser.add_argument("--no-drafter", action="store_true", help="decode autoregressively, without a drafter")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0 or :: for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    parser.add_argument("--served-model-name", help="the model name clients send (default: the target's folder name)")
    parser.add_argument("--max-num-reqs", type=int, default=8, help="requests decoded together")
    parser.add_argument("--max-num-tokens", type=int, default=256, help="token budget of one step")
    parser.add_argument("--max-model-len", type=int, help="longest prompt + answer (default: the target's limit)")
    parser.add_argument("--num-pages", type=int,
                        help="KV cache pages (of 16 tokens) shared by all requests (default: enough for every request "
                        "at --max-model-len)")
    parser.add_argument("--kv-cache-memory-fraction", type=float,
                        help="size the KV cache to this share (0-1] of the device memory free once the models are "
                        "loaded (the host's available memory on a CPU), instead of --num-pages")
    parser.add_argument("--cycles-per-step", type=int,
                        help="verify cycles one engine step runs while every request decodes; more spread the "
                        "host's work per step, fewer admit new requests sooner (default: 4 on a GPU, 1 on a CPU)")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="start each request from the cached KV pages (the target's and the drafter's) of the "
                        "longest prefix an earlier request computed; --no-prefix-caching computes every prompt anew")
    parser.add_argument("--block-size", type=int,
                        help="verified block (default: the drafter's; on a mixture-of-experts target the block its "
                        "cycle cost favours at --max-num-reqs requests; for the demo pair on a CPU 8 in bfloat16, 4 in "
                        "float32, as `demo`)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"),
                        help="compute dtype (default: bfloat16 for the demo pair, else the target's stored dtype)")
    parser.add_argument("--compile-threads", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)),
                        help="threads compiling step programs in the background (default: a quarter of the "
                        "CPUs, 1 to 4)")
    add_draft_sampling_argument(parser)
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests held at once (running and waiting); beyond it the server answers 429")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds from SIGTERM to exit; requests in flight get most of them to finish")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="largest request body accepted; larger ones get 413")
    parser.add_argument("--api-key", help=f"require 'Authorization: Bearer <key>' on the /v1 routes (401 otherwise; "
                        f"/health and /metrics stay open); default: ${API_KEY_VARIABLE} if set, else no key")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    parser.add_argument("--warmup", choices=WARMUP_CHOICES, default="minimal",
                        help="step programs compiled before the port opens: minimal (one that runs any one request; "
                        "the rest compile in the background while /health says warming), all, or none (each "
                        "compiles when a step first needs it)")
    add_device_arguments(parser, multi_process=False)  # one process: the engine loop is not replicated
    add_cache_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    check_serve_extra()
    _check_flags(args)
    _log_to_stderr()
    engine, tokenizer, info = load_engine(args)
    sock = bind(args.host, args.port)
    kind = (f"DFlash, block size {info.block_size}, {args.draft_sampling} drafts" if info.block_size > 1
            else "autoregressive")
    log.info("loaded %s (%s, max length %d)", info.name, kind, info.max_model_len)
    first, later = split_programs(engine, args.warmup)
    try:
        if first:
            start = time.perf_counter()
            log.info("compiling %d of %d step programs before accepting requests", len(first), len(engine.programs))
            engine.precompile(functools.partial(tqdm, desc="compiling", unit="program", leave=False), first)
            log.info("compiled %d step programs in %.1f s", len(first), time.perf_counter() - start)
        serve(engine, tokenizer, info, sock, max_queue=args.max_queue, shutdown_timeout_s=args.shutdown_timeout,
              max_request_bytes=args.max_request_bytes, warmup_programs=later,
              compile_threads=args.compile_threads, api_key=args.api_key,
              access_log=args.access_log)
    finally:
        sock.close()


def _log_to_stderr() -> None:
    """The server's own log lines beside uvicorn's (the root logger may belong to absl)."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def check_serve_extra() -> None:
    """ImportError naming the `serve` extra when one of its packages is missing: found before
    the models load and compile, not when the server starts after them. Looked up, not imported."""
    missing = [name for name in SERVE_EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"the server needs {', '.join(missing)} (not installed); install the serve extra: "
                          "pip install 'dflash-jax[serve]' (in a checkout: pip install -e '.[serve]').")


def _check_flags(args) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must lie in [0, 65535], got {args.port}.")
    if args.no_drafter and args.drafter is not None:
        raise ValueError("--drafter and --no-drafter contradict each other; give one.")
    if args.block_size is not None and args.no_drafter:
        raise ValueError("--block-size sets the verified draft block; it needs a drafter, drop --no-drafter.")
    if args.drafter is None and args.target is not None and args.block_size is not None:
        raise ValueError("--block-size sets the verified draft block; it needs --drafter.")
    if args.num_pages is not None and args.kv_cache_memory_fraction is not None:
        raise ValueError("--num-pages and --kv-cache-memory-fraction both size the KV cache; give one.")
    if args.kv_cache_memory_fraction is not None and not 0 < args.kv_cache_memory_fraction <= 1:
        raise ValueError(f"--kv-cache-memory-fraction must lie in (0, 1], got {args.kv_cache_memory_fraction}.")
    if args.cycles_per_step is not None and args.cycles_per_step < 1:
        raise ValueError(f"--cycles-per-step must be at least 1, got {args.cycles_per_step}.")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError(f"--api-key is empty; give a key, or leave it out (and ${API_KEY_VARIABLE} unset) to serve "
                         "without one.")
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be at least 1, got {args.max_queue}.")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}.")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be at least 1, got {args.max_request_bytes}.")


@dataclasses.dataclass(frozen=True)
class ServedModels:
    """What the flags name: the target, the drafter (None: autoregressive), the tokenizer
    and what the HTTP side needs to know of them."""

    target: object
    drafter: object
    tokenizer: object
    info: ModelInfo


def load_models(args) -> ServedModels:
    """The models, tokenizer and ModelInfo the flags name; ValueError for anything unusable.
    Benchmarks load through this too, to compare the server with `generate` on what it serves."""
    import dflash_jax
    from dflash_jax import demo
    from dflash_jax.requests import resolve_block_size
    from dflash_jax.tokenizer import load_tokenizer

    demo_pair = args.target is None
    if demo_pair:
        target_path = demo.smollm2_target(args.cache_dir.expanduser())
        drafter_path = None if args.no_drafter else (args.drafter or demo.DEFAULT_DRAFTER)
        dtype = args.dtype or "bfloat16"
    else:
        target_path, drafter_path, dtype = args.target, args.drafter, args.dtype
    if not Path(target_path).exists():
        raise FileNotFoundError(f"{target_path} does not exist; pass --target a model folder or .gguf file.")
    tokenizer = load_tokenizer(target_path)
    if tokenizer is None:
        raise ValueError(f"{target_path} has no tokenizer.json (nor GGUF tokenizer metadata); the server needs one "
                         "to read text.")
    mesh = start_devices(args)
    target = _load(dflash_jax.load_target, target_path, dtype, "target", mesh)
    drafter = None
    block_size = args.block_size
    if drafter_path is not None:
        drafter = _load(dflash_jax.load_drafter, drafter_path, target.dtype, "drafter", mesh)
        if demo_pair and block_size is None:
            block_size = demo.default_block_size(drafter.cfg, dtype)
    info = ModelInfo(
        name=args.served_model_name or (demo.TARGET_DIR_NAME if demo_pair else Path(target_path).stem),
        max_model_len=args.max_model_len or target.cfg.max_position_embeddings,
        block_size=(resolve_block_size(drafter.cfg, block_size, target.cfg, batch=args.max_num_reqs,
                                       kernels=dflash_jax.Kernels().resolve(target.mesh))
                    if drafter is not None else 1),
    )
    return ServedModels(target, drafter, tokenizer, info)


def load_engine(args):
    """(Engine, tokenizer, ModelInfo) from the flags; ValueError for anything unusable."""
    import dflash_jax
    from dflash_jax.kv_cache import free_memory_bytes

    models = load_models(args)
    memory = None
    if args.kv_cache_memory_fraction is not None:
        memory = int(args.kv_cache_memory_fraction * free_memory_bytes(models.target.mesh))
    engine = dflash_jax.Engine(models.target, models.drafter, max_num_reqs=args.max_num_reqs,
                               num_pages=args.num_pages, kv_cache_memory_bytes=memory,
                               max_num_tokens=args.max_num_tokens,
                               block_size=models.info.block_size if models.drafter is not None else None,
                               max_model_len=args.max_model_len, draft_sampling=args.draft_sampling,
                               cycles_per_step=args.cycles_per_step, prefix_caching=args.prefix_caching)
    return engine, models.tokenizer, models.info


def _load(loader, path, dtype, what: str, mesh):
    try:
        return loader(path, dtype=dtype, mesh=mesh)
    except (ValueError, FileNotFoundError):
        raise
    except Exception as err:  # orbax, safetensors and json each fail in their own way
        raise ValueError(f"cannot load the {what} {path} ({type(err).__name__}: {err}); give a converted or HF "
                         "model folder.") from None


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound but not listening: the port is taken, connections wait for `serve`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot bind {host}:{port} ({err.strerror}); pick another --port or --host.") from None
    return sock


def serve(engine, tokenizer, info: ModelInfo, sock: socket.socket, *, max_queue: int, shutdown_timeout_s: float,
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, warmup_programs=(), compile_threads: int = 1,
          api_key: str | None = None, access_log: bool = False):
    """Run the HTTP server on `sock` until SIGTERM / SIGINT, compiling `warmup_programs` meanwhile."""
    progress = functools.partial(tqdm, desc="compiling in the background", unit="program", leave=False)
    server = make_server(engine, tokenizer, info, max_queue=max_queue, shutdown_timeout_s=shutdown_timeout_s,
                         max_request_bytes=max_request_bytes, warmup_programs=warmup_programs,
                         warmup_progress=progress, compile_threads=compile_threads, api_key=api_key,
                         access_log=access_log)
    host, port = sock.getsockname()[:2]
    later = f"; {len(warmup_programs)} more step programs compile in the background" if warmup_programs else ""
    log.info("ready: http://%s:%d/v1 serves %s%s", host, port, info.name, later)
    server.run(sockets=[sock])


def make_server(engine, tokenizer, info: ModelInfo, *, max_queue: int, shutdown_timeout_s: float,
                max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, log_level: str = "info", warmup_programs=(),
                warmup_progress=None, compile_threads: int = 1, api_key: str | None = None,
                access_log: bool = False):
    """A uvicorn.Server over a new app and EngineLoop for `engine` (tests run one in a thread),
    compiling `warmup_programs` in the background once it runs. Its `handle_exit` (what
    SIGTERM calls) drains the EngineLoop before uvicorn closes the port; setting `should_exit`
    skips the draining (uvicorn waits for open connections, the app's shutdown ends the rest)."""
    import uvicorn

    from dflash_jax.serve.app import create_app
    from dflash_jax.serve.engine_loop import EngineLoop
    from dflash_jax.serve.metrics import ServerMetrics

    loop = EngineLoop(engine, ServerMetrics(max(info.block_size, 2)), max_open=max_queue)
    warmup = Warmup(engine, warmup_programs, warmup_progress, compile_threads) if warmup_programs else None
    app = create_app(loop, tokenizer, model_name=info.name, max_model_len=info.max_model_len,
                     shutdown_timeout_s=min(shutdown_timeout_s * (1 - DRAIN_SHARE), 5.0), warmup=warmup,
                     max_request_bytes=max_request_bytes, api_key=api_key)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout_s,
                            access_log=access_log)
    return _uvicorn_server()(config, loop, shutdown_timeout_s * DRAIN_SHARE)


def _uvicorn_server():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server plus `ready`, an event set once it accepts connections, its
        EngineLoop, and draining on the first exit signal."""

        def __init__(self, config, engine_loop, drain_s: float):
            super().__init__(config)
            self.engine_loop = engine_loop
            self.drain_s = drain_s
            self.ready = threading.Event()
            self._draining = False

        def handle_exit(self, sig, frame) -> None:
            """The first signal drains the EngineLoop while the port stays open (/health says
            draining), then exits; a second one, or one with no loop running, exits now."""
            if self._draining or not self.engine_loop.running:
                return super().handle_exit(sig, frame)
            self._draining = True
            log.info("draining: no new requests; those running get %.0f s to finish", self.drain_s)
            self.engine_loop.drain(self.drain_s)
            threading.Thread(target=self._exit_when_drained, args=(sig, frame), name="dflash-drain",
                             daemon=True).start()

        def _exit_when_drained(self, sig, frame) -> None:
            self.engine_loop.wait(self.drain_s + 30)  # the loop ends by its deadline, after one last step
            uvicorn.Server.handle_exit(self, sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                self.ready.set()

    return Server
