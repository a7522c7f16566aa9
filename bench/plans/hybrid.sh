#!/usr/bin/env bash
# Hybrid (Qwen3.5) targets in one device call: the gated-delta-rule kernel's GPU tests, then
# bench.decode.speed on the Qwen3.5-9B shape (AR step and DFlash cycle at each of POINTS, with
# the Pallas rule), the same steps at 1x1k with the jnp reference rule, the rule alone
# (bench.kernels.delta_rule, with the kernel settings in VARIANTS), and with PARTS naming them:
# `profile` (device events per iteration at the first of POINTS), `sweep` (the attention
# kernel's settings at 32k with the target's and the drafter's heads, SIDES) and `rules`
# (generate at POINTS with each recurrence in RULES, default "pallas fused_decode fused": the
# rule's convolution and norms in the rule-inputs kernel on a GPU (jnp with rule_inputs=reference),
# in the rule's kernel in one-token steps, in it always;
# an entry may name more kernels, "fused_decode,rule_inputs=reference": the other steps' inputs in jnp;
# PROFILE_KERNELS=recurrence=fused profiles that form).
#
#   OUT=... bash bench/plans/hybrid.sh COMMIT   # POINTS (1x1k,1x8k,1x32k,32x1k), BLOCKS (16,8),
#                                               # PARTS (tests,steps,reference,kernel; also rules,profile,sweep),
#                                               # LIMIT (s, the steps), VARIANTS (u1,u4v8w1,...),
#                                               # CHUNKED (the chunked form's v<cols>w<warps>,...),
#                                               # SHAPES (the rule's rows x tokens), TESTS (test files)
#   OUT=/tmp/h SMALL=1 bash bench/plans/hybrid.sh HEAD  # CPU smoke test
source "$(dirname "$0")/common.sh"
parts=${PARTS:-tests,steps,reference,kernel}
points=${POINTS:-1x1k,1x8k,1x32k,32x1k}
blocks=${BLOCKS:-16,8}
shape=$(big qwen3_5-9b small-qwen3_5)
if [[ $parts == *tests* ]]; then
    echo "== gpu tests"
    timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider \
        ${TESTS:-tests/test_delta_rule_kernel.py tests/test_conv_delta_rule_kernel.py tests/test_rule_inputs_kernel.py tests/test_chunked_delta_rule.py tests/test_paged_attention_kernel.py tests/test_finish_heads_kernel.py} \
        > "$out/gpu_tests.log" 2>&1
    echo "   rc=$? $(tail -1 "$out/gpu_tests.log")"
fi
if [[ $parts == *steps* ]]; then
    decode hybrid-steps ${LIMIT:-380} "" --model "$shape" --points "$(big "$points" 1x128)" \
        --sections generate,steps --block-sizes "$blocks" --budget-s $(( ${LIMIT:-380} - 60 ))
fi
if [[ $parts == *reference* ]]; then
    decode hybrid-reference ${LIMIT:-150} "" --model "$shape" --kernels recurrence=reference \
        --points "$(big 1x1k 1x128)" --sections generate,steps --block-sizes 16
fi
if [[ $parts == *kernel* ]]; then
    echo "== delta-rule kernel"
    timeout 200 python3 -m bench.kernels.delta_rule $small --reps 10 --variants "${VARIANTS:-u1,u4v16w2,u4v8w1}" \
        --chunked "${CHUNKED:-v32w8,v64w8}" ${SHAPES:+--shapes $SHAPES} \
        --out "$out/delta_rule.json" > "$out/delta_rule.log" 2>&1
    echo "   rc=$?"; tail -n 24 "$out/delta_rule.log"
fi
if [[ $parts == *rules* ]]; then  # the rule's convolution and norms in their kernel or in the rule's, one after the other
    for rule in ${RULES:-pallas fused_decode fused}; do  # a rule may add kernels: fused_decode,rule_inputs=reference
        decode "hybrid-$(echo "$rule" | tr ',=' '--')" ${LIMIT:-380} "" --model "$shape" --points "$(big "$points" 1x128)" --kernels "recurrence=$rule" \
            --sections generate --block-sizes "$blocks" --budget-s $(( ${LIMIT:-380} - 60 )) ${POINT_BUDGET:+--point-budget-s $POINT_BUDGET}
    done
fi
if [[ $parts == *profile* ]]; then
    decode hybrid-profile 200 "" --model "$shape" --points "$(big "${points%%,*}" 1x128)" --sections generate \
        --profile --block-sizes "${blocks%%,*}" ${PROFILE_KERNELS:+--kernels $PROFILE_KERNELS}
    grep -E "^- (gated|paged|memcpy)|^\| 1x" "$out/hybrid-profile.log"
fi
if [[ $parts == *sweep* ]]; then
    for side in ${SIDES:-target drafter}; do
        echo "== attention settings at long context, the $side's heads (fastest first)"
        timeout ${SWEEP_LIMIT:-240} python3 -m bench.kernels.paged_attention --sweep --model "$(big qwen3_5-9b small)" \
            --side "$side" --contexts "$(big 32768 64)" $(big "" "--chain 1 --min-cache-mb 0") \
            --rows "$([ "$side" = drafter ] && echo 16 || echo 1,16)" --reps ${SWEEP_REPS:-$(big 20 1)} \
            --out "$out/attention_sweep_$side.json" > "$out/attention_sweep_$side.log" 2>&1
        echo "   rc=$?"
        for rows in q1 q16; do
            grep -E "^B1 .* $rows " "$out/attention_sweep_$side.log" | sed -E 's/^(.*) ([0-9.]+) us (.*)$/\2 \1/' \
                | sort -n | head -n 8
        done
    done
fi
python3 -m bench.decode.summary "$out"
