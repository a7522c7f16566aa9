"""The `dflash-jax` command line.

A failure the user can fix prints one line (what is wrong, what to do) and exits with status
2: bad values, unreadable or corrupt files, an output that cannot be written, an output that
exists. Ctrl-C exits with 130 and SIGTERM with 143, each after one line; both unwind through
`finally`, so conversions and exports remove their staging folders. Anything else is a bug:
one line saying so and exit 1, or the full traceback with `--debug` (or DFLASH_JAX_DEBUG=1).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import signal
import sys

from convert import cli as convert_cli
from convert.staging import Terminated, terminate_raises
from dflash_jax import cli_generate, demo
from dflash_jax.train import cli as train_cli

EXIT_USER_ERROR = 2
EXIT_BUG = 1
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-jax", description="DFlash speculative decoding in JAX.")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of any failure (also: DFLASH_JAX_DEBUG=1)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    convert_cli.add_parser(subparsers)
    train_cli.add_parser(subparsers)
    cli_generate.add_parser(subparsers)
    demo.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prefix = f"dflash-jax {args.command}"
    debug = args.debug or os.environ.get("DFLASH_JAX_DEBUG", "") not in ("", "0")
    try:
        with terminate_raises():
            args.run(args)
    except KeyboardInterrupt:
        print(f"\n{prefix}: interrupted; nothing half-written was left behind.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print(f"{prefix}: terminated; nothing half-written was left behind.", file=sys.stderr)
        return EXIT_TERMINATED
    except Exception as err:  # noqa: BLE001 - sorted below into user errors and bugs
        if debug:
            raise
        message = user_error_message(err)
        if message is None:
            print(f"{prefix}: internal error ({type(err).__name__}: {_first_line(str(err))[:300]}); this is a bug, "
                  "please report it with the output of the same command run with --debug.", file=sys.stderr)
            return EXIT_BUG
        print(f"{prefix}: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def user_error_message(err: BaseException) -> str | None:
    """One line for a failure the user can act on, or None for one that is a bug.

    A corrupt orbax checkpoint surfaces as whatever orbax or tensorstore raise (a plain
    Exception, a ValueError with the tensorstore spec, a JSON error from its metadata), so
    those are recognised by where they come from before the generic classes."""
    if isinstance(err, OSError) and err.errno in _WRITE_ERRNOS:
        return _os_error_message(err)
    if _from_checkpoint_reader(err):
        return (f"a checkpoint could not be read or written ({_checkpoint_detail(err)}); when reading, it is "
                "corrupt or incomplete: convert or write it again.")
    if isinstance(err, json.JSONDecodeError):
        return f"a JSON file is not valid JSON ({err}); fix or recreate it."
    if isinstance(err, OSError):
        return _os_error_message(err)
    if isinstance(err, (ValueError, ImportError)):  # ConfigError and ConversionError are ValueErrors
        return _first_line(str(err))
    return None


_WRITE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT)


def _os_error_message(err: OSError) -> str:
    if err.errno is None or err.strerror is None:  # raised by this project, with its own sentence
        return _first_line(str(err))
    where = err.filename if err.filename2 is None else f"{err.filename} -> {err.filename2}"
    advice = {
        errno.EACCES: "check its permissions or choose another location",
        errno.EPERM: "check its permissions or choose another location",
        errno.EROFS: "the file system is read-only; choose another location",
        errno.ENOSPC: "free some disk space or choose another location",
        errno.EDQUOT: "free some disk space or choose another location",
        errno.ENOENT: "check the path",
        errno.ENOTDIR: "a part of the path is a file, not a folder; check the path",
        errno.EISDIR: "it is a folder where a file is expected; check the path",
        errno.EEXIST: "remove it or choose another location",
    }.get(err.errno, "check the path and the file system")
    return f"{err.strerror}: {where}; {advice}."


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _from_checkpoint_reader(err: BaseException) -> bool:
    for link in _chain(err):
        module = type(link).__module__ or ""
        text = str(link)
        if module.startswith(("orbax", "tensorstore")) or "tensorstore" in text.lower() or "OCDBT" in text:
            return True
        tb = link.__traceback__
        while tb is not None:
            filename = tb.tb_frame.f_code.co_filename
            if f"{os.sep}orbax{os.sep}" in filename or f"{os.sep}tensorstore{os.sep}" in filename:
                return True
            tb = tb.tb_next
    return False


def _checkpoint_detail(err: BaseException) -> str:
    """The innermost message of the chain, without tensorstore's spec dump."""
    innermost = list(_chain(err))[-1]
    text = _first_line(str(innermost))
    text = re.split(r"\s*\[tensorstore_spec=|\s*See full TensorStore details", text)[0]
    return text if len(text) <= 300 else text[:297] + "..."


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else "no message"


if __name__ == "__main__":
    sys.exit(main())
