#!/usr/bin/env bash
# One H200 call: the decode loops with and without XLA command buffers (CUDA graphs) over
# the whole while loop, SmolLM2-135M and Qwen3-8B shapes, bf16, batch 1; a profile of each
# (command buffers kept on while profiling), and a profile of the Qwen3-8B batch-32 block-4
# cycle. Results under $OUT; a table last.
#
#   bash bench/xla_graphs.sh COMMIT
#   SMALL=1 OUT=/tmp/graphs bash bench/xla_graphs.sh test   # CPU smoke test
source "$(dirname "$0")/device_plan.sh"
graphs="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
graphs="$graphs --xla_enable_command_buffers_during_profiling=true"
[ -n "$small" ] && graphs=""
graphs="XLA_FLAGS=$graphs"
profiled="--sections generate --profile"

decode smollm2-base 75 "" $profiled --model smollm2-135m --points "$(big 1x256 1x128)" --block-sizes 16,8
decode smollm2-graphs 75 "$graphs" $profiled --model smollm2-135m --points "$(big 1x256 1x128)" --block-sizes 16,8
decode qwen3-base 110 "" $profiled --points "$(big 1x1k 1x128)"
decode qwen3-graphs 110 "$graphs" $profiled --points "$(big 1x1k 1x128)"
decode qwen3-b32 120 "" $profiled --points "$(big 32x1k 2x128)" --block-sizes 4

python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"\n{'run':<16} {'point':<8} {'block':>5} {'AR ms':>7} {'cycle ms':>9} {'AR events':>10} {'cycle events':>13} {'dtoh/iter':>10}")
for path in sorted(out.glob("*.json")):
    run = json.loads(path.read_text())
    prof = {p.get("attention_impl"): p for p in run.get("profile") or []}.get("pallas", {})
    ev = lambda loop, key: (prof.get(loop) or {}).get("per_iteration", {}).get(key, float("nan"))
    for p in run.get("points", []):
        d = p.get("derived", {})
        ar = d.get("ar_s") or float("nan")
        for block, b in (d.get("blocks") or {"-": {}}).items():
            cycle = b.get("cycle_s") or float("nan")
            print(f"{path.stem:<16} {p['batch']}x{p['context']:<6} {block:>5} {ar * 1e3:7.3f} {cycle * 1e3:9.3f} "
                  f"{ev('ar', 'device_events'):10.0f} {ev('dflash', 'device_events'):13.0f} {ev('dflash', 'memcpy_dtoh'):10.1f}")
PY
