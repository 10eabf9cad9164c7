#!/usr/bin/env bash
# Issue 60's comparison: run.sh with one variant's overrides, its seeds one after the other (README.md, "Choosing the
# default: the comparison to run").
#
#   bash recipes/qwen25_coder_gsm_symbolic/compare.sh VARIANT [SEED...]     # seeds 1 2 3 unless given
#   bash recipes/qwen25_coder_gsm_symbolic/compare.sh VARIANT --check       # exit 0 for a known VARIANT, 2 if not
#
# VARIANT (each is run.sh plus SHIPPED, then these Hydra overrides):
#   current           none: SHIPPED, the 0.01 for a wrong number in the format, GRPO's std normalisation
#   dr_grpo           algorithm.norm_adv_by_std_in_grpo=false (Dr. GRPO: no division by the group's std)
#   no_format_credit  custom_reward_function.name=compute_score_no_format_credit (a wrong number scores 0, verl's GSM8K)
#   dr_grpo_no_format_credit  both of the above: the two that each took no shortcut on 1,024 held-out questions
#   clip_higher       actor_rollout_ref.actor.clip_ratio_high=0.28 (DAPO's clip-higher)
#   overlong          DAPO's overlong penalty over the last 128 of the 512 response tokens (reward manager dapo)
#   vs_verl           current with benchmarks/vs_verl.py's layout, kernels and engine settings where run.sh leaves
#                     them to hybridrl (`verl_compare.py --hybridrl-overrides` prints them from vs_verl_settings.py's
#                     table), the rows verl_compare.py gives verl: both trainers run the same settings (issue 59).
#                     MODEL=0.5b only (verl_compare.py's workload)
# Environment: MODEL and WORK_DIR as run.sh; each seed's logs go to $WORK_DIR/compare/<MODEL>_<VARIANT>_seed<SEED>,
# with its validations' answers packed into val_generations.tgz there.
# A seed that fails is reported and the next one runs; the exit status is 1 if any failed.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VARIANT=${1:?VARIANT: current, dr_grpo, no_format_credit, dr_grpo_no_format_credit, clip_higher, overlong or vs_verl}
shift
SEEDS=("$@")
[ ${#SEEDS[@]} -gt 0 ] || SEEDS=(1 2 3)
# The scoring run.sh shipped with before issue 60 chose its default, named here and not left to run.sh, so that every
# variant means the same once the winner is run.sh's default (the seeds still to run would otherwise change meaning)
SHIPPED=(custom_reward_function.name=compute_score algorithm.norm_adv_by_std_in_grpo=true)
case "$VARIANT" in
    current) OVERRIDES=() ;;
    dr_grpo) OVERRIDES=(algorithm.norm_adv_by_std_in_grpo=false) ;;
    no_format_credit) OVERRIDES=(custom_reward_function.name=compute_score_no_format_credit) ;;
    dr_grpo_no_format_credit) OVERRIDES=(algorithm.norm_adv_by_std_in_grpo=false
                                         custom_reward_function.name=compute_score_no_format_credit) ;;
    clip_higher) OVERRIDES=(actor_rollout_ref.actor.clip_ratio_high=0.28) ;;
    overlong) OVERRIDES=(reward_model.reward_manager=dapo reward_model.overlong_buffer.enable=true
                         reward_model.overlong_buffer.len=128 reward_model.overlong_buffer.penalty_factor=1.0
                         reward_model.overlong_buffer.log=true) ;;
    vs_verl) [ "${MODEL:-0.5b}" = 0.5b ] || { echo "VARIANT=vs_verl: expected MODEL=0.5b, got $MODEL" >&2; exit 2; }
             VS_VERL=$(python "$HERE/verl_compare.py" --hybridrl-overrides) || exit 2
             mapfile -t OVERRIDES <<< "$VS_VERL" ;;
    *) echo "VARIANT=$VARIANT: expected current, dr_grpo, no_format_credit, dr_grpo_no_format_credit, clip_higher," \
            "overlong or vs_verl" >&2
       exit 2 ;;
esac
OVERRIDES=("${SHIPPED[@]}" ${OVERRIDES[@]+"${OVERRIDES[@]}"})
[ "${SEEDS[0]}" = --check ] && exit 0
MODEL=${MODEL:-0.5b}
WORK_DIR=${WORK_DIR:-/tmp/qwen25_coder_gsm_symbolic}
failed=0
for seed in "${SEEDS[@]}"; do
    run_dir=$WORK_DIR/compare/${MODEL}_${VARIANT}_seed$seed
    echo "== $VARIANT, MODEL=$MODEL, SEED=$seed: $run_dir (started $(date -u +%T) UTC)"
    began=$SECONDS
    MODEL=$MODEL SEED=$seed WORK_DIR=$WORK_DIR RUN_DIR=$run_dir bash "$HERE/run.sh" \
        trainer.experiment_name="${VARIANT}_${MODEL}_seed$seed" "${OVERRIDES[@]}" \
        || { echo "== $VARIANT seed $seed failed" >&2; failed=1; }
    # every answer of every validation in one file to copy back, so any metric can be recomputed later
    if [ -d "$run_dir/val_generations" ]; then
        tar czf "$run_dir/val_generations.tgz" -C "$run_dir" val_generations \
            || { echo "== $VARIANT seed $seed: its answers were not packed" >&2; failed=1; }
    fi
    # the seed's whole time, which a lease is planned by: summary.json's wall_s is main_ppo's fit alone, so the rest
    # is the data, the first seed's model conversion, start-up and shut-down
    echo "== $VARIANT seed $seed: $((SECONDS - began)) s in all, ended $(date -u +%T) UTC"
done
exit $failed
