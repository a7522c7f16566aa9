#!/usr/bin/env bash
# The Mosaic GPU wgmma prototype with block scales (bench.kernels.wgmma_block_scaled) in one
# device call: its results against the reference at 3 and 256 rows (a failing tile setting's
# whole traceback), then the Qwen3-8B products at ROWS (default 64,256) beside the Pallas
# kernel, XLA's bf16 product and JAX's own per-column mixed-type kernel.
#
#   OUT=... bash bench/plans/wgmma.sh COMMIT
#   OUT=/tmp/w SMALL=1 bash bench/plans/wgmma.sh HEAD      # CPU smoke test (no Mosaic variants)
source "$(dirname "$0")/common.sh"
echo "== check"
python3 -m bench.kernels.wgmma_block_scaled --rows "$(big 3,256 3)" > "$out/check.log" 2>&1
echo "   rc=$?"; grep -E "largest error|FAILED" "$out/check.log"
grep -m1 -A30 "Traceback" "$out/check.log" | tail -12
echo "== products"
timeout "${LIMIT:-300}" python3 -m bench.kernels.quantized_products $small --commit "$commit" --rows "$(big "${ROWS:-64,256}" 1)" \
    --sweep "" --reps 5 --copies 6 --out "$out/products.json" > "$out/products.log" 2>&1
echo "   rc=$?"
grep -E "^(qkv|o |gate_up|down) " "$out/products.log" | grep -E " (bf16|pallas-int8-b128-nk|pallas-int8-nk|jaxmixed|mgpu)" \
    | grep -v failed
