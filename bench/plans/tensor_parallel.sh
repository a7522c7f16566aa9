#!/usr/bin/env bash
# Tensor parallelism on one multi-GPU host (issue 21): per shape and tensor-parallel size,
# bench.decode.speed's generate section (AR step, DFlash cycle at block 16) and engine section
# (the Engine's AR and DFlash steps), random bf16 weights, Pallas attention, one process per
# (shape, size); the table of bench.parallel.table last (step times per size, speedup over TP 1).
# The predictions it tests: bench/LOG.md, "Tensor parallelism: cost model".
#
#   bash bench/plans/tensor_parallel.sh COMMIT [SHAPE ...]          # on the device; results under $OUT
#                                                                   # shapes: qwen3-8b qwen3-32b (the default)
#   SMALL=1 OUT=/tmp/tp bash bench/plans/tensor_parallel.sh test    # CPU smoke test: small shapes, 4 fake devices
#
# Settings (environment): TPS (default "1 2 4 8"; sizes above the GPUs there are skipped),
# POINTS (default 1x1k,32x1k), SECTIONS (default generate,engine), LIMIT (seconds per run,
# default 300), BUDGET (seconds for the whole call, default 560: a run starts only with
# MIN_RUN seconds left, default 120, and gets at most what is left). The whole plan takes more
# than one 600 s call; each call ends by printing the runs it skipped, to pass to the next:
#
#   SECTIONS=generate bash bench/plans/tensor_parallel.sh COMMIT qwen3-8b
#   SECTIONS=engine bash bench/plans/tensor_parallel.sh COMMIT qwen3-8b
#   SECTIONS=generate TPS="1 2" bash bench/plans/tensor_parallel.sh COMMIT qwen3-32b   # and so on
#   python -m bench.parallel.table CALL1_OUT CALL2_OUT ...                             # one table of all calls
#
# At TP > 1 the models are drawn on the first GPU and placed through the host
# (bench.decode.speed's docstring): the 32B shape needs about twice its 65 GB of host memory
# while it is placed.
source "$(dirname "$0")/common.sh"
shift
shapes=${*:-qwen3-8b qwen3-32b}
if [ -n "$small" ]; then
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=4" JAX_DISABLE_MOST_OPTIMIZATIONS=1
    shapes=small  # --small draws the small shapes whatever --model says
    gpus=4
else
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    [ "$gpus" -gt 0 ] || gpus=$(python3 -c 'import jax; print(jax.device_count())')
fi
points=${POINTS:-$(big 1x1k,32x1k 1x128)}
sections=${SECTIONS:-generate,engine}
echo "== $gpus devices; shapes $shapes; TP ${TPS:-1 2 4 8}; points $points; sections $sections"

skipped=()
for shape in $shapes; do
    for tp in ${TPS:-1 2 4 8}; do
        if [ "$tp" -gt "$gpus" ]; then
            echo "== $shape TP $tp skipped: $gpus devices"
            continue
        fi
        left=$((${BUDGET:-560} - SECONDS))
        if [ "$left" -lt "${MIN_RUN:-120}" ]; then
            echo "== $shape TP $tp skipped: $left s of the call's budget left"
            skipped+=("$shape:$tp")
            continue
        fi
        limit=$((left < ${LIMIT:-300} ? left : ${LIMIT:-300}))
        # 92% of each GPU: the 32B shape at TP 1 holds its weights, K/V and a prefill's activations.
        decode "$shape-tp$tp-${sections//,/+}" "$limit" XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 --quick \
            --model "$shape" --tensor-parallel "$tp" --points "$points" --sections "$sections" \
            --budget-s $((limit - 45))
    done
done

python3 -m bench.parallel.table "$out"
if [ ${#skipped[@]} -gt 0 ]; then
    echo "not run for lack of time (SECTIONS=$sections): ${skipped[*]}"
fi
