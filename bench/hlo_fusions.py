"""What XLA put in the small kernels a profile names: the fused computations of named fusions,
from an XLA dump of the optimized programs (`XLA_FLAGS="--xla_dump_to=DIR
--xla_dump_hlo_as_text"`). A profile gives kernels by name only (`loop_pad_fusion_107`,
`input_reduce_fusion_37`); the dump says which ops each one runs.

    python -m bench.hlo_fusions DIR NAME...             # the named fusions
    python -m bench.hlo_fusions DIR --profile RECORD    # those a --profile record's AR step
                                                        # runs more than once (a layer's kernels)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re


def largest_program(dump_dir: str) -> str:
    """The text of the largest optimized module in `dump_dir` (a decode loop's program)."""
    paths = glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
    if not paths:
        raise FileNotFoundError(f"no *after_optimizations.txt under {dump_dir}: dump with "
                                "XLA_FLAGS='--xla_dump_to=DIR --xla_dump_hlo_as_text'.")
    with open(max(paths, key=os.path.getsize)) as f:
        return f.read()


def fused_computations(hlo_text: str, names: list[str]) -> dict[str, str]:
    """For each fusion name, its instruction line and the computation it calls ("" where the
    program has no instruction of that name, e.g. a custom kernel's launch name)."""
    computations = {}
    for block in hlo_text.split("\n\n"):
        head = re.match(r"\s*(?:ENTRY\s+)?%?([\w.\-]+)\s", block)
        if head:
            computations[head.group(1)] = block.strip()
    found = {}
    for name in names:
        line = re.search(rf"^\s*(?:ROOT\s+)?%?{re.escape(name)} = .*$", hlo_text, re.MULTILINE)
        if line is None:
            found[name] = ""
            continue
        called = re.search(r"calls=%?([\w.\-]+)", line.group(0))
        body = computations.get(called.group(1), "") if called else ""
        found[name] = line.group(0).strip() + ("\n" + body if body else "")
    return found


def repeated_ops(record_path: str, loop: str = "ar") -> list[str]:
    """The op names a `bench.decode.speed --profile` record's loop runs more than once an
    iteration, busiest first."""
    with open(record_path) as f:
        profile = json.load(f)["results"]["profile"][0][loop]
    return [op for op, calls, _ in profile["ops_per_iteration"] if calls >= 2]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump_dir")
    parser.add_argument("names", nargs="*", help="fusion names, as the profile lists them")
    parser.add_argument("--profile", help="a bench.decode.speed --profile record: its AR step's repeated ops")
    args = parser.parse_args(argv)
    names = args.names + (repeated_ops(args.profile) if args.profile else [])
    for name, text in fused_computations(largest_program(args.dump_dir), names).items():
        print(f"== {name}\n{text or '(no such instruction: not an XLA fusion)'}\n")


if __name__ == "__main__":
    main()
