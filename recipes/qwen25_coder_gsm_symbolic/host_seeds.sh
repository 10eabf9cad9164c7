#!/usr/bin/env bash
# The recipe's seeds on the offline GPU host (issue 60's variants, issue 59's vs_verl and verl), where one call may run
# 10 minutes and a variant's 3 seeds take about 23: start them detached in one call, then copy back what has finished
# call after call (README.md, "Running it on the offline GPU host").
#
#   bash recipes/qwen25_coder_gsm_symbolic/host_seeds.sh start VARIANT SEED...   # the model's pieces in $PIECES
#   bash recipes/qwen25_coder_gsm_symbolic/host_seeds.sh pack VARIANT SECONDS    # waits up to SECONDS, then copies
#
# start: copies the project to /tmp/hrl (each call brings the working tree anew, and the run must not read a changing
# one; benchmarks/ too, whose settings table compare.sh vs_verl reads), writes the host's card and versions to
# $OUT/host.txt, and runs compare.sh VARIANT SEED... detached (scripts/gpu/detached.sh) with WORK_DIR=/tmp/qwork and
# GGUF_PIECES=$PIECES (default /tmp/gguf/$MODEL); VARIANT=verl prepares the same data and model (or finds them there)
# and runs verl_compare.py --seeds SEED... instead (verl's sites installed first: scripts/gpu/install_verl.sh).
# pack: waits for the run up to SECONDS, then packs each seed's logs (metrics.jsonl, summary.json,
# val_generations.tgz; not the unpacked answers) into $OUT/<seed dir>.tgz and copies the run's log to $OUT. It exits
# as detached.sh wait does: 0 once the run has ended, 3 while it runs.
set -uo pipefail
verb=${1:?usage: host_seeds.sh start VARIANT SEED... | pack VARIANT SECONDS}
VARIANT=${2:?VARIANT: see compare.sh}
shift 2
MODEL=${MODEL:-0.5b}
WORK=/tmp/qwork
OUT=${OUT:?OUT: the folder the device tool copies back}
case "$verb" in
    start)
        [ $# -ge 1 ] || { echo "start: give the seeds" >&2; exit 2; }
        PIECES=${PIECES:-/tmp/gguf/$MODEL}
        [ -f "$PIECES/manifest.json" ] || { echo "no manifest.json in $PIECES: copy the staged pieces there" >&2; exit 2; }
        rm -rf /tmp/hrl && mkdir -p /tmp/hrl && cp -a hybridrl recipes examples scripts benchmarks pyproject.toml /tmp/hrl/
        { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; date -u
          python3 -c "import torch, transformers, sglang, ray; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'sglang', sglang.__version__, 'ray', ray.__version__)"; } > "$OUT/host.txt" 2>&1
        cat "$OUT/host.txt"
        if [ "$VARIANT" = verl ]; then  # the data and model first (run.sh's step 1 and 2; kept if already there)
            RUN=(bash -c 'cd /tmp/hrl && export PYTHONPATH=/tmp/hrl:$PYTHONPATH && bash recipes/gsm_symbolic_prepare.sh \
                 "qwen2.5-coder-$MODEL-instruct" "$WORK_DIR/qwen2.5-coder-$MODEL-instruct" "$WORK_DIR/data" \
                 "$WORK_DIR/prepare" && python3 recipes/qwen25_coder_gsm_symbolic/verl_compare.py --seeds "$@"' _ "$@")
        else
            RUN=(bash /tmp/hrl/recipes/qwen25_coder_gsm_symbolic/compare.sh "$VARIANT" "$@")
        fi
        bash scripts/gpu/detached.sh start "$VARIANT" env MODEL="$MODEL" WORK_DIR=$WORK GGUF_PIECES="$PIECES" "${RUN[@]}" ;;
    pack)
        [ $# -eq 1 ] || { echo "pack: give the seconds to wait" >&2; exit 2; }
        bash scripts/gpu/detached.sh wait "$VARIANT" "$1"
        status=$?
        for run_dir in "$WORK"/compare/"${MODEL}_${VARIANT}"_seed*; do
            [ -d "$run_dir" ] || continue
            tar czf "$OUT/$(basename "$run_dir").tgz" -C "$WORK/compare" --exclude val_generations "$(basename "$run_dir")"
        done
        cp /tmp/detached/"$VARIANT"/log "$OUT/$VARIANT.log" 2>/dev/null
        ls -l "$OUT"
        exit $status ;;
    *) echo "expected start or pack, got $verb" >&2; exit 2 ;;
esac
