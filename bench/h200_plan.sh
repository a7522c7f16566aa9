#!/usr/bin/env bash
# One H200 call that checks the compiled kernels and measures the headline numbers of
# issue 6 (a session's baseline before it changes anything; bench/NOTES.md):
#
#   bash bench/h200_plan.sh COMMIT            # on the device; results under $OUT
#                                             # (carry .whl/dflash-0.1.0-py3-none-any.whl: the
#                                             # z-lab package some GPU tests compare against)
#   SMALL=1 OUT=/tmp/plan bash bench/h200_plan.sh test   # CPU smoke test of the same steps
#
# Each step has its own time limit and writes JSON and a log to $OUT as it goes, so a step
# that fails or runs out of time leaves the others' results. A table of the headline numbers
# is printed last. The limits add up to 560 s, inside the device tool's 600 s per command.
source "$(dirname "$0")/device_plan.sh"

# 1. The compiled kernels against their references (150 s ran 25 of the ~29 in session 8;
#    the other steps took 92, 80 and 83 s then).
echo "== gpu tests"
if [ -z "$small" ]; then
    wheel=.whl/dflash-0.1.0-py3-none-any.whl
    [ -f $wheel ] && python3 -m pip install -q --no-deps --target /tmp/zlab $wheel > /dev/null 2>&1
    PYTHONPATH=$PYTHONPATH:/tmp/zlab timeout 230 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/test_paged_attention_kernel.py tests/test_finish_heads_kernel.py tests/test_rms_norm_kernel.py \
        > "$out/gpu_tests.log" 2>&1
    echo "   rc=$? $(tail -1 "$out/gpu_tests.log")"
else
    echo "   skipped (no GPU)"
fi
# 2. Batch 1, 1k context: AR step, DFlash cycle and its parts, with a profile.
decode b1 120 "" --points "$(big 1x1k 1x128)" --sections generate,steps --profile
# 3. The Engine step, asynchronous scheduling and synchronous.
decode engine 105 "" --points "$(big 1x1k,8x1k 1x128)" --sections engine
# 4. Batch 32 at verify blocks 8 and 4 (the B32 target).
decode b32 105 "" --points "$(big 32x1k 2x128)" --block-sizes 8,4 --sections generate

python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"\n{'run':<12} {'point':<8} {'block':>5} {'AR ms':>7} {'cycle ms':>9} {'Engine ms':>10} {'sync ms':>8} {'Engine DFlash ms':>17}")
for name in ("b1", "engine", "b32"):
    path = out / f"{name}.json"
    if not path.exists():
        print(f"{name:<12} (no result)")
        continue
    for p in json.loads(path.read_text()).get("points", []):
        d = p.get("derived", {})
        ar = d.get("ar_s")
        engine, sync, eng_dflash = d.get("engine_s"), d.get("engine_sync_s"), d.get("engine_dflash_s")
        for block, b in (d.get("blocks") or {"-": {}}).items():
            cycle = b.get("cycle_s")
            print(f"{name:<12} {p['batch']}x{p['context']:<6} {block:>5} {ar * 1e3 if ar else float('nan'):7.2f} "
                  f"{cycle * 1e3 if cycle else float('nan'):9.2f} {engine * 1e3 if engine else float('nan'):10.2f} "
                  f"{sync * 1e3 if sync else float('nan'):8.2f} "
                  f"{eng_dflash * 1e3 if eng_dflash else float('nan'):17.2f}")
PY
