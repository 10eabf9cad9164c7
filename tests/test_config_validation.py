"""validate_config: every kind of problem, its exact one-line message, and all of them reported together."""
import importlib.util
import textwrap

import pytest
import torch
from omegaconf import OmegaConf

from hybridrl.config import ConfigError, check_paths, compose_config, validate_config, validation
from hybridrl.algorithms.core_algos import ADV_ESTIMATOR_REGISTRY


def problems_for(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        validate_config(compose_config(overrides))
    return caught.value.problems


# ---- types ----

def test_wrong_type_names_key_expected_type_and_value():
    assert problems_for("data.train_batch_size=abc") == ["data.train_batch_size: expected int, got 'abc'"]
    assert problems_for("actor_rollout_ref.actor.optim.lr=fast") == [
        "actor_rollout_ref.actor.optim.lr: expected float, got 'fast'"]
    assert problems_for("trainer.logger=[console,3]") == [
        "trainer.logger: expected a list of (str), got ['console', 3]"]
    assert problems_for("data.train_files=7") == ["data.train_files: expected a list of (str), got 7"]


def test_bools_are_strict():
    assert problems_for("actor_rollout_ref.actor.use_kl_loss=1") == [
        "actor_rollout_ref.actor.use_kl_loss: expected bool, got 1"]
    assert problems_for("actor_rollout_ref.actor.use_kl_loss=yes") == [
        "actor_rollout_ref.actor.use_kl_loss: expected bool, got 'yes'"]
    assert problems_for("actor_rollout_ref.actor.optim.lr=true") == [
        "actor_rollout_ref.actor.optim.lr: expected float, got True"]


def test_ints_and_float_strings_become_floats_and_one_logger_becomes_a_list():
    config = validate_config(compose_config([
        "actor_rollout_ref.actor.optim.lr=1", "critic.optim.lr='3e-5'", "trainer.logger=console",
        "data.train_files=/data/a.parquet"]))
    assert config.actor_rollout_ref.actor.optim.lr == 1.0 and type(config.actor_rollout_ref.actor.optim.lr) is float
    assert config.critic.optim.lr == 3e-5
    assert config.trainer.logger == ["console"]
    assert config.data.train_files == ["/data/a.parquet"]


def test_missing_key_and_unresolvable_interpolation_are_reported():
    assert problems_for("~data.seed") == ["data.seed: expected int, got nothing (key missing)"]
    assert problems_for("data.val_files=${no_such.key}") == [
        "data.val_files: expected a resolvable value, got '${no_such.key}' "
        "(Interpolation key 'no_such.key' not found)"]


# ---- keys and choices ----

def test_unknown_key_suggests_the_close_one():
    assert problems_for("+data.train_batch_sise=32") == [
        "data.train_batch_sise: expected a known key, got unknown key (value 32); did you mean data.train_batch_size?"]
    (problem,) = problems_for("+ray_init.qqq=1")
    assert problem == ("ray_init.qqq: expected a known key, got unknown key (value 1); "
                       "known keys here: address, include_dashboard, node_ip_address, num_cpus, start_timeout_s, "
                       "timeline_json_file")


def test_added_keys_inside_free_form_mappings_are_kept():
    config = validate_config(compose_config([
        "+actor_rollout_ref.model.override_config.attention_dropout=0.1",
        "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=fa3"]))
    assert config.actor_rollout_ref.model.override_config == {"attention_dropout": 0.1}
    assert config.actor_rollout_ref.rollout.engine_kwargs.sglang == {"attention_backend": "fa3"}


def test_bad_choices_list_the_choices():
    assert problems_for("actor_rollout_ref.actor.strategy=deepspeed", "algorithm.kl_ctrl.type=pid",
                        "data.truncation=middle", "trainer.resume_mode=latest") == [
        "data.truncation: expected one of 'error', 'left', 'right', got 'middle'",
        "actor_rollout_ref.actor.strategy: expected one of 'fsdp', 'fsdp2', got 'deepspeed'",
        # ref.strategy is ${actor_rollout_ref.actor.strategy} in the YAML: the message says so.
        "actor_rollout_ref.ref.strategy: expected one of 'fsdp', 'fsdp2', got 'deepspeed' "
        "(value from ${actor_rollout_ref.actor.strategy})",
        "algorithm.kl_ctrl.type: expected one of 'fixed', 'adaptive', got 'pid'",
        "trainer.resume_mode: expected one of 'auto', 'disable', 'resume_path', got 'latest'",
    ]


def test_unregistered_names_show_the_registry():
    (estimator, loss, rollout, manager) = problems_for(
        "algorithm.adv_estimator=gaee", "actor_rollout_ref.actor.policy_loss.loss_mode=ppo",
        "reward_model.reward_manager=nope", "actor_rollout_ref.rollout.name=trt")
    assert estimator.startswith("algorithm.adv_estimator: expected a registered name, got 'gaee' (")
    assert "'gae'" in estimator and "'grpo'" in estimator
    assert loss.startswith("actor_rollout_ref.actor.policy_loss.loss_mode: expected a registered name, got 'ppo' (")
    assert "'vanilla'" in loss
    assert manager.startswith("reward_model.reward_manager: expected a registered name, got 'nope' (")
    assert "'naive'" in manager
    assert rollout.startswith("actor_rollout_ref.rollout.name: expected a registered name, got 'trt' (")
    assert "'hf'" in rollout


def test_unknown_logger_lists_the_valid_ones():
    assert problems_for("trainer.logger=[console,tensorbord]") == [
        "trainer.logger[1]: expected one of ['console', 'jsonl', 'mlflow', 'tensorboard', 'wandb'], got 'tensorbord'"]


def test_extension_file_registers_an_estimator_before_the_registry_check(tmp_path):
    extension = tmp_path / "my_estimator.py"
    extension.write_text(textwrap.dedent("""
        from hybridrl.algorithms.core_algos import register_adv_est

        @register_adv_est("test_config_zero_adv")
        def zero_advantages(token_level_rewards, response_mask):
            return token_level_rewards * 0, token_level_rewards * 0
    """))
    assert problems_for("algorithm.adv_estimator=test_config_zero_adv")[0].startswith(
        "algorithm.adv_estimator: expected a registered name, got 'test_config_zero_adv'")
    overrides = ["algorithm.adv_estimator=test_config_zero_adv", f"extensions=[{extension}]"]
    try:
        config = validate_config(compose_config(overrides))
        config_again = validate_config(compose_config(overrides))  # the file runs once: no "already registered"
        assert config.algorithm.adv_estimator == config_again.algorithm.adv_estimator == "test_config_zero_adv"
        assert ADV_ESTIMATOR_REGISTRY["test_config_zero_adv"].__name__ == "zero_advantages"
        assert config.extensions == [str(extension)]
    finally:
        ADV_ESTIMATOR_REGISTRY.pop("test_config_zero_adv", None)  # other tests list the registry


def test_missing_extension_is_a_config_problem(tmp_path):
    missing = tmp_path / "nothing_here.py"
    assert problems_for(f"extensions=[{missing},hybridrl_no_such_module]") == [
        f"extensions[0]: expected an importable module name or an existing .py file, got '{missing}' "
        f"(FileNotFoundError: extension file {missing} does not exist)",
        "extensions[1]: expected an importable module name or an existing .py file, got 'hybridrl_no_such_module' "
        "(ModuleNotFoundError: No module named 'hybridrl_no_such_module')",
    ]


# ---- ranges ----

def test_ranges():
    assert problems_for("actor_rollout_ref.actor.clip_ratio_c=1.0", "actor_rollout_ref.actor.optim.lr=-1e-6",
                        "actor_rollout_ref.rollout.n=0", "data.val_batch_size=0",
                        "actor_rollout_ref.rollout.gpu_memory_utilization=1.5") == [
        "data.val_batch_size: expected > 0, got 0",
        "actor_rollout_ref.actor.clip_ratio_c: expected > 1, got 1.0",
        "actor_rollout_ref.actor.optim.lr: expected >= 0, got -1e-06",
        "actor_rollout_ref.rollout.n: expected > 0, got 0",
        "actor_rollout_ref.rollout.gpu_memory_utilization: expected in (0, 1], got 1.5",
    ]


# ---- batch sizes: defaults are train 16, mini 8, micro/GPU 4, n 1, 1 node x 2 ranks ----

def test_train_batch_must_be_a_multiple_of_the_mini_batch():
    assert problems_for("data.train_batch_size=12") == [
        "data.train_batch_size: expected a multiple of actor_rollout_ref.actor.ppo_mini_batch_size = 8 "
        "(both count prompts), got 12"]


def test_mini_batch_times_n_and_train_batch_times_n_must_divide_by_world_size():
    assert problems_for("trainer.n_gpus_per_node=3") == [
        "data.train_batch_size: expected train_batch_size * actor_rollout_ref.rollout.n divisible by the world size "
        "trainer.nnodes * trainer.n_gpus_per_node = 1 * 3 = 3, got 16 * 8 = 128",
        "actor_rollout_ref.actor.ppo_mini_batch_size: expected ppo_mini_batch_size * actor_rollout_ref.rollout.n "
        "divisible by the world size trainer.nnodes * trainer.n_gpus_per_node = 1 * 3 = 3, got 8 * 8 = 64",
    ]
    # n=3 makes both divisible: 16*3 = 48 and 8*3 = 24 split over 3 ranks into 8 per rank, 2 micro-batches of 4.
    config = validate_config(compose_config(["trainer.n_gpus_per_node=3", "actor_rollout_ref.rollout.n=3"]))
    assert config.actor_rollout_ref.rollout.n == 3


def test_micro_batch_must_divide_the_per_gpu_mini_batch():
    assert problems_for("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3") == [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: expected a divisor of the per-GPU mini-batch "
        "actor_rollout_ref.actor.ppo_mini_batch_size * actor_rollout_ref.rollout.n / world size = 8 * 8 / 2 = 32, "
        "got 3"]
    # n=3, 2 nodes x 2 ranks: 8 * 3 / 4 = 6 rows per rank, which 4 does not divide.
    assert problems_for("actor_rollout_ref.rollout.n=3", "trainer.nnodes=2")[0].endswith(
        "= 8 * 3 / 4 = 6, got 4")


def test_critic_batches_are_checked_only_when_the_critic_is_on():
    critic_micro = "critic.ppo_micro_batch_size_per_gpu=3"
    assert validate_config(compose_config([critic_micro])).critic.enable is False  # grpo: no critic
    assert problems_for("algorithm=gae", critic_micro) == [
        "critic.ppo_micro_batch_size_per_gpu: expected a divisor of the per-GPU mini-batch "
        "critic.ppo_mini_batch_size * actor_rollout_ref.rollout.n / world size = 8 * 8 / 2 = 32, got 3"]
    assert problems_for(critic_micro, "critic.enable=true")[0].startswith("critic.ppo_micro_batch_size_per_gpu:")
    assert problems_for("algorithm=gae", "critic.enable=false") == [
        "critic.enable: expected true or null when algorithm.adv_estimator='gae' "
        "(GAE needs the critic's values), got False"]


def test_tensor_parallel_size_must_divide_world_size():
    assert problems_for("actor_rollout_ref.rollout.tensor_model_parallel_size=4") == [
        "actor_rollout_ref.rollout.tensor_model_parallel_size: expected a divisor of the world size "
        "trainer.nnodes * trainer.n_gpus_per_node = 2, got 4"]


# ---- keys accepted but not implemented ----

def test_not_implemented_keys_fail_loudly():
    assert problems_for("actor_rollout_ref.actor.ppo_micro_batch_size=16", "algorithm.use_pf_ppo=true") == [
        "algorithm.use_pf_ppo: expected False (other values are not implemented yet), got True",
        "actor_rollout_ref.actor.ppo_micro_batch_size: expected null (deprecated, set "
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu instead), got 16",
    ]


def test_unread_verl_keys_are_refused_naming_the_supported_value():
    assert problems_for("critic.model.fsdp_config.fsdp_size=4",
                        "actor_rollout_ref.ref.fsdp_config.wrap_policy.min_num_params=1000",
                        "actor_rollout_ref.rollout.disable_log_stats=false", "data.return_raw_input_ids=true",
                        "trainer.esi_redundant_time=60", "critic.optim.total_training_steps=100",
                        "critic.model.tokenizer_path=/elsewhere") == [
        "data.return_raw_input_ids: expected False (other values are not implemented yet), got True",
        "actor_rollout_ref.rollout.disable_log_stats: expected True (other values are not implemented yet), got False",
        "critic.model.fsdp_config.fsdp_size: expected -1 (other values are not implemented yet), got 4",
        "actor_rollout_ref.ref.fsdp_config.wrap_policy.min_num_params: expected 0 (other values are not implemented "
        "yet), got 1000",
        "trainer.esi_redundant_time: expected 0 (other values are not implemented yet), got 60.0",
        "critic.optim.total_training_steps: expected -1 (set trainer.total_training_steps instead), got 100",
        "critic.model.tokenizer_path: expected the value of actor_rollout_ref.model.path = "
        f"{validate_config(compose_config([])).actor_rollout_ref.model.path!r} (a different one is not implemented), "
        "got '/elsewhere'",
    ]


def test_verl_names_of_our_keys_give_ours_their_value():
    """validation.ALIASES: verl's key set while ours holds its default gives ours the value; the same value in both
    is fine too; a type error in the copied value names the verl key it came from."""
    data_flow = "algorithm.filter_groups.enable=true"  # data_flow.over_sampling_batch_size acts only in the data flow
    bucket = "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes"
    config = validate_config(compose_config([data_flow, "data.gen_batch_size=48", f"{bucket}=4096"]))
    assert config.data_flow.over_sampling_batch_size == 48
    assert config.actor_rollout_ref.rollout.update_weights_bucket_megabytes == 4096
    config = validate_config(compose_config([data_flow, "data.gen_batch_size=48",
                                             "data_flow.over_sampling_batch_size=48"]))
    assert config.data_flow.over_sampling_batch_size == 48
    assert validate_config(compose_config([])).data_flow.over_sampling_batch_size is None  # verl's key unset
    assert problems_for(f"{bucket}=1.5") == [
        f"{bucket}: expected int or null, got 1.5",
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes: expected int, got 1.5 (value from "
        f"{bucket})"]


def test_verl_name_and_our_key_set_to_different_values_is_refused_naming_both():
    assert problems_for("algorithm.filter_groups.enable=true", "data.gen_batch_size=48",
                        "data_flow.over_sampling_batch_size=32",
                        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096",
                        "actor_rollout_ref.rollout.update_weights_bucket_megabytes=1024") == [
        "data.gen_batch_size: expected null or the value of data_flow.over_sampling_batch_size = 32 (verl's name for "
        "the same setting), got 48",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes: expected null or the value of "
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes = 1024 (verl's name for the same setting), got 4096"]


def test_each_alias_names_our_key_with_its_default():
    """The table's default is what tells 'ours is unset': it must be the YAML's, and verl's key unset by default."""
    defaults = compose_config([])
    for verl_key, (key, default) in validation.ALIASES.items():
        assert OmegaConf.select(defaults, key) == default, key
        assert OmegaConf.select(defaults, verl_key) is None, verl_key


def test_sglang_says_what_it_needs():
    problems = problems_for("actor_rollout_ref.rollout.name=sglang", "trainer.device=cpu")
    needs_gpu = ("actor_rollout_ref.rollout.name: expected 'hf' without a GPU (trainer.device='cpu', "
                 f"CUDA available: {torch.cuda.is_available()}), got 'sglang' (sglang needs a CUDA GPU)")
    if importlib.util.find_spec("sglang") is None:
        assert problems == [
            "actor_rollout_ref.rollout.name: expected a rollout whose engine is installed, got 'sglang' "
            "(the sglang package is not importable: pip install -e '.[gpu]')", needs_gpu]
    else:
        assert problems == [needs_gpu]


def test_sglang_tensor_parallel_engines_run_in_either_rollout_mode_colocated_or_on_the_rollout_pool():
    base = ("actor_rollout_ref.rollout.name=sglang", "trainer.device=cpu",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    assert not any("tensor_model_parallel_size" in problem for problem in problems_for(*base))
    # rollout.mode=async: the group's leader serves its engine (async_server.build_engine_server)
    async_mode = ("actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true")
    assert not any("tensor_model_parallel_size" in problem for problem in problems_for(*base, *async_mode))
    # the rollout pool's own ranks form the groups: tp divides that pool, not the trainer's
    separate = (*base, *async_mode, "actor_rollout_ref.hybrid_engine=false", "trainer.n_gpus_per_node=1")
    assert not any("tensor_model_parallel_size" in problem for problem in problems_for(*separate,
                                                                                       "rollout.n_gpus_per_node=2"))
    assert ("actor_rollout_ref.rollout.tensor_model_parallel_size: expected a divisor of the world size "
            "rollout.nnodes * rollout.n_gpus_per_node = 1, got 2") in problems_for(*separate)
    # the hf rollout generates from the FSDP module itself: nothing to split, tp=2 is accepted
    validate_config(compose_config(["actor_rollout_ref.rollout.tensor_model_parallel_size=2"]))


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_says_what_it_needs(tp):
    problems = problems_for("actor_rollout_ref.rollout.name=vllm", "trainer.device=cpu",
                            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}")
    expected = []
    if importlib.util.find_spec("vllm") is None:
        expected.append("actor_rollout_ref.rollout.name: expected a rollout whose engine is installed, got 'vllm' "
                        "(the vllm package is not importable: pip install -e '.[vllm]'; offline GPU host: "
                        "scripts/gpu/install_vllm.sh)")
    expected.append("actor_rollout_ref.rollout.name: expected 'hf' without a GPU (trainer.device='cpu', "
                    f"CUDA available: {torch.cuda.is_available()}), got 'vllm' (vllm needs a CUDA GPU)")
    assert problems == expected  # tp=2: each rank holds its shard (vllm_rollout.py), accepted in sync mode
    if tp == 2:
        assert ("actor_rollout_ref.rollout.tensor_model_parallel_size: expected 1 with actor_rollout_ref.rollout.name="
                "vllm and actor_rollout_ref.rollout.mode='async' (each rank holds a shard of vLLM's engine and all of "
                "them step together on the same prompts") in " ".join(problems_for(
                    "actor_rollout_ref.rollout.name=vllm", "trainer.device=cpu",
                    "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.mode=async",
                    "data.return_raw_chat=true"))


@pytest.mark.parametrize("engine, key, instead", [
    ("vllm", "gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    ("sglang", "mem_fraction_static", "rollout.gpu_memory_utilization")])
def test_engine_kwargs_that_a_rollout_key_sets_are_refused_up_front(engine, key, instead):
    problems = problems_for(f"actor_rollout_ref.rollout.name={engine}", "trainer.device=cpu",
                            f"+actor_rollout_ref.rollout.engine_kwargs.{engine}.{key}=0.9",
                            f"+actor_rollout_ref.rollout.engine_kwargs.{engine}.enforce_eager_extra=1")
    assert (f"actor_rollout_ref.rollout.engine_kwargs.{engine}.{key}: expected to be unset (set it through "
            f"{instead}), got 0.9") in problems
    assert not any("enforce_eager_extra" in problem for problem in problems)  # an engine's own argument passes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda():
    assert problems_for("trainer.device=cuda") == [
        "trainer.device: expected 'cpu' or 'auto' on this machine (torch sees no CUDA GPU), got 'cuda'"]
    # A driver joining a cluster may have no GPU itself: the trainer checks the cluster instead.
    assert validate_config(compose_config(["trainer.device=cuda", "ray_init.address=auto"])).trainer.device == "cuda"


def test_resume_path_mode_needs_a_path():
    assert problems_for("trainer.resume_mode=resume_path") == [
        "trainer.resume_from_path: expected a checkpoint directory when trainer.resume_mode='resume_path', got None"]


def test_num_cpus_only_for_a_local_ray():
    assert problems_for("ray_init.address=auto", "ray_init.num_cpus=4") == [
        "ray_init.num_cpus: expected null when ray_init.address is set (a running cluster declares its own CPUs), "
        "got 4"]



def test_node_ip_address_only_for_a_local_ray():
    assert problems_for("ray_init.address=10.0.0.5:6379", "ray_init.node_ip_address=10.0.0.7") == [
        "ray_init.node_ip_address: expected null when ray_init.address is set (the nodes of a running cluster have "
        "their own addresses), got '10.0.0.7'"]
    assert validate_config(compose_config(["ray_init.node_ip_address=10.0.0.7"])).ray_init.node_ip_address == \
        "10.0.0.7"


def test_dashboard_and_start_timeout_only_for_a_local_ray():
    assert problems_for("ray_init.address=auto", "ray_init.include_dashboard=true",
                        "ray_init.start_timeout_s=300") == [
        "ray_init.include_dashboard: expected false when ray_init.address is set (a running cluster has its own "
        "dashboard or none), got True",
        "ray_init.start_timeout_s: expected null when ray_init.address is set (it bounds the start of a local Ray; "
        "a running cluster is joined at once), got 300"]
    local = validate_config(compose_config(["ray_init.include_dashboard=true", "ray_init.start_timeout_s=300"]))
    assert (local.ray_init.include_dashboard, local.ray_init.start_timeout_s) == (True, 300)
    assert validate_config(compose_config()).ray_init.start_timeout_s is None  # local_cluster's default


@pytest.mark.parametrize("value", [0, -5])
def test_start_timeout_must_be_positive(value):
    assert problems_for(f"ray_init.start_timeout_s={value}") == [
        f"ray_init.start_timeout_s: expected > 0, got {float(value)}"]


def test_heartbeat_timeout_spans_missed_heartbeats():
    assert problems_for("trainer.heartbeat_interval=10", "trainer.heartbeat_timeout=15") == [
        "trainer.heartbeat_timeout: expected at least 2 * trainer.heartbeat_interval = 20 (a rank is silent only "
        "after missing heartbeats), got 15"]
    assert problems_for("trainer.heartbeat_interval=0", "trainer.worker_call_timeout=-1",
                        "reward_model.score_timeout=0", "trainer.stop_on_signal=later") == [
        "reward_model.score_timeout: expected > 0, got 0.0",
        "trainer.worker_call_timeout: expected > 0, got -1.0",
        "trainer.heartbeat_interval: expected > 0, got 0.0",
        "trainer.stop_on_signal: expected one of 'after_step', 'now', got 'later'"]

# ---- everything at once ----

def test_every_problem_is_reported_in_one_error():
    with pytest.raises(ConfigError) as caught:
        validate_config(compose_config([
            "data.train_batch_size=12", "+trainer.nnode=2", "actor_rollout_ref.actor.use_kl_loss=maybe",
            "algorithm.kl_penalty=k9", "trainer.del_local_ckpt_after_load=true"]))
    assert caught.value.problems == [
        "actor_rollout_ref.actor.use_kl_loss: expected bool, got 'maybe'",
        "algorithm.kl_penalty: expected one of 'kl', 'k1', 'abs', 'mse', 'k2', 'low_var_kl', 'k3', 'kl+', 'k1+', "
        "'abs+', 'mse+', 'k2+', 'low_var_kl+', 'k3+', got 'k9'",
        "trainer.nnode: expected a known key, got unknown key (value 2); did you mean trainer.nnodes?",
        "trainer.del_local_ckpt_after_load: expected False (other values are not implemented yet), got True",
        "data.train_batch_size: expected a multiple of actor_rollout_ref.actor.ppo_mini_batch_size = 8 "
        "(both count prompts), got 12",
    ]
    assert str(caught.value).splitlines() == ["5 config problem(s):", *caught.value.problems]
    assert isinstance(caught.value, ValueError)


# ---- files ----

def test_check_paths_names_every_missing_or_wrong_file(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    train = tmp_path / "train.parquet"
    train.write_bytes(b"PAR1")
    val_csv = tmp_path / "val.csv"
    val_csv.write_text("a,b\n")
    good = [f"data.train_files={train}", f"actor_rollout_ref.model.path={model_dir}"]
    check_paths(validate_config(compose_config([*good, f"data.val_files={train}", "algorithm=gae"])))

    with pytest.raises(ConfigError) as caught:
        check_paths(validate_config(compose_config([
            *good, f"data.val_files=[{train},{val_csv}]", f"critic.model.path={tmp_path}",
            f"custom_reward_function.path={tmp_path / 'score.py'}", "algorithm=gae"])))
    assert caught.value.problems == [
        f"data.val_files[1]: expected a .parquet file, got '{val_csv}'",
        f"critic.model.path: expected a local model directory containing config.json, got '{tmp_path}'",
        f"custom_reward_function.path: expected an existing .py file, got '{tmp_path / 'score.py'}' (no such file)",
    ]


def test_async_rollout_mode_and_its_requirements():
    assert problems_for("actor_rollout_ref.rollout.mode=remote")[0].startswith("actor_rollout_ref.rollout.mode:")
    found = problems_for("actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.actor.strategy=fsdp",
                         "actor_rollout_ref.rollout.custom_cls.path=x.py", "actor_rollout_ref.rollout.custom_cls.name=X",
                         "actor_rollout_ref.rollout.agent.max_failed_sample_ratio=1.5",
                         "actor_rollout_ref.rollout.agent.num_workers=0")
    assert any(p.startswith("data.return_raw_chat: expected true with actor_rollout_ref.rollout.mode='async'")
               for p in found), found
    assert any(p.startswith("actor_rollout_ref.rollout.custom_cls: expected null") for p in found), found
    assert any(p.startswith("actor_rollout_ref.actor.strategy: expected 'fsdp2'") for p in found), found
    assert any(p.startswith("actor_rollout_ref.rollout.agent.max_failed_sample_ratio:") for p in found), found
    assert any(p.startswith("actor_rollout_ref.rollout.agent.num_workers:") for p in found), found
    config = validate_config(compose_config(["actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true"]))
    assert config.actor_rollout_ref.rollout.agent.default_agent_loop == "single_turn_agent"


def test_validation_refuses_to_run_without_the_subsystems_checks(monkeypatch):
    """Nothing is silently skipped: before hybridrl.checks registers the subsystems' rules, the drivers raise."""
    from hybridrl.config import checks

    monkeypatch.setattr(checks, "_complete", False)
    with pytest.raises(RuntimeError, match="import hybridrl.checks"):
        validate_config(compose_config())
