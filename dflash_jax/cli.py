"""The `dflash-jax` command line.

A failure the user can fix prints one line (what is wrong, what to do) and exits with status
2: bad values, unreadable or corrupt files, an output that cannot be written, an output that
exists. Ctrl-C exits with 130 and SIGTERM with 143, each after one line; both unwind through
`finally`, so conversions and exports remove their staging folders (and the commands that
write files, `writes_files` among their parser's defaults, say so). Anything else is a bug:
one line saying so and exit 1, or the full traceback with `--debug` (or DFLASH_JAX_DEBUG=1).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
from pathlib import Path

from dflash_jax import cli_convert, cli_generate, demo
from dflash_jax.cli_errors import from_checkpoint_reader, first_line, silence_stderr, user_error_message
from dflash_jax.compile_cache import DEFAULT_CACHE_DIR, enable_compile_cache
from dflash_jax.serve import cli as serve_cli
from dflash_jax.staging import Terminated, terminate_raises
from dflash_jax.train import cli as train_cli

EXIT_USER_ERROR = 2
EXIT_BUG = 1
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` ends each flag's line with its default, unless its help names the default in
    words already or there is no value to show (None: computed at run time; a switch's False)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-jax", description="DFlash speculative decoding in JAX.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of any failure (also: DFLASH_JAX_DEBUG=1)")
    subparsers = parser.add_subparsers(
        dest="command", required=True,
        parser_class=functools.partial(argparse.ArgumentParser, formatter_class=HelpFormatter))
    cli_convert.add_parser(subparsers)
    train_cli.add_parser(subparsers)
    cli_generate.add_parser(subparsers)
    demo.add_parser(subparsers)
    serve_cli.add_parser(subparsers)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command's flags with the environment's defaults filled in (read here, once), and
    the compilation cache turned on for the commands that compile."""
    args = build_parser().parse_args(argv)
    if hasattr(args, "cache_dir"):
        args.cache_dir = (args.cache_dir or Path(os.environ.get("DFLASH_JAX_CACHE") or DEFAULT_CACHE_DIR)).expanduser()
        if not args.no_compile_cache:
            enable_compile_cache(args.cache_dir / "xla")
    if hasattr(args, "api_key") and args.api_key is None:
        args.api_key = os.environ.get(serve_cli.API_KEY_VARIABLE) or None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prefix = f"dflash-jax {args.command}"
    debug = args.debug or os.environ.get("DFLASH_JAX_DEBUG", "") not in ("", "0")
    # Only a command that writes files has something it could have left half-written; a server
    # stopped by Ctrl-C or SIGTERM has not.
    cleaned = "; nothing half-written was left behind" if getattr(args, "writes_files", False) else ""
    try:
        with terminate_raises():
            args.run(args)
    except KeyboardInterrupt:
        print(f"\n{prefix}: interrupted{cleaned}.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print(f"{prefix}: terminated{cleaned}.", file=sys.stderr)
        return EXIT_TERMINATED
    except Exception as err:  # noqa: BLE001 - sorted below into user errors and bugs
        if debug:
            raise
        message = user_error_message(err)
        if message is None:
            print(f"{prefix}: internal error ({type(err).__name__}: {first_line(str(err))[:300]}); this is a bug, "
                  "please report it with the output of the same command run with --debug.", file=sys.stderr)
            return EXIT_BUG
        print(f"{prefix}: error: {message}", file=sys.stderr)
        if argv is None and from_checkpoint_reader(err):
            silence_stderr()
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
