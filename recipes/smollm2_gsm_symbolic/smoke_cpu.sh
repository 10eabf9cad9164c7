#!/usr/bin/env bash
# run.sh shrunk to a CPU smoke test: 2 CPU ranks, HF rollout, 2 steps of 4 prompts x 2 samples, 64 new tokens,
# validation on 4 prompts of each test set. Proves the config, SmolLM2's chat template and the scorer path end to end
# (not learning). About 3-6 minutes on 2 cores, the model conversion included.
#
#   bash recipes/smollm2_gsm_symbolic/smoke_cpu.sh [hydra overrides]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export WORK_DIR=${WORK_DIR:-/tmp/smollm2_gsm_symbolic}
export RUN_DIR=${RUN_DIR:-$WORK_DIR/smoke_cpu_$(date +%Y%m%d_%H%M%S)}
export VAL_MAX_SAMPLES=${VAL_MAX_SAMPLES:-4}
exec bash "$HERE/run.sh" \
    trainer.device=cpu trainer.n_gpus_per_node=2 \
    actor_rollout_ref.rollout.name=hf \
    data.train_batch_size=4 data.max_response_length=64 \
    actor_rollout_ref.rollout.n=2 \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
    trainer.total_training_steps=2 trainer.test_freq=2 \
    "$@"
