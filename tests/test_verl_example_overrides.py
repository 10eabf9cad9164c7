"""verl's own override lists for DAPO, GSPO, CISPO and Dr. GRPO, pasted as a user would, train 2 steps here on the CPU in
the default rollout.mode (issue #57, item 4).

Each list below is verl's, key for key, as its script passes it (shell variables expanded to the script's GPU
defaults; the source path and commit are named above each). Only two kinds of change are made, each listed with its
reason in PATHS or the case's `replaced`: the data, model and reward paths become the toy task's (tests/toy_task.py; a
tiny random Qwen2), and keys a 2-core CPU machine cannot honour (engine, device counts, batch sizes and lengths shrunk
to a tiny model in seconds, logging without network) take CPU values. Keys we accept are not dropped, and no key is
added but the reward, the run directory, the step count and (DAPO) the local Ray's CPUs; not rollout.mode: the DAPO
list turns on algorithm.filter_groups, whose data flow every step takes in either mode (data/route.py: in hybridrl's
default rollout.mode=sync the colocated engines' batched call generates its groups, in verl's default async the agent
loops). No key is left out, and only DAPO's run differs in size: its ulysses_sequence_parallel_size=4 groups 4 ranks,
so it runs on 4 CPU ranks (the local Ray's 4 logical CPUs, named by ray_init.num_cpus on a 2-core machine) with a
tiny model whose 4 attention and 4 key/value heads a group of 4 splits. Its run took 49 s (+7 s set-up) on the 2-core
machine at a load average of 3-5, 109 s at 13-15, and did not finish within the test's 5 minutes near 30
(2026-12-06). Its entropy_checkpointing and entropy_from_logits_with_chunking run as pasted.
"""
from dataclasses import dataclass, field

import pytest
import torch
from hydra.errors import HydraException
from transformers import AutoTokenizer

from hybridrl.config import ConfigError, check_before_start, compose_config, validate_config
from hybridrl.config.cli_errors import describe_hydra_error
from hybridrl.defaults.tiny_model import build_tiny_model
from test_async_rollout import fit_keeping_update_batches
from test_e2e_training import read_metrics

# verl-project/verl-recipe dapo/run_dapo_qwen2.5_7b_npu.sh @ e800faafc28ce6d2ea9b7f24db2bdeb06c43b83a (2026; the
# DAPO recipe with dynamic sampling, run by `python -m recipe.dapo.main_dapo`, whose keys are main_ppo's)
DAPO = [
    "data.train_files=/home/user/verl/data/dapo-math-17k.parquet",
    "data.val_files=/home/user/verl/data/aime-2024.parquet",
    "data.prompt_key=prompt",
    "data.truncation='left'",
    "data.max_prompt_length=2048",
    "data.max_response_length=20480",
    "data.gen_batch_size=48",
    "data.train_batch_size=16",
    "actor_rollout_ref.rollout.n=16",
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=False",
    "algorithm.kl_ctrl.kl_coef=0.0",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.kl_loss_coef=0.0",
    "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.actor.clip_ratio_c=10.0",
    "algorithm.filter_groups.enable=True",
    "algorithm.filter_groups.max_num_gen_batches=10",
    "algorithm.filter_groups.metric=acc",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
    "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=5632",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=5632",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=5632",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096",
    "actor_rollout_ref.model.path=/home/user/verl/models/Qwen2.5-7B-Instruct",
    "+actor_rollout_ref.model.override_config.attention_dropout=0.",
    "+actor_rollout_ref.model.override_config.embd_pdrop=0.",
    "+actor_rollout_ref.model.override_config.resid_pdrop=0.",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
    "actor_rollout_ref.actor.optim.weight_decay=0.1",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.grad_clip=1.0",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.50",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.enable_chunked_prefill=True",
    "actor_rollout_ref.rollout.max_num_batched_tokens=22528",
    "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.top_p=1.0",
    "actor_rollout_ref.rollout.top_k=-1",
    "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    "actor_rollout_ref.rollout.val_kwargs.top_p=1.0",
    "actor_rollout_ref.rollout.val_kwargs.top_k=-1",
    "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
    "actor_rollout_ref.rollout.val_kwargs.n=1",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size=4",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1",
    "reward_model.reward_manager=dapo",
    "+reward_model.overlong_buffer.enable=True",
    "+reward_model.overlong_buffer.len=4096",
    "+reward_model.overlong_buffer.penalty_factor=1.0",
    "+reward_model.reward_kwargs.max_resp_len=20480",
    "trainer.logger=['console']",
    "trainer.project_name=DAPO-Qwen2.5-7B-Instruct",
    "trainer.experiment_name=DAPO-Qwen2.5-7B-Instruct",
    "trainer.n_gpus_per_node=16",
    "trainer.nnodes=1",
    "trainer.val_before_train=True",
    "trainer.test_freq=5",
    "trainer.save_freq=20",
    "trainer.total_epochs=1",
    "trainer.default_local_dir=/home/user/verl/ckpts/DAPO-Qwen2.5-7B-Instruct/DAPO-Qwen2.5-7B-Instruct",
    "trainer.resume_mode=auto",
    "trainer.device=npu",
    "actor_rollout_ref.actor.entropy_checkpointing=True",
    "actor_rollout_ref.ref.entropy_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.forward_prefetch=True",
    "actor_rollout_ref.ref.fsdp_config.forward_prefetch=True",
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking=True",
    "actor_rollout_ref.ref.entropy_from_logits_with_chunking=True",
]

# verl-project/verl examples/gspo_trainer/run_qwen3_8b_fsdp.sh @ 08aef7ff7419d6cb6cf324a2113a7f2b67786abe (DEVICE=gpu)
GSPO = [
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=False",
    "data.train_files=['/home/user/data/gsm8k/train.parquet', '/home/user/data/math/train.parquet']",
    "data.val_files=['/home/user/data/gsm8k/test.parquet', '/home/user/data/math/test.parquet']",
    "data.train_batch_size=512",
    "data.max_prompt_length=2048",
    "data.max_response_length=8192",
    "data.filter_overlong_prompts=True",
    "data.truncation='error'",
    "actor_rollout_ref.model.path=Qwen/Qwen3-8B",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    "actor_rollout_ref.actor.clip_ratio_low=3e-4",
    "actor_rollout_ref.actor.clip_ratio_high=4e-4",
    "actor_rollout_ref.actor.clip_ratio_c=10.0",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=128",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=16",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=20480",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=20480",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "trainer.balance_batch=True",
    "trainer.critic_warmup=0",
    "trainer.logger=[\"console\",\"wandb\"]",
    "trainer.project_name=verl_gspo_gsm8k_math",
    "trainer.experiment_name=qwen3_8b_vllm_fsdp",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=10",
    "trainer.total_epochs=10",
]

# verl-project/verl examples/cispo_trainer/run_qwen3_8b_fsdp.sh @ 08aef7ff7419d6cb6cf324a2113a7f2b67786abe
CISPO = [
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=False",
    "data.train_files=['/home/user/data/gsm8k/train.parquet', '/home/user/data/math/train.parquet']",
    "data.val_files=['/home/user/data/gsm8k/test.parquet', '/home/user/data/math/test.parquet']",
    "data.train_batch_size=1024",
    "data.max_prompt_length=1024",
    "data.max_response_length=2048",
    "data.filter_overlong_prompts=True",
    "data.truncation='error'",
    "actor_rollout_ref.model.path=Qwen/Qwen3-8B",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.policy_loss.loss_mode=cispo",
    "actor_rollout_ref.actor.clip_ratio_low=10",
    "actor_rollout_ref.actor.clip_ratio_high=0.2",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "trainer.balance_batch=True",
    "trainer.critic_warmup=0",
    "trainer.logger=[\"console\",\"wandb\"]",
    "trainer.project_name=verl_cispo_gsm8k_math",
    "trainer.experiment_name=qwen3_8b_vllm_fsdp",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
]

# Dr. GRPO: verl-project/verl docs/algo/grpo.md @ 62b8e0829ee62fb19c32425d1542f89e68664cac ("DrGRPO": these keys,
# "with all other parameters the same as GRPO's") on verl's GRPO example examples/grpo_trainer/run_qwen3_8b_fsdp.sh
# @ 08aef7ff7419d6cb6cf324a2113a7f2b67786abe (DEVICE=gpu, INFER_BACKEND=vllm), its use_kl_loss=True set to False as
# the page says.
DR_GRPO = [
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=False",
    "data.train_files=['/home/user/data/gsm8k/train.parquet', '/home/user/data/math/train.parquet']",
    "data.val_files=['/home/user/data/gsm8k/test.parquet', '/home/user/data/math/test.parquet']",
    "data.train_batch_size=1024",
    "data.max_prompt_length=1024",
    "data.max_response_length=2048",
    "data.filter_overlong_prompts=True",
    "data.truncation='error'",
    "actor_rollout_ref.model.path=Qwen/Qwen3-8B",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "trainer.balance_batch=True",
    "trainer.logger=[\"console\",\"wandb\"]",
    "trainer.project_name=verl_grpo_gsm8k_math",
    "trainer.experiment_name=qwen3_8b_grpo_vllm_fsdp",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
    "algorithm.norm_adv_by_std_in_grpo=False",
]

# The toy task's reward in the form verl's DAPO scorer (math_dapo) returns: a score and its `acc`, the extra that
# algorithm.filter_groups.metric=acc reads.
REWARD_FILE = '''
def share_of_a(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str.replace(" ", "")
    share = text.count("a") / max(len(text), 1)
    return {"score": share, "acc": share}
'''

TINY = "a tiny model in seconds on 2 CPU cores"
# Replacements every list gets: key -> (value, reason). "{...}" values are filled in per run.
PATHS = {
    "data.train_files": ("{train}", "the toy task's data"),
    "data.val_files": ("{val}", "the toy task's data"),
    "actor_rollout_ref.model.path": ("{model}", "the toy task's tiny random Qwen2"),
    "custom_reward_function.path": ("{reward}", "the toy task's reward (its data_source has no built-in scorer)"),
    "custom_reward_function.name": ("share_of_a", "the toy task's reward"),
    "trainer.default_local_dir": ("{run_dir}", "the test's run directory"),
    "trainer.logger": ("[console,jsonl]", "no network for wandb; the test reads metrics.jsonl"),
    "trainer.total_training_steps": ("2", "2 steps"),
    "actor_rollout_ref.rollout.name": ("hf", "vLLM needs a CUDA GPU"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ("1", "the hf engine is not tensor-parallel"),
    "trainer.n_gpus_per_node": ("2", "2 CPU ranks"),
    "data.max_prompt_length": ("32", TINY),
    "data.max_response_length": ("8", TINY),
    "data.train_batch_size": ("4", TINY),
}
SMALLER_MINI_BATCH = {"actor_rollout_ref.actor.ppo_mini_batch_size": ("2", "within data.train_batch_size=4")}


@dataclass
class Case:
    pasted: list[str]
    replaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # key -> (value, reason), beyond PATHS


CASES = {
    "dapo": Case(DAPO, replaced={
        "trainer.device": ("cpu", "no NPU"),
        "actor_rollout_ref.rollout.n": ("4", TINY),
        "data.gen_batch_size": ("6", TINY),
        "+reward_model.overlong_buffer.len": ("4", "within the response budget of 8"),
        "+reward_model.reward_kwargs.max_resp_len": ("8", "data.max_response_length's value, as in the list"),
        "trainer.n_gpus_per_node": ("4", "4 CPU ranks: ulysses_sequence_parallel_size=4 groups 4 ranks"),
        "ray_init.num_cpus": ("4", "the 4 ranks' CPUs on a 2-core machine (the tests' local Ray has 4 logical CPUs)"),
        "actor_rollout_ref.model.path": ("{model_4_heads}", "the toy task's tokenizer in a tiny random Qwen2 with 4 "
                                         "attention and 4 key/value heads, which groups of 4 split (the toy model "
                                         "has 2 and 1)"),
    }),
    "gspo": Case(GSPO, replaced=SMALLER_MINI_BATCH),
    "cispo": Case(CISPO, replaced=SMALLER_MINI_BATCH),
    "dr_grpo": Case(DR_GRPO, replaced=SMALLER_MINI_BATCH),
}


def key_of(override: str) -> str:
    return override.split("=", 1)[0]


def runnable(case: Case, values: dict[str, str]) -> list[str]:
    """The pasted list as the run takes it: each replaced key's value swapped (its '+' kept; a key the list lacks is
    appended)."""
    replaced = {**PATHS, **case.replaced}
    overrides = []
    for override in case.pasted:
        key = key_of(override)
        if key in replaced:
            value = replaced.pop(key)[0]
            overrides.append(f"{key}={value.format(**values)}")
        else:
            overrides.append(override)
    overrides += [f"{key}={value.format(**values)}" for key, (value, _) in replaced.items()]
    return overrides


def config_errors(overrides: list[str]) -> list[str]:
    """What a user sees for `overrides` before anything starts: Hydra's composition error as the entry point words it,
    or the config checks' problems; [] when the config is valid."""
    try:
        validate_config(compose_config(overrides))
    except HydraException as err:
        return [describe_hydra_error(err, overrides)]
    except ConfigError as err:
        return list(err.problems)
    return []


@pytest.fixture
def toy_values(toy_task, tmp_path):
    reward = tmp_path / "dapo_reward.py"
    reward.write_text(REWARD_FILE)
    model_4_heads = build_tiny_model(str(tmp_path / "model_4_heads"), AutoTokenizer.from_pretrained(toy_task["model"]),
                                     hidden_size=32, num_heads=4, num_kv_heads=4, intermediate_size=64)
    return {**toy_task, "reward": str(reward), "run_dir": str(tmp_path / "run"), "model_4_heads": model_4_heads}


def test_every_replacement_names_a_pasted_key_or_says_why_it_is_added():
    """A replacement table that drifted from its list (a key verl's list does not have, unless it is one every run
    needs: the reward, run directory, step count, or DAPO's 4 ranks need: the local Ray's CPUs) would hide a key the
    test never ran."""
    added = {"custom_reward_function.path", "custom_reward_function.name", "trainer.default_local_dir",
             "trainer.total_training_steps", "ray_init.num_cpus"}
    for name, case in CASES.items():
        keys = {key_of(override) for override in case.pasted}
        for key in {**PATHS, **case.replaced}:
            assert key in keys or key in added, (name, key)


def group_advantages(scores: torch.Tensor, uids, divide_by_std: bool) -> torch.Tensor:
    """GRPO's outcome advantage by hand: each score minus its group's mean, over the group's std (+1e-6) unless
    Dr. GRPO's algorithm.norm_adv_by_std_in_grpo=false."""
    advantages = torch.empty_like(scores)
    for uid in set(uids):
        rows = torch.tensor([i for i, u in enumerate(uids) if u == uid])
        centred = scores[rows] - scores[rows].mean()
        advantages[rows] = centred / (scores[rows].std() + 1e-6) if divide_by_std else centred
    return advantages


@pytest.mark.parametrize("name", list(CASES))
def test_verl_override_list_trains_two_steps_in_the_default_mode(name, ray_local, toy_values):
    case = CASES[name]
    overrides = runnable(case, toy_values)
    assert not any(key_of(o) == "actor_rollout_ref.rollout.mode" for o in overrides)  # the default mode, as in verl
    config = validate_config(compose_config(overrides))
    check_before_start(config)
    trainer, batches = fit_keeping_update_batches(config)

    steps = [step for step in read_metrics(toy_values["run_dir"]) if "training/global_step" in step]
    assert [step["training/global_step"] for step in steps] == [1, 2]
    rollout_n, prompts = config.actor_rollout_ref.rollout.n, config.data.train_batch_size
    assert [len(batch) for batch in batches] == [prompts * rollout_n] * 2
    for batch in batches:  # the advantages the update got are GRPO's (Dr. GRPO's: not divided by the std)
        scores = batch.batch["token_level_scores"].sum(-1)
        expected = group_advantages(scores, list(batch.non_tensor_batch["uid"]),
                                    divide_by_std=config.algorithm.norm_adv_by_std_in_grpo)
        mask = batch.batch["response_mask"].bool()
        assert torch.allclose(batch.batch["advantages"], expected[:, None].expand_as(mask) * mask, atol=1e-5)
    if name == "dapo":  # dynamic sampling: groups came through the data flow, every trained group's acc differs
        # verl's names and '+' keys took effect: groups per request, bucket size, the overlong penalty
        assert config.data_flow.over_sampling_batch_size == 6
        actor, ref = config.actor_rollout_ref.actor, config.actor_rollout_ref.ref
        assert (actor.ulysses_sequence_parallel_size, ref.ulysses_sequence_parallel_size) == (4, 4)
        assert actor.entropy_checkpointing and actor.entropy_from_logits_with_chunking
        assert config.actor_rollout_ref.rollout.update_weights_bucket_megabytes == 4096
        assert (config.reward_model.overlong_buffer.enable, config.reward_model.overlong_buffer.len,
                config.reward_model.overlong_buffer.penalty_factor) == (True, 4, 1.0)
        assert trainer.group_rollout is not None
        assert all("data_flow/num_dropped_groups" in step and "data_flow/num_gen_batches" in step for step in steps)
        for batch in batches:
            scores, uids = batch.batch["token_level_scores"].sum(-1), list(batch.non_tensor_batch["uid"])
            for uid in set(uids):
                group = scores[[i for i, u in enumerate(uids) if u == uid]]
                assert len(group) == rollout_n and float(group.std()) > 1e-6, (uid, group)


def test_engine_server_rules_follow_the_engine_servers_not_the_data_flow(toy_values):
    """The DAPO keys in rollout.mode=sync generate by the colocated engines' batched call, which a custom rollout class
    serves; in async mode the engine servers run, so what they cannot serve is refused there."""
    base = runnable(CASES["dapo"], toy_values)
    assert config_errors(base) == []
    custom_rollout = ["actor_rollout_ref.rollout.custom_cls.path=x.py", "actor_rollout_ref.rollout.custom_cls.name=X"]
    assert config_errors(base + custom_rollout) == []
    async_mode = ["actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true"]
    assert config_errors(base + async_mode + custom_rollout)[0].startswith(
        "actor_rollout_ref.rollout.custom_cls: expected null with actor_rollout_ref.rollout.mode='async' (the engine")
