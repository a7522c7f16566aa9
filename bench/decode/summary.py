"""One table of the decode-speed records (`bench.decode.speed`) in folders: per run (the
file's name), point and block size, the AR step, the DFlash cycle, the Engine's steps and,
where the run profiled, device events per loop iteration. The device plans print it last.

    python -m bench.decode.summary OUT [OUT ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def speed_results(path: Path) -> dict | None:
    """The results of the decode-speed record at `path`, or None for any other file. Records
    written before bench became one package hold them at the top level, and still count."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if data.get("benchmark") == "bench.decode.speed":
        return data["results"]
    return data if "benchmark" not in data and "points" in data else None


def table(folders: list[str]) -> list[str]:
    def ms(value):
        return f"{value * 1e3:9.3f}" if value else f"{'-':>9}"

    def events(value):
        return f"{value:9.1f}" if value is not None else f"{'-':>9}"

    lines = [f"{'run':<22} {'point':<8} {'block':>5} {'AR ms':>9} {'cycle ms':>9} {'Engine':>9} {'sync':>9} "
             f"{'Eng DF':>9} {'AR ev':>9} {'cycle ev':>9} {'DtoH/it':>9}"]
    for path in sorted(p for folder in folders for p in Path(folder).glob("*.json")):
        run = speed_results(path)
        if run is None:
            continue
        for point in run["points"]:
            d = point.get("derived") or {}
            profile = next((p for p in run.get("profile") or [] if p.get("attention_impl") == point["attention_impl"]),
                           {})

            def per_iteration(loop, key):
                return ((profile.get(loop) or {}).get("per_iteration") or {}).get(key)

            for block, b in (d.get("blocks") or {"-": {}}).items():
                lines.append(f"{path.stem:<22} {point['batch']}x{point['context']:<6} {block:>5} {ms(d.get('ar_s'))} "
                             f"{ms(b.get('cycle_s'))} {ms(d.get('engine_s'))} {ms(d.get('engine_sync_s'))} "
                             f"{ms(d.get('engine_dflash_s'))} {events(per_iteration('ar', 'device_events'))} "
                             f"{events(per_iteration('dflash', 'device_events'))} "
                             f"{events(per_iteration('dflash', 'memcpy_dtoh'))}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="folders of decode-speed JSON records")
    print("\n".join(table(parser.parse_args(argv).folders)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
