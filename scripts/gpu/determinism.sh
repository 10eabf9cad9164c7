#!/usr/bin/env bash
# Issue 62 on one GPU, from the repository root: the determinism gate, then what the keys cost.
#   1. tests/gpu/test_determinism_gpu.py: sglang and vllm x single-turn and tool loop, two 5-step runs each,
#      every metric compared bit for bit (pytest's output in OUT_DIR/gate.log, its JUnit XML in OUT_DIR/gate.xml);
#   2. benchmarks/ppo_step.py --vary actor_rollout_ref.rollout.full_determinism=false,true: the 0.5B shape (random
#      bf16 weights, the toy task's vocabulary and data: tests/gpu/tiny_gpu.py) run off, on, on, off (A B B A), 4 steps
#      each, per engine; records OUT_DIR/cost_sglang.json and OUT_DIR/cost_vllm.json (the `vary` entry holds the
#      step and generation seconds of each side and their ratio). The rollout key alone turns on deterministic torch
#      kernels too: the actor, reference and rollout share the colocated process (workers/actor_rollout_ref.py).
#
#   bash scripts/gpu/determinism.sh [OUT_DIR]        # OUT_DIR: $OUT, else /tmp/determinism
#
# It takes longer than one 10-minute call on the GPU host: start it detached and wait on it (scripts/gpu/detached.sh),
#   bash scripts/gpu/detached.sh start det bash scripts/gpu/determinism.sh /tmp/determinism
#   bash scripts/gpu/detached.sh wait det 570       # again until it has ended, then: cp -r /tmp/determinism "$OUT"/
# GATE_K=EXPR runs only the gate cases pytest's -k selects (e.g. "sglang and single_turn or vllm"); ENGINES="vllm"
# measures only that engine's cost. TOOL_TASK_CACHE=DIR takes the tool task prepared on a CPU (saves 3-4 minutes):
#   python -c "from hybridrl.defaults.tool_task import prepare_tool_task; prepare_tool_task('.stage/tool_cache')"
# Needs the gpu extra (sglang) and vLLM (scripts/gpu/install_vllm.sh); an engine that is not installed is skipped by
# the gate and its cost run fails at its first step (its record says so).
set -uo pipefail
out=${1:-${OUT:-/tmp/determinism}}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

python -m pytest tests/gpu/test_determinism_gpu.py -q -s -p no:cacheprovider -n 0 ${GATE_K:+-k "$GATE_K"} --junitxml "$out/gate.xml" \
    > "$out/gate.log" 2>&1
echo "gate: exit $? (log $out/gate.log)"

toy=$out/toy
mkdir -p "$toy"
python -c "import sys; sys.path.insert(0, 'tests/gpu'); from tiny_gpu import write_toy_task; write_toy_task('$toy')"
cp "$toy/val.parquet" "$toy/test.parquet"  # ppo_step.py reads DIR/train.parquet and DIR/test.parquet
for engine in ${ENGINES:-sglang vllm}; do
    python benchmarks/ppo_step.py --data-dir "$toy" --tokenizer "$toy/model" --shape 0.5b --gpus 1 \
        --layouts "rmpad32k@$engine" --steps 4 --prompts 64 --n 8 --response-length 256 --no-standalone \
        --deadline 0 --work-dir "$out/work_$engine" --out "$out/cost_$engine.json" \
        --vary actor_rollout_ref.rollout.full_determinism=false,true \
        "custom_reward_function.path=$toy/reward.py" custom_reward_function.name=share_of_a \
        data.max_prompt_length=32 > "$out/cost_$engine.log" 2>&1
    echo "cost $engine: exit $? (log $out/cost_$engine.log)"
done
