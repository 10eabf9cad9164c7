#!/usr/bin/env bash
# run.sh shrunk to a CPU smoke test: 1 CPU rank, HF rollout, 2 steps of 4 prompts x 2 samples, 48 new tokens,
# validation on 4 prompts of each test set. Proves the config, Qwen's chat template and the scorer path end to
# end (not learning). Needs the model's chunk packages (or GGUF_WHEELS / GGUF_PIECES / GGUF_FILE, see run.sh); on 2
# cores the conversion of the 0.5B model takes about 4 minutes and the run about 11 (one rank: two run out of 24 GiB).
#
#   bash recipes/qwen25_coder_gsm_symbolic/smoke_cpu.sh [hydra overrides]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export WORK_DIR=${WORK_DIR:-/tmp/qwen25_coder_gsm_symbolic}
export RUN_DIR=${RUN_DIR:-$WORK_DIR/smoke_cpu_$(date +%Y%m%d_%H%M%S)}
export VAL_MAX_SAMPLES=${VAL_MAX_SAMPLES:-4}
exec bash "$HERE/run.sh" \
    trainer.device=cpu trainer.n_gpus_per_node=1 \
    actor_rollout_ref.rollout.name=hf \
    actor_rollout_ref.model.use_remove_padding=false actor_rollout_ref.actor.use_dynamic_bsz=false \
    data.train_batch_size=4 data.max_response_length=48 \
    actor_rollout_ref.rollout.n=2 \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
    trainer.total_training_steps=2 trainer.test_freq=2 \
    "$@"
