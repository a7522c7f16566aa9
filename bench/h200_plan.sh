#!/usr/bin/env bash
# The next H200 call of bench/NOTES.md ("Next device session"), in one command:
#
#   bash bench/h200_plan.sh COMMIT            # on the device; results under $OUT
#   SMALL=1 OUT=/tmp/plan bash bench/h200_plan.sh test   # CPU smoke test of the same steps
#
# Each step has its own time limit and writes JSON and a log to $OUT as it goes, so a step
# that fails or runs out of time leaves the others' results. A table of the headline numbers
# is printed last. The limits add up to 560 s, inside the device tool's 600 s per command.
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
    env $env timeout "$limit" python3 bench/bench_decode.py $small --commit "$commit" --out "$out/$name.json" "$@" \
        > "$out/$name.log" 2>&1
    echo "   rc=$? $(grep -c '^\[' "$out/$name.log") timeline lines"
}

# 1. Key splits in the decode loop, with profiles (calls and time per op per step).
decode splits 160 "" --points "$(big 1x1k,1x8k 1x128)" --sections generate --attention-impl pallas --profile
# 2. XLA flag variants for the matrix products, 1x1k generate only.
decode cublas 80 "XLA_FLAGS=--xla_gpu_enable_triton_gemm=false" --points "$(big 1x1k 1x128)" --sections generate
decode autotune4 80 "XLA_FLAGS=--xla_gpu_autotune_level=4" --points "$(big 1x1k 1x128)" --sections generate
# 3. The Engine with the flat-parameter step program.
decode engine 60 "" --points "$(big 1x1k 1x128)" --sections engine
# 4. Smaller verify blocks at batch 32.
decode b32 120 "" --points "$(big 32x1k 2x128)" --block-sizes 8,4 --sections generate
# 5. Threshold sampling against the full sort.
echo "== sampling"
timeout 60 python3 bench/bench_sampling.py $small --out "$out/sampling.json" > "$out/sampling.log" 2>&1
echo "   rc=$?"

python3 - "$out" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"\n{'run':<10} {'point':<8} {'block':>5} {'AR ms':>7} {'cycle ms':>9} {'Engine ms':>10}")
for name in ("splits", "cublas", "autotune4", "engine", "b32"):
    path = out / f"{name}.json"
    if not path.exists():
        print(f"{name:<10} (no result)")
        continue
    for p in json.loads(path.read_text()).get("points", []):
        d = p.get("derived", {})
        ar = d.get("ar_s")
        engine = d.get("engine_s")
        for block, b in (d.get("blocks") or {"-": {}}).items():
            cycle = b.get("cycle_s")
            print(f"{name:<10} {p['batch']}x{p['context']:<6} {block:>5} {ar * 1e3 if ar else float('nan'):7.2f} "
                  f"{cycle * 1e3 if cycle else float('nan'):9.2f} {engine * 1e3 if engine else float('nan'):10.2f}")
sampling = out / "sampling.json"
if sampling.exists():
    for r in json.loads(sampling.read_text())["results"]:
        print(f"sampling R={r['rows']}: threshold {r['threshold_mask_us']:.0f} us, sort {r['full_sort_mask_us']:.0f} us, "
              f"top-p processed_probs {r['processed_probs_top_p_0.9_us']:.0f} us, same tokens {r['same_tokens_kept']}")
EOF
