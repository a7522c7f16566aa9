"""The `dflash-jax` command line. Errors print one line and exit with status 2."""

from __future__ import annotations

import argparse
import sys

from convert import cli as convert_cli
from dflash_jax import cli_generate, demo
from dflash_jax.serve import cli as serve_cli
from dflash_jax.train import cli as train_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-jax", description="DFlash speculative decoding in JAX.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    convert_cli.add_parser(subparsers)
    train_cli.add_parser(subparsers)
    cli_generate.add_parser(subparsers)
    demo.add_parser(subparsers)
    serve_cli.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"dflash-jax {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
