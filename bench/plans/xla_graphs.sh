#!/usr/bin/env bash
# One H200 call: the decode loops with and without XLA command buffers (CUDA graphs) over
# the whole while loop, SmolLM2-135M and Qwen3-8B shapes, bf16, batch 1; a profile of each
# (command buffers kept on while profiling), and a profile of the Qwen3-8B batch-32 block-4
# cycle. Results under $OUT; a table (bench.decode.summary) last.
#
#   bash bench/plans/xla_graphs.sh COMMIT
#   SMALL=1 OUT=/tmp/graphs bash bench/plans/xla_graphs.sh test   # CPU smoke test
source "$(dirname "$0")/common.sh"
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

python3 -m bench.decode.summary "$out"
