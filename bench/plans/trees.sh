#!/usr/bin/env bash
# One plan run in several source trees in one device call (the same machine, the same
# minutes): the before/after comparison of any plan, where compare.sh's steps do not fit.
# TREES lists LABEL=FOLDER pairs: "." this checkout, others a commit unpacked beside it and
# carried, e.g.
#   git archive BASE dflash_jax pallas_kernels bench pyproject.toml | tar -x -C .gpu_carry/base --exclude=bench/results
#   rm -rf .gpu_carry/base/dflash_jax/assets      # (carry: [".gpu_carry"])
# Each tree runs the plan from its own folder (PYTHONPATH unset, so it imports its own code),
# with its label as the records' commit (a device copy's git HEAD is not the tree that ran),
# into $OUT/N-LABEL. The plan's variables (VARIANTS, SECTIONS, MODEL, ARGS, ...) pass through.
# Trees run in the order given: name the base first and last to see the drift between runs.
# The plan's logs and markdown are removed unless KEEP=1 (a call returns at most 8 files);
# TAIL (default 3) lines of each tree's output are printed.
#
#   OUT=... TREES="cd033c2=.gpu_carry/base new=. cd033c2=.gpu_carry/base" VARIANTS=int8-b128 \
#       SECTIONS=generate bash bench/plans/trees.sh quantized.sh
#   OUT=/tmp/t TREES="a=. b=." SMALL=1 VARIANTS=int8-b128 SECTIONS=generate bash bench/plans/trees.sh quantized.sh
set -uo pipefail
plan=${1:?usage: OUT=... TREES="LABEL=FOLDER ..." bash $0 PLAN (a file of bench/plans)}
out=${OUT:?set OUT to the results folder}
i=0
for pair in ${TREES:?set TREES to LABEL=FOLDER pairs}; do
    label=${pair%%=*} folder=${pair#*=} i=$((i + 1))
    [ -f "$folder/bench/plans/$plan" ] || { echo "$folder has no bench/plans/$plan"; exit 2; }
    echo "== $i $label ($folder)"
    (cd "$folder" && unset PYTHONPATH && OUT="$out/$i-$label" bash "bench/plans/$plan" "$label" 2>&1 | tail -"${TAIL:-3}")
    [ -n "${KEEP:-}" ] || rm -f "$out/$i-$label"/*.log "$out/$i-$label"/*.md
done
