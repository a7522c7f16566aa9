#!/usr/bin/env bash
# 8-bit targets against bf16 in one device call: bench.decode.speed at the Qwen3-8B shape with
# the target's decoder-layer weights in bf16, int8 and fp8 (weight-only; a VARIANTS entry
# NAME-bB scales per B input rows, e.g. int8-b128; else per output channel; a trailing -xla
# takes XLA's product everywhere, `--kernels quantized=reference`, and -pallas the Pallas kernel
# everywhere, `--kernels quantized=pallas`, instead of the default's choice per scaling).
#
#   OUT=... bash bench/plans/quantized.sh COMMIT        # POINTS (default 1x1k), BLOCKS (16),
#                                                        # SECTIONS (generate,steps), VARIANTS,
#                                                        # MODEL (a bench.shapes name, e.g. qwen3_5-9b),
#                                                        # ARGS (more bench.decode.speed arguments, e.g. --profile)
#   OUT=/tmp/q SMALL=1 bash bench/plans/quantized.sh HEAD   # CPU smoke test
source "$(dirname "$0")/common.sh"
for variant in ${VARIANTS:-bf16 int8 fp8}; do
    quantize=()
    [ "${variant%-xla}" != "$variant" ] && quantize=(--kernels quantized=reference)
    [ "${variant%-pallas}" != "$variant" ] && quantize=(--kernels quantized=pallas)
    block=${variant%-xla}
    block=${block%-pallas}
    weights=${block%%-b*}
    [ "$weights" != bf16 ] && quantize+=(--quantize "$weights")
    [ "$weights" != "$block" ] && quantize+=(--quantize-block "${block##*-b}")
    model=()
    [ -n "${MODEL:-}" ] && model=(--model "$(big "$MODEL" "small-${MODEL%%-*}")")
    decode "q-${MODEL:+$MODEL-}${POINTS:-1x1k}-$variant" ${LIMIT:-190} "" --points "$(big "${POINTS:-1x1k}" 1x128)" \
        --sections "${SECTIONS:-generate,steps}" --block-sizes "${BLOCKS:-16}" "${model[@]}" "${quantize[@]}" ${ARGS:-}
done
python3 -m bench.decode.summary "$out"
