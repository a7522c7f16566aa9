#!/usr/bin/env bash
# Mixture-of-experts targets in one device call: the experts' product every way
# (bench.kernels.moe_products: XLA's ragged_dot, the library's grouped-expert kernel, tokamax
# where installed) for Qwen3-30B-A3B and gpt-oss-20b, then bench.decode.speed on both shapes
# (AR step and the DFlash cycle per verify block, at each batch of POINTS: what a block costs
# as it routes to more experts), and the same steps with the reference product.
#
#   OUT=... bash bench/plans/moe.sh COMMIT   # MODELS (both), POINTS (1x1k,32x1k), BLOCKS (4,8,16),
#                                            # PARTS (products,steps,reference; also profile: --profile of
#                                            # the batch-1 1k steps, their kernels in launch order; int8:
#                                            # the steps with 8-bit experts per 128 rows), WHEELS (a folder
#                                            # to pip install). The 48-layer Qwen3-30B-A3B profile needs an
#                                            # H200; qwen3-30b-a3b-24-layers fits an H100.
#   OUT=/tmp/m SMALL=1 bash bench/plans/moe.sh HEAD  # CPU smoke test
source "$(dirname "$0")/common.sh"
parts=${PARTS:-products,steps,reference}
[ -n "${WHEELS:-}" ] && pip install -q --no-deps "$WHEELS"/*.whl 2>&1 | tail -2
for model in ${MODELS:-qwen3-30b-a3b gpt-oss-20b}; do
    shape=$([ -z "$small" ] && echo "$model" || echo small-moe)
    if [[ $parts == *products* ]]; then
        echo "== products $model"
        timeout ${LIMIT:-150} python3 -m bench.kernels.moe_products $small --model "$model" \
            --out "$out/moe-products-$model.json" > "$out/moe-products-$model.log" 2>&1
        echo "   rc=$?"
    fi
    if [[ $parts == *steps* ]]; then
        decode "moe-steps-$model" ${LIMIT:-240} "" --model "$shape" --points "$(big "${POINTS:-1x1k,32x1k}" 1x128)" \
            --sections steps --block-sizes "${BLOCKS:-4,8,16}"
    fi
    if [[ $parts == *profile* ]]; then
        decode "moe-profile-$model" ${LIMIT:-240} "" --model "$shape" --points "$(big 1x1k 1x128)" \
            --sections generate --block-sizes 8 --profile
    fi
    if [[ $parts == *int8* ]]; then
        decode "moe-steps-int8-$model" ${LIMIT:-240} "" --model "$shape" --points "$(big "${POINTS:-1x1k,32x1k}" 1x128)" \
            --sections steps --block-sizes "${BLOCKS:-4,8,16}" --quantize int8 --quantize-block 128
    fi
    if [[ $parts == *reference* ]]; then
        decode "moe-steps-reference-$model" ${LIMIT:-240} "" --model "$shape" --kernels experts=reference \
            --points "$(big 1x1k 1x128)" --sections steps --block-sizes 16
    fi
done
python3 -m bench.decode.summary "$out"
