#!/usr/bin/env bash
# One H200 call that checks the compiled kernels and measures the headline numbers of
# issue 6 (a session's baseline before it changes anything; bench/LOG.md):
#
#   bash bench/plans/headline.sh COMMIT            # on the device; results under $OUT
#                                                  # (carry .whl/dflash-0.1.0-py3-none-any.whl: the
#                                                  # z-lab package some GPU tests compare against)
#   SMALL=1 OUT=/tmp/plan bash bench/plans/headline.sh test   # CPU smoke test of the same steps
#
# Each step has its own time limit and writes JSON and a log to $OUT as it goes, so a step
# that fails or runs out of time leaves the others' results. A table of the headline numbers
# (bench.decode.summary) is printed last. The limits add up to 560 s, inside the device
# tool's 600 s per command.
source "$(dirname "$0")/common.sh"

# 1. The compiled kernels against their references.
echo "== gpu tests"
if [ -z "$small" ]; then
    wheel=.whl/dflash-0.1.0-py3-none-any.whl
    [ -f $wheel ] && python3 -m pip install -q --no-deps --target /tmp/zlab $wheel > /dev/null 2>&1
    PYTHONPATH=$PYTHONPATH:/tmp/zlab timeout 230 python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/test_paged_attention_kernel.py tests/test_finish_heads_kernel.py tests/test_rms_norm_kernel.py \
        > "$out/gpu_tests.log" 2>&1
    echo "   rc=$? $(tail -1 "$out/gpu_tests.log")"
else
    echo "   skipped (no GPU)"
fi
# 2. Batch 1, 1k context: AR step, DFlash cycle and its parts, with a profile.
decode b1 120 "" --points "$(big 1x1k 1x128)" --sections generate,steps --profile
# 3. The Engine step, asynchronous scheduling and synchronous.
decode engine 105 "" --points "$(big 1x1k,8x1k 1x128)" --sections engine
# 4. Batch 32 at verify blocks 8 and 4 (the B32 target).
decode b32 105 "" --points "$(big 32x1k 2x128)" --block-sizes 8,4 --sections generate

python3 -m bench.decode.summary "$out"
