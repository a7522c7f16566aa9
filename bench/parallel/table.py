"""The table of bench/plans/tensor_parallel.sh: step times per tensor-parallel size and
speedups over TP 1, from the decode-speed records (`bench.decode.speed`) in one or more
folders (a plan split over several device calls: pass every call's folder).

    python -m bench.parallel.table OUT [OUT ...]
"""

from __future__ import annotations

import argparse
import pathlib

from bench.decode.points import label
from bench.decode.summary import speed_results

MEASURES = (("ar_s", "AR step"), ("cycle_s", "DFlash cycle"), ("engine_s", "Engine AR step"),
            ("engine_dflash_s", "Engine DFlash"))


def measures(point: dict) -> dict:
    derived = point.get("derived") or {}
    cycle = ((derived.get("blocks") or {}).get("16") or {}).get("cycle_s")
    return {key: cycle if key == "cycle_s" else derived.get(key) for key, _ in MEASURES}


def collect(folders: list[str]) -> tuple[dict, list[str]]:
    """{(model, point label, measure): {TP: seconds}} (the first value found wins), and notes."""
    table, notes = {}, []
    for path in sorted(p for folder in folders for p in pathlib.Path(folder).glob("*.json")):
        run = speed_results(path)
        if run is None:
            continue
        tp = run.get("tensor_parallel", 1)
        notes += [f"{path.name}: {text}" for text in run.get("skipped") or []]
        for point in run["points"]:
            name = label(point["batch"], point["context"])
            for key, value in measures(point).items():
                if value is not None:
                    table.setdefault((run["model"], name, key), {}).setdefault(tp, value)
            for section in ("generate", "engine"):
                if (point.get(section) or {}).get("error"):
                    notes.append(f"{path.name} {name} {section}: {point[section]['error'][:200]}")
    return table, notes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="folders of decode-speed JSON records")
    table, notes = collect(parser.parse_args(argv).folders)
    sizes = sorted({tp for row in table.values() for tp in row})
    print(f"\n{'shape':<14} {'point':<7} {'measure':<15}" + "".join(f" {f'TP {tp} ms (x TP 1)':>18}" for tp in sizes))
    order = {key: i for i, (key, _) in enumerate(MEASURES)}
    for (model, point, key), row in sorted(table.items(), key=lambda item: (item[0][0], item[0][1], order[item[0][2]])):
        one = row.get(1)
        cells = []
        for tp in sizes:
            value = row.get(tp)
            speedup = f" {one / value:5.2f}x" if value and one and tp > 1 else ""
            cells.append(f" {'-' if value is None else f'{1e3 * value:.2f}{speedup}':>18}")
        print(f"{model:<14} {point:<7} {dict(MEASURES)[key]:<15}" + "".join(cells))
    for note in notes:
        print(f"  {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
