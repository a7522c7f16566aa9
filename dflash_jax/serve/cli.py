"""`dflash-jax serve`: an OpenAI-compatible HTTP server over one Engine.

Start-up checks everything that can be wrong before the port is bound (flags, models,
tokenizer, Engine sizes: any of them stops it with one line and exit code 2), binds the port
without listening, compiles one step program that runs any one request (`--warmup minimal`;
`all` compiles every one first), and only then accepts connections: the first request never
waits for compilation. The other programs compile in the background (`warmup`). SIGTERM or Ctrl-C stops accepting, lets the requests in
flight finish for up to --shutdown-timeout seconds, aborts the rest and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
from dflash_jax.serve.warmup import WARMUP_CHOICES, Warmup, split_programs

log = logging.getLogger("dflash_jax.serve")


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
    parser.add_argument("--drafter", type=Path,
                        help="DFlash drafter folder (default: the shipped one for the demo target, none otherwise)")
    parser.add_argument("--no-drafter", action="store_true", help="decode autoregressively, without a drafter")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the model name clients send (default: the target's folder name)")
    parser.add_argument("--max-num-reqs", type=int, default=8, help="requests decoded together (a power of two)")
    parser.add_argument("--max-num-tokens", type=int, default=256, help="token budget of one step (a power of two)")
    parser.add_argument("--max-model-len", type=int, help="longest prompt + answer (default: the target's limit)")
    parser.add_argument("--block-size", type=int,
                        help="verified block (default: the drafter's; for the demo pair on a CPU 8 in bfloat16, "
                        "4 in float32, as `demo`)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"),
                        help="compute dtype (default: bfloat16 for the demo pair, else the target's stored dtype)")
    parser.add_argument("--compile-threads", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)),
                        help="threads compiling step programs in the background (default: a quarter of the "
                        "CPUs, 1 to 4)")
    add_draft_sampling_argument(parser)
    parser.add_argument("--max-queue", type=int, default=256,
                        help="requests held at once (running and waiting); beyond it the server answers 429")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds that requests in flight get to finish on SIGTERM")
    parser.add_argument("--warmup", choices=WARMUP_CHOICES, default="minimal",
                        help="step programs compiled before the port opens: minimal (one that runs any one request; "
                        "the rest compile in the background while /health says warming), all, or none (each "
                        "compiles when a step first needs it)")
    add_device_arguments(parser, multi_process=False)  # one process: the engine loop is not replicated
    add_cache_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
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
              warmup_programs=later, compile_threads=args.compile_threads)
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


def _check_flags(args) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must lie in [0, 65535], got {args.port}.")
    if args.no_drafter and args.drafter is not None:
        raise ValueError("--drafter and --no-drafter contradict each other; give one.")
    if args.block_size is not None and args.no_drafter:
        raise ValueError("--block-size sets the verified draft block; it needs a drafter, drop --no-drafter.")
    if args.drafter is None and args.target is not None and args.block_size is not None:
        raise ValueError("--block-size sets the verified draft block; it needs --drafter.")
    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be at least 1, got {args.max_queue}.")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}.")


def load_engine(args):
    """(Engine, tokenizer, ModelInfo) from the flags; ValueError for anything unusable."""
    import jax

    import dflash_jax
    from dflash_jax import demo
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
        if demo_pair and block_size is None and jax.default_backend() == "cpu":
            block_size = min(drafter.cfg.trained_block_size, 8 if dtype == "bfloat16" else 4)
    engine = dflash_jax.Engine(target, drafter, max_num_reqs=args.max_num_reqs, max_num_tokens=args.max_num_tokens,
                               block_size=block_size, max_model_len=args.max_model_len,
                               draft_sampling=args.draft_sampling)
    info = ModelInfo(
        name=args.served_model_name or (demo.TARGET_DIR_NAME if demo_pair else Path(target_path).stem),
        max_model_len=args.max_model_len or target.cfg.max_position_embeddings,
        block_size=(block_size or drafter.cfg.trained_block_size) if drafter is not None else 1,
    )
    return engine, tokenizer, info


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
          warmup_programs=(), compile_threads: int = 1):
    """Run the HTTP server on `sock` until SIGTERM / SIGINT, compiling `warmup_programs` meanwhile."""
    progress = functools.partial(tqdm, desc="compiling in the background", unit="program", leave=False)
    server = make_server(engine, tokenizer, info, max_queue=max_queue, shutdown_timeout_s=shutdown_timeout_s,
                         warmup_programs=warmup_programs, warmup_progress=progress, compile_threads=compile_threads)
    host, port = sock.getsockname()[:2]
    later = f"; {len(warmup_programs)} more step programs compile in the background" if warmup_programs else ""
    log.info("ready: http://%s:%d/v1 serves %s%s", host, port, info.name, later)
    server.run(sockets=[sock])


def make_server(engine, tokenizer, info: ModelInfo, *, max_queue: int, shutdown_timeout_s: float,
                log_level: str = "info", warmup_programs=(), warmup_progress=None, compile_threads: int = 1):
    """A uvicorn.Server over a new app and EngineLoop for `engine` (tests run one in a thread),
    compiling `warmup_programs` in the background once it runs.

    On SIGTERM uvicorn closes the listening socket and gives open connections
    shutdown_timeout_s to finish (the Engine keeps stepping for them); the app's shutdown then
    aborts whatever is left."""
    import uvicorn

    from dflash_jax.serve.app import create_app
    from dflash_jax.serve.engine_loop import EngineLoop
    from dflash_jax.serve.metrics import ServerMetrics

    loop = EngineLoop(engine, ServerMetrics(max(info.block_size, 2)), max_open=max_queue)
    warmup = Warmup(engine, warmup_programs, warmup_progress, compile_threads) if warmup_programs else None
    app = create_app(loop, tokenizer, model_name=info.name, max_model_len=info.max_model_len,
                     shutdown_timeout_s=min(shutdown_timeout_s, 5.0), warmup=warmup)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout_s,
                            access_log=False)
    return _uvicorn_server()(config, loop)


def _uvicorn_server():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server plus `ready`, an event set once it accepts connections, and its EngineLoop."""

        def __init__(self, config, engine_loop):
            super().__init__(config)
            self.engine_loop = engine_loop
            self.ready = threading.Event()

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                self.ready.set()

    return Server
