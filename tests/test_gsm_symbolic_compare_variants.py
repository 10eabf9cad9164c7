"""compare.sh's variants as main_ppo receives them on the GPU host: `compare.sh VARIANT 1` runs for real (compare.sh ->
run.sh -> exec python -m hybridrl.main_ppo) with a `python` first on PATH that records main_ppo's arguments instead of
training (run_compare_sh). Those arguments compose and validate under hybridrl's config, with the CPU in place of what
this machine lacks (SGLang on a GPU), and each variant differs from `current` in exactly the keys it names. A variant
the trainer would refuse is caught here, not at the start of a lease's queue (issue 60's seeds cost device time)."""
import dataclasses
import functools
import re
import subprocess
from pathlib import Path

import pytest

import hybridrl.checks  # noqa: F401  (registers every subsystem's config checks)
from hybridrl.config import compose_config, validate_config
from hybridrl.trainer.tracking import flatten
from tests.test_gsm_symbolic_verl_compare import RECIPE, run_compare_sh

# What smoke_cpu.sh also changes to run the recipe here: the HF rollout on the CPU, no varlen kernel
ON_THIS_MACHINE = ["trainer.device=cpu", "actor_rollout_ref.rollout.name=hf",
                   "actor_rollout_ref.model.use_remove_padding=false"]
# Each variant's difference from `current`, the keys of the validated config and their values (README.md's table);
# vs_verl's is verl_compare.py's table, which tests/test_gsm_symbolic_verl_compare.py checks row by row
VARIANTS = {
    "current": {},
    "dr_grpo": {"algorithm.norm_adv_by_std_in_grpo": False},
    "no_format_credit": {"custom_reward_function.name": "compute_score_no_format_credit"},
    "dr_grpo_no_format_credit": {"algorithm.norm_adv_by_std_in_grpo": False,
                                 "custom_reward_function.name": "compute_score_no_format_credit"},
    "clip_higher": {"actor_rollout_ref.actor.clip_ratio_high": 0.28},
    "overlong": {"reward_model.reward_manager": "dapo", "reward_model.overlong_buffer.enable": True,
                 "reward_model.overlong_buffer.len": 128, "reward_model.overlong_buffer.penalty_factor": 1.0,
                 "reward_model.overlong_buffer.log": True},
    "vs_verl": None,
}
RUN_KEYS = {"trainer.experiment_name", "trainer.default_local_dir", "trainer.validation_data_dir"}  # the seed's own


def validated(argv: list[str]) -> dict:
    """The validated config as {dotted key: value}."""
    return flatten(dataclasses.asdict(validate_config(compose_config(argv + ON_THIS_MACHINE))))


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> Path:
    """One work directory for every variant, as on the host."""
    return tmp_path_factory.mktemp("host")


@pytest.fixture(scope="module")
def argv_of(host):
    """main_ppo's argv for `compare.sh VARIANT 1` at 0.5B, run once a variant and kept for every test here."""
    return functools.cache(lambda variant: run_compare_sh(host, variant))


@pytest.fixture(scope="module")
def current(argv_of) -> dict:
    return validated(argv_of("current"))


def test_the_table_here_names_every_variant_compare_sh_knows():
    refused = subprocess.run(["bash", str(RECIPE / "compare.sh"), "no_such_variant", "--check"], capture_output=True,
                             text=True)
    assert refused.returncode == 2
    known = re.search(r"expected (.*)", refused.stderr).group(1)
    assert sorted(re.findall(r"\w+", known.replace(" or ", ", "))) == sorted(VARIANTS), refused.stderr


@pytest.mark.parametrize("variant", [name for name, keys in VARIANTS.items() if keys is not None])
def test_each_variant_validates_and_changes_exactly_the_keys_it_names(host, argv_of, current, variant):
    config = validated(argv_of(variant))
    changed = {key: config[key] for key in config if config[key] != current[key] and key not in RUN_KEYS}
    assert changed == VARIANTS[variant]
    assert config["trainer.experiment_name"] == f"{variant}_0.5b_seed1"
    assert config["trainer.default_local_dir"] == str(host / "work" / "compare" / f"0.5b_{variant}_seed1")


def test_vs_verl_validates_with_the_settings_verl_gets(argv_of, current):
    config = validated(argv_of("vs_verl"))
    assert config["actor_rollout_ref.model.use_fused_kernels"] is True  # one of verl_compare.py's rows
    assert config["custom_reward_function.name"] == current["custom_reward_function.name"]  # current's scoring


def test_a_variant_at_1_5b_carries_the_memory_settings_the_larger_model_needs(host, current):
    config = validated(run_compare_sh(host, "no_format_credit", model="1.5b"))
    changed = {key: config[key] for key in config if config[key] != current[key] and key not in RUN_KEYS}
    model = str(host / "work" / "qwen2.5-coder-1.5b-instruct")
    named = {"custom_reward_function.name": "compute_score_no_format_credit", "actor_rollout_ref.model.path": model,
             "actor_rollout_ref.model.use_fused_kernels": True,
             "actor_rollout_ref.model.enable_gradient_checkpointing": True,
             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 8192}
    assert {key: changed.get(key) for key in named} == named
    # the rest follow the model's path and the token budget by interpolation (the critic's and ref's keys)
    assert {key: value for key, value in changed.items() if key not in named} == {
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": 8192,
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 8192, "critic.model.path": model,
        "critic.model.tokenizer_path": model, "reward_model.model.input_tokenizer": model}


def test_every_variant_names_the_shipped_scoring_itself_so_run_sh_can_take_the_winner(argv_of, current):
    """compare.sh passes the scoring the comparison started from (0.01 for a wrong `#### N`, GRPO's std
    normalisation) first among its own overrides, not leaving it to run.sh's defaults: once the winner is run.sh's
    default, the seeds still to run of `current`, `clip_higher` and `overlong` keep meaning what their records say."""
    assert (current["custom_reward_function.name"], current["algorithm.norm_adv_by_std_in_grpo"]) == \
        ("compute_score", True)
    for variant in VARIANTS:
        argv = argv_of(variant)
        own = argv[argv.index(f"trainer.experiment_name={variant}_0.5b_seed1") + 1:]
        assert own[:2] == ["custom_reward_function.name=compute_score", "algorithm.norm_adv_by_std_in_grpo=true"]
