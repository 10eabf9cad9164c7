#!/usr/bin/env bash
# GRPO on Qwen2.5-Coder-0.5B-Instruct (or 1.5B) with reasoning-gym gsm_symbolic: one GPU, SGLang rollout, greedy
# test accuracy measured before and after in the same run. What to expect: README.md.
#
#   bash recipes/qwen25_coder_gsm_symbolic/run.sh [hydra overrides]      # overrides given here win over the ones below
#
# Environment (all optional):
#   MODEL        0.5b (default) or 1.5b
#   SEED         1 (default): the data order and the sampling (data.seed, trainer.seed)
#   WORK_DIR     data, converted model and runs (default /tmp/qwen25_coder_gsm_symbolic)
#   RUN_DIR      logs: metrics.jsonl, val_generations/, summary.json (default $WORK_DIR/run_$MODEL_seed$SEED);
#                must not hold a run, unless RESUME=1
#   RESUME       1: continue the run in RUN_DIR from its latest checkpoint (the first part ran with
#                trainer.save_freq=N), without validating again first; metrics.jsonl goes on where it stopped. For a
#                run longer than one sitting: the 1.5B model on the offline host's 10-minute calls (README.md)
#   VAL_MAX_SAMPLES  the first N questions of each test set are validated (default -1: all; smoke_cpu.sh: 4)
#   GGUF_WHEELS  the model's chunk wheels in this folder (default: the installed chunk packages, see README.md)
#   GGUF_PIECES  or the pieces and manifest.json that scripts/gpu/stage_gguf.sh staged for an offline host
#   GGUF_FILE    or the reassembled .gguf file
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MODEL=${MODEL:-0.5b}
SEED=${SEED:-1}
WORK_DIR=${WORK_DIR:-/tmp/qwen25_coder_gsm_symbolic}
RUN_DIR=${RUN_DIR:-$WORK_DIR/run_${MODEL}_seed$SEED}
DATA_DIR=$WORK_DIR/data
# Validation: two test sets, each logged under its own name with the task's score (eval/<set>) and the reward's acc,
# formatted, last_number_right and solved (eval/<set>/<extra>): 1,024 questions of the templates held out of training
# (test.parquet, the headline: problems never trained on) and 256 of the training templates
# (test_in_template.parquet). summary.json leads with the held-out share solved, in any format
# (trainer.summary_metric).
VAL_MAX_SAMPLES=${VAL_MAX_SAMPLES:--1}
EVAL_SETS="[{name: held_out, path: '$DATA_DIR/test.parquet', max_samples: $VAL_MAX_SAMPLES},"
EVAL_SETS+=" {name: in_template, path: '$DATA_DIR/test_in_template.parquet', max_samples: $VAL_MAX_SAMPLES}]"
# What the 1.5B model needs to fit one 80 GB card: with 16k-token micro-batches and no activation checkpointing its
# first update ran out of memory on an H100 (71 GiB allocated, 2026-12-06); with these the peak was 33 GiB.
case "$MODEL" in
    0.5b) MEMORY=() ;;
    1.5b) MEMORY=(actor_rollout_ref.model.use_fused_kernels=true actor_rollout_ref.model.enable_gradient_checkpointing=true
                  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192) ;;
    *) echo "MODEL=$MODEL: expected 0.5b or 1.5b" >&2; exit 1 ;;
esac
SOURCE=qwen2.5-coder-$MODEL-instruct
MODEL_DIR=$WORK_DIR/$SOURCE

export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
cd "$REPO"
# 1. Data and 2. model: recipes/gsm_symbolic_prepare.sh (GGUF_WHEELS / GGUF_PIECES / GGUF_FILE above).
RESUME=${RESUME:-0} bash recipes/gsm_symbolic_prepare.sh "$SOURCE" "$MODEL_DIR" "$DATA_DIR" "$RUN_DIR"
START=(trainer.resume_mode=disable trainer.val_before_train=true)
if [ "${RESUME:-0}" = 1 ]; then START=(trainer.resume_mode=auto trainer.val_before_train=false); fi

# 3. GRPO: 64 prompts x 8 samples a step, two optimizer steps of 32 prompts each, no KL, no critic, no reference;
#    greedy validation on all test questions before training, every 5 steps and at the end; no checkpoint; then the
#    model's memory settings (above) and the caller's overrides.
#    exec: the trainer takes this shell's place, so `timeout N run.sh` waits while the trainer, stopped by its SIGTERM,
#    finishes the step and saves it (a shell would die at once, and the host would end the trainer mid-save).
exec python -m hybridrl.main_ppo \
    algorithm=grpo \
    data.train_files="$DATA_DIR/train.parquet" data.val_files=[] data.eval_sets="$EVAL_SETS" \
    data.max_prompt_length=256 data.max_response_length=512 \
    data.train_batch_size=64 data.seed="$SEED" \
    actor_rollout_ref.model.path="$MODEL_DIR" \
    actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.actor.optim.lr=3e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.use_dynamic_bsz=true \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 \
    actor_rollout_ref.actor.use_kl_loss=false \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name=sglang \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
    +actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton \
    custom_reward_function.path="$REPO/recipes/gsm_symbolic_reward.py" \
    custom_reward_function.name=compute_score \
    trainer.nnodes=1 trainer.n_gpus_per_node=1 trainer.seed="$SEED" \
    trainer.total_training_steps=25 trainer.test_freq=5 trainer.save_freq=-1 "${START[@]}" \
    trainer.summary_metric=eval/held_out/solved \
    trainer.logger='[console,jsonl]' trainer.default_local_dir="$RUN_DIR" \
    trainer.validation_data_dir="$RUN_DIR/val_generations" \
    trainer.project_name=qwen25_coder_gsm_symbolic trainer.experiment_name="grpo_${MODEL}_seed$SEED" \
    ${MEMORY[@]+"${MEMORY[@]}"} "$@"
