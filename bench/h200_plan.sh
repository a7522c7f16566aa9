#!/usr/bin/env bash
# The next H200 call of bench/NOTES.md ("Session 7 predictions"), in one command:
#
#   bash bench/h200_plan.sh COMMIT            # on the device; results under $OUT
#   SMALL=1 OUT=/tmp/plan bash bench/h200_plan.sh test   # CPU smoke test of the same steps
#
# Each step has its own time limit and writes JSON and a log to $OUT as it goes, so a step
# that fails or runs out of time leaves the others' results. A table of the headline numbers
# is printed last. The limits add up to 435 s, inside the device tool's 600 s per command, leaving room
# in a session's 30 device minutes for a training chain.
set -uo pipefail
commit=${1:?usage: bench/h200_plan.sh COMMIT}
out=${OUT:?set OUT to the results folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
small=${SMALL:+--small}
big() { [ -z "$small" ] && echo "$1" || echo "$2"; }

decode() {  # name, time limit (s), extra environment, then bench_decode arguments
    local name=$1 limit=$2 env=$3
    shift 3
    echo "== $name"
    env $env timeout "$limit" python3 bench/bench_decode.py $small --commit "$commit" --out "$out/$name.json" \
        --attention-impl pallas "$@" > "$out/$name.log" 2>&1
    echo "   rc=$? $(grep -c '^\[' "$out/$name.log") timeline lines"
}

# 1. The compiled kernels against their references (the combine kernel's first GPU run).
echo "== gpu tests"
if [ -z "$small" ]; then
    timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_paged_attention_kernel.py \
        tests/test_finish_heads_kernel.py tests/test_rms_norm_kernel.py > "$out/gpu_tests.log" 2>&1
    echo "   rc=$? $(tail -1 "$out/gpu_tests.log")"
else
    echo "   skipped (no GPU)"
fi
# 2. The key-split combine as one kernel against XLA's four (A/B), with a profile.
decode combine 140 "DFLASH_COMBINE_IMPL=pallas" --points "$(big 1x1k 1x128)" --sections generate,steps --profile
decode xla_combine 75 "DFLASH_COMBINE_IMPL=reference" --points "$(big 1x1k 1x128)" --sections generate
# 3. Batch 32 at verify blocks 4 and 8 (the B32 target; not run since the fused heads).
decode b32 110 "DFLASH_COMBINE_IMPL=pallas" --points "$(big 32x1k 2x128)" --block-sizes 8,4 --sections generate

python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"\n{'run':<12} {'point':<8} {'block':>5} {'AR ms':>7} {'cycle ms':>9} {'Engine ms':>10}")
for name in ("combine", "xla_combine", "b32"):
    path = out / f"{name}.json"
    if not path.exists():
        print(f"{name:<12} (no result)")
        continue
    for p in json.loads(path.read_text()).get("points", []):
        d = p.get("derived", {})
        ar = d.get("ar_s")
        engine = d.get("engine_s")
        for block, b in (d.get("blocks") or {"-": {}}).items():
            cycle = b.get("cycle_s")
            print(f"{name:<12} {p['batch']}x{p['context']:<6} {block:>5} {ar * 1e3 if ar else float('nan'):7.2f} "
                  f"{cycle * 1e3 if cycle else float('nan'):9.2f} {engine * 1e3 if engine else float('nan'):10.2f}")
PY
