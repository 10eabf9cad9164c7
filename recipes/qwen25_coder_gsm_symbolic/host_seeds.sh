#!/usr/bin/env bash
# The recipe's seeds on the offline GPU host (issue 60's variants, issue 59's vs_verl and verl), where one call may run
# 10 minutes and a variant's 3 seeds take 15-20: start a queue of seeds detached in one call, then copy back what has
# finished call after call (README.md, "Running it on the offline GPU host").
#
#   bash recipes/qwen25_coder_gsm_symbolic/host_seeds.sh start VARIANT SEED... [VARIANT SEED...]  # pieces in $PIECES
#   bash recipes/qwen25_coder_gsm_symbolic/host_seeds.sh pack QUEUE SECONDS   # waits up to SECONDS, then copies
#
# start: checks each VARIANT (compare.sh VARIANT --check, or verl), copies the project to $HOST_COPY_DIR (default
# /tmp/hrl: each call brings the working tree anew, and the run must not read a changing one; benchmarks/ too, whose
# settings table compare.sh vs_verl reads), writes the host's card and versions to $OUT/host.txt, and runs the queue
# detached (scripts/gpu/detached.sh) under the name QUEUE, its variants joined by '+' (printed): each variant's seeds
# in the order given, with WORK_DIR=$HOST_WORK_DIR (default /tmp/qwork) and GGUF_PIECES=$PIECES (default
# /tmp/gguf/$MODEL). A variant runs compare.sh VARIANT SEED...; verl prepares the same data and model (or finds them
# there) and runs verl_compare.py --seeds SEED... (verl's sites installed first: scripts/gpu/install_verl.sh). A
# variant that fails is reported and the next one runs. Why a queue: a lease holds about 3 seeds after the
# machine's start, set-up and conversion (README.md), so the next variant's seeds start at once instead of at the
# next call.
# pack: waits for QUEUE up to SECONDS, then packs each seed's logs of its variants (metrics.jsonl, summary.json,
# val_generations.tgz; not the unpacked answers) into $OUT/<seed dir>.tgz, finished or not (seed_table.py refuses a
# seed without its summary, unless --cut-off), and copies the queue's log to $OUT as QUEUE.log with '_' for '+' (the
# device tool returns no name with a '+'). It exits as detached.sh wait does: 0 once the queue has ended, 3 while it
# runs.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
verb=${1:?usage: host_seeds.sh start VARIANT SEED... [VARIANT SEED...] | pack QUEUE SECONDS}
shift
MODEL=${MODEL:-0.5b}
WORK=${HOST_WORK_DIR:-/tmp/qwork}
COPY=${HOST_COPY_DIR:-/tmp/hrl}
DETACHED_ROOT=${DETACHED_ROOT:-/tmp/detached}
export DETACHED_ROOT

# The queue as lines of VARIANT SEED...; a seed before any variant, or a variant without seeds, is refused (exit 2)
queue_entries() {
    local entry="" arg
    for arg in "$@"; do
        if [[ $arg =~ ^[0-9]+$ ]]; then
            [ -n "$entry" ] || { echo "start: a seed ($arg) before any VARIANT" >&2; return 2; }
            entry+=" $arg"
            continue
        fi
        if [ -n "$entry" ]; then
            [[ $entry == *" "* ]] || { echo "start: give $entry its seeds" >&2; return 2; }
            echo "$entry"
        fi
        entry=$arg
    done
    [[ $entry == *" "* ]] || { echo "start: give VARIANT SEED... (got: $*)" >&2; return 2; }
    echo "$entry"
}

# The queue itself, run detached in the copy: each entry in turn, the next one whether or not this one failed
run_queue() {
    local entries entry words failed=0
    mapfile -t entries < <(queue_entries "$@")  # read first: the runs must not read the queue from their stdin
    for entry in "${entries[@]}"; do
        read -r -a words <<< "$entry"
        local variant=${words[0]} seeds=("${words[@]:1}")
        echo "== queue: $variant seeds ${seeds[*]}"
        if [ "$variant" = verl ]; then  # the data and model first (run.sh's step 1 and 2; kept if already there)
            (cd "$COPY" && export PYTHONPATH=$COPY${PYTHONPATH:+:$PYTHONPATH} \
                && bash recipes/gsm_symbolic_prepare.sh "qwen2.5-coder-$MODEL-instruct" \
                    "$WORK_DIR/qwen2.5-coder-$MODEL-instruct" "$WORK_DIR/data" "$WORK_DIR/prepare" \
                && python3 recipes/qwen25_coder_gsm_symbolic/verl_compare.py --seeds "${seeds[@]}")
        else
            bash "$COPY/recipes/qwen25_coder_gsm_symbolic/compare.sh" "$variant" "${seeds[@]}"
        fi || { echo "== queue: $variant failed" >&2; failed=1; }
    done
    return $failed
}

case "$verb" in
    start)
        entries=$(queue_entries "$@") || exit 2
        variants=()
        for variant in $(cut -d' ' -f1 <<< "$entries"); do
            [ "$variant" = verl ] || MODEL=$MODEL bash "$HERE/compare.sh" "$variant" --check || exit 2
            variants+=("$variant")
        done
        OUT=${OUT:?OUT: the folder the device tool copies back}
        PIECES=${PIECES:-/tmp/gguf/$MODEL}
        [ -f "$PIECES/manifest.json" ] || { echo "no manifest.json in $PIECES: copy the staged pieces there" >&2; exit 2; }
        name=$(IFS=+; echo "${variants[*]}")
        rm -rf "$COPY" && mkdir -p "$COPY" \
            && cp -a "$REPO"/{hybridrl,recipes,examples,scripts,benchmarks,pyproject.toml} "$COPY"/ || exit 1
        { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; date -u
          python3 -c "import torch, transformers, sglang, ray; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'sglang', sglang.__version__, 'ray', ray.__version__)"; } > "$OUT/host.txt" 2>&1
        cat "$OUT/host.txt"
        bash "$REPO/scripts/gpu/detached.sh" start "$name" env MODEL="$MODEL" WORK_DIR="$WORK" GGUF_PIECES="$PIECES" \
            HOST_COPY_DIR="$COPY" bash "$COPY/recipes/qwen25_coder_gsm_symbolic/host_seeds.sh" run "$@" \
            && echo "queue: $name (pack it with: host_seeds.sh pack $name SECONDS)" ;;
    run)
        WORK_DIR=${WORK_DIR:?WORK_DIR} run_queue "$@" ;;
    pack)
        [ $# -eq 2 ] || { echo "pack: give the queue's name and the seconds to wait" >&2; exit 2; }
        OUT=${OUT:?OUT: the folder the device tool copies back}
        bash "$REPO/scripts/gpu/detached.sh" wait "$1" "$2"
        status=$?
        IFS=+ read -r -a variants <<< "$1"
        for variant in "${variants[@]}"; do
            for run_dir in "$WORK"/compare/"${MODEL}_${variant}"_seed*; do
                [ -d "$run_dir" ] || continue
                tar czf "$OUT/$(basename "$run_dir").tgz" -C "$WORK/compare" --exclude val_generations \
                    "$(basename "$run_dir")"
            done
        done
        cp "$DETACHED_ROOT/$1/log" "$OUT/${1//+/_}.log" 2>/dev/null
        ls -l "$OUT"
        exit $status ;;
    *) echo "expected start or pack, got $verb" >&2; exit 2 ;;
esac
