#!/usr/bin/env bash
# Mixture-of-experts targets in one device call: the experts' product three ways
# (bench.kernels.moe_products) for Qwen3-30B-A3B and gpt-oss-20b, then bench.decode.speed on
# both shapes (AR step, and the DFlash cycle per verify block: what a block costs as it
# routes to more experts).
#
#   OUT=... bash bench/plans/moe.sh COMMIT          # MODELS (default both), POINTS (1x1k), BLOCKS (4,8,16)
#   OUT=/tmp/m SMALL=1 bash bench/plans/moe.sh HEAD  # CPU smoke test
source "$(dirname "$0")/common.sh"
for model in ${MODELS:-qwen3-30b-a3b gpt-oss-20b}; do
    echo "== products $model"
    timeout ${LIMIT:-150} python3 -m bench.kernels.moe_products $small --model "$model" \
        --out "$out/moe-products-$model.json" > "$out/moe-products-$model.log" 2>&1
    echo "   rc=$?"
    decode "moe-${POINTS:-1x1k}-$model" ${LIMIT:-200} "" --model "$([ -z "$small" ] && echo "$model" || echo small-moe)" \
        --points "$(big "${POINTS:-1x1k}" 1x128)" --sections steps --block-sizes "${BLOCKS:-4,8,16}"
done
python3 -m bench.decode.summary "$out"
