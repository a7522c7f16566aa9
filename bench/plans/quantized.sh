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
#                                                        # ARGS (more bench.decode.speed arguments, e.g. --profile),
#                                                        # HLO=1 with ARGS=--profile: NAME-fusions.txt, what
#                                                        # the AR step's repeated XLA kernels run (bench.hlo_fusions)
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
    name="q-${MODEL:+$MODEL-}${POINTS:-1x1k}-$variant"
    dump=""
    [ -n "${HLO:-}" ] && dump="XLA_FLAGS=--xla_dump_to=/tmp/hlo-$name --xla_dump_hlo_as_text"
    decode "$name" ${LIMIT:-190} "$dump" --points "$(big "${POINTS:-1x1k}" 1x128)" \
        --sections "${SECTIONS:-generate,steps}" --block-sizes "${BLOCKS:-16}" "${model[@]}" "${quantize[@]}" ${ARGS:-}
    [ -n "${HLO:-}" ] && python3 -m bench.hlo_fusions "/tmp/hlo-$name" --profile "$out/$name.json" > "$out/$name-fusions.txt" 2>&1
done
python3 -m bench.decode.summary "$out"
