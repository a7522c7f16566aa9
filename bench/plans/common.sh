# Shared by the one-call device plans (headline.sh, compare.sh, tensor_parallel.sh,
# xla_flags.sh); sourced, from the repository root, with the plan's arguments: COMMIT; $OUT
# the results folder; SMALL=1 for a CPU smoke test.
set -uo pipefail
commit=${1:?usage: bash $0 COMMIT (with OUT set)}
out=${OUT:?set OUT to the results folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
small=${SMALL:+--small}
big() { [ -z "$small" ] && echo "$1" || echo "$2"; }  # the device's value, else the smoke test's

decode() {  # name, time limit (s), one VAR=value for the environment ("" for none), then bench.decode.speed arguments
    local name=$1 limit=$2 assign=$3
    shift 3
    local -a environment=()
    [ -n "$assign" ] && environment=("$assign")
    echo "== $name"
    env "${environment[@]}" timeout "$limit" python3 -m bench.decode.speed $small --commit "$commit" \
        --out "$out/$name.json" --attention-impl pallas "$@" > "$out/$name.log" 2>&1
    echo "   rc=$? $(grep -c '^\[' "$out/$name.log") timeline lines"
}
