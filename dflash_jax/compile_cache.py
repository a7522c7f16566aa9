"""JAX's persistent compilation cache for the command line: a second run of the same command
loads its compiled programs from disk instead of compiling them again.

The Python API leaves the choice to the caller (`enable_compile_cache(folder)`, or JAX's own
`jax.config.update("jax_compilation_cache_dir", ...)`); the CLI turns it on for every
command that compiles, in `CACHE/xla`, unless `--no-compile-cache` is given.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax

DEFAULT_CACHE_DIR = Path("~/.cache/dflash-jax")

# Programs that compile faster than this are not worth a disk entry (and a read) each.
MIN_COMPILE_TIME_S = 0.2


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """`--cache-dir` (downloads, conversions and compiled programs) and `--no-compile-cache`."""
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"cache folder (default: $DFLASH_JAX_CACHE, else {DEFAULT_CACHE_DIR}); "
                        "compiled programs go to its xla/ subfolder")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="compile every program afresh instead of reusing those a previous run saved")


def enable_compile_cache(folder: str | Path) -> Path:
    """Save compiled programs to, and load them from, `folder` for the rest of this process;
    a process that already has a compilation cache keeps it (returns that one's folder)."""
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    return folder
