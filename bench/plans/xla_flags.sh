#!/usr/bin/env bash
# XLA flag sets against each other in one device call: bench.decode.speed's generate section
# (the AR step and the DFlash cycle) per model under each set, sets in the order given (name
# the base first and last to see the drift between runs), then the compiled kernels' GPU
# tests under the last set that is not the base (TESTS=0 skips them; TEST_FILES: which).
# Results under $OUT; a table (bench.decode.summary) last.
#
#   OUT=... bash bench/plans/xla_flags.sh COMMIT
#     FLAG_SETS  label=flags pairs separated by ";" (default "base=;pdl=--xla_gpu_enable_pdl=true;base=");
#                the set "graphs" of earlier sessions: XLA command buffers over the whole loop,
#                --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL
#                --xla_enable_command_buffers_during_profiling=true
#     MODELS (qwen3-30b-a3b gpt-oss-20b qwen3-8b), POINTS (1x1k), BLOCKS (8),
#     PROFILE=1 (--profile: the ops of each step, per set), LIMIT (240 s a run), ARGS (more
#     bench.decode.speed arguments, e.g. --point-budget-s 15)
#   SMALL=1 OUT=/tmp/flags bash bench/plans/xla_flags.sh test   # CPU smoke test (flags left out)
source "$(dirname "$0")/common.sh"
IFS=';' read -r -a sets <<< "${FLAG_SETS:-base=;pdl=--xla_gpu_enable_pdl=true;base=}"
profile=${PROFILE:+--profile}
tested=""
i=0
for model in ${MODELS:-qwen3-30b-a3b gpt-oss-20b qwen3-8b}; do
    shape=$([ -z "$small" ] && echo "$model" || echo small-moe)
    for set in "${sets[@]}"; do
        label=${set%%=*} flags=${set#*=} i=$((i + 1))
        [ -n "$small" ] && flags=""
        [ -n "$flags" ] && tested=$flags
        decode "$i-$model-$label" ${LIMIT:-240} "${flags:+XLA_FLAGS=$flags}" --model "$shape" \
            --points "$(big "${POINTS:-1x1k}" 1x128)" --sections generate --block-sizes "${BLOCKS:-8}" $profile ${ARGS:-}
    done
done
if [ "${TESTS:-1}" = 1 ] && [ -n "$tested" ]; then
    echo "== gpu tests under XLA_FLAGS=$tested"
    XLA_FLAGS=$tested timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider ${TEST_FILES:-tests} > "$out/gpu_tests.log" 2>&1
    echo "   rc=$? $(tail -1 "$out/gpu_tests.log")"
fi
python3 -m bench.decode.summary "$out"
