#!/usr/bin/env bash
# Hybrid (Qwen3.5) targets in one device call: the gated-delta-rule kernel's GPU tests, then
# bench.decode.speed on the Qwen3.5-9B shape (AR step and DFlash cycle at each of POINTS, with
# the Pallas rule), the same steps at 1x1k with the jnp reference rule, and the rule alone
# (bench.kernels.delta_rule).
#
#   OUT=... bash bench/plans/hybrid.sh COMMIT   # POINTS (1x1k,1x8k,1x32k,32x1k), BLOCKS (16,8),
#                                               # PARTS (tests,steps,reference,kernel), LIMIT (s, the steps)
#   OUT=/tmp/h SMALL=1 bash bench/plans/hybrid.sh HEAD  # CPU smoke test
source "$(dirname "$0")/common.sh"
parts=${PARTS:-tests,steps,reference,kernel}
shape=$(big qwen3_5-9b small-qwen3_5)
if [[ $parts == *tests* ]]; then
    echo "== gpu tests"
    timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_delta_rule_kernel.py \
        > "$out/gpu_tests.log" 2>&1
    echo "   rc=$? $(tail -1 "$out/gpu_tests.log")"
fi
if [[ $parts == *steps* ]]; then
    decode hybrid-steps ${LIMIT:-380} "" --model "$shape" --points "$(big "${POINTS:-1x1k,1x8k,1x32k,32x1k}" 1x128)" \
        --sections generate,steps --block-sizes "${BLOCKS:-16,8}" --budget-s $(( ${LIMIT:-380} - 60 ))
fi
if [[ $parts == *reference* ]]; then
    decode hybrid-reference ${LIMIT:-150} "" --model "$shape" --kernels recurrence=reference \
        --points "$(big 1x1k 1x128)" --sections generate,steps --block-sizes 16
fi
if [[ $parts == *kernel* ]]; then
    echo "== delta-rule kernel"
    timeout 150 python3 -m bench.kernels.delta_rule $small --reps 10 --out "$out/delta_rule.json" \
        > "$out/delta_rule.log" 2>&1
    echo "   rc=$?"; tail -n 14 "$out/delta_rule.log"
fi
python3 -m bench.decode.summary "$out"
