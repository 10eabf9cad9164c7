"""RayPPOTrainer: PPO / GRPO from one controller process.

`fit()` is the algorithm, top to bottom: the schedule (schedule.py: sync, one_step_off, fully_async) gives each
step its batch from the sample-group flow (group_rollout.py, the one route of every schedule and engine), which takes
groups of prompts from the prompt source, generates `n` responses each, scores and filters them (sync: in a
rollout-mode window, the engines getting the current weights first); compute old / reference log-probs and values,
correct for the rollout-training mismatch (algorithm.rollout_correction, with the rollout's log-probs), turn scores
into advantages, update the critic and the actor. Where the engines run and how the weights reach them is the
placement's (placement.py: colocated with the trainer, or a separate rollout pool). Validation is the same flow
with val_kwargs' sampling and no training. Numbers that are not finite stop the run with a reason instead of
training on without learning (nonfinite_guard.py). The controller owns the loop and the small per-token tensors;
the worker groups own every model (see workers/). Nothing here touches a weight.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import ray

from hybridrl.agent_loop.manager import AgentLoopManager
from hybridrl.data.hooks import load_hook
from hybridrl.data.prompt_source import PromptSource
from hybridrl.protocol import DataProto
from hybridrl.single_controller.heartbeat import WorkerWatch
from hybridrl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup, create_colocated_worker_cls
from hybridrl.single_controller.resource_pool_manager import ResourcePoolManager, pool_specs, role_mapping
from hybridrl.algorithms import core_algos
from hybridrl.algorithms.rollout_correction import compute_rollout_correction_and_add_to_batch
from hybridrl.trainer.ppo import checkpointing, worker_inputs
from hybridrl.trainer.ppo.evaluation import ValidationResults, eval_sets_from_config
from hybridrl.trainer.ppo.generate import AgentLoopGenerate, BatchGenerate, Sampling
from hybridrl.trainer.ppo.group_rollout import GroupRollout, generates_on_engine_servers
from hybridrl.trainer.ppo.placement import placement_for
from hybridrl.trainer.ppo.schedule import Schedule, schedule_for
from hybridrl.trainer.ppo.generation_dump import (dump_generations, filtered_records, rollout_records,
                                                  select_val_samples)
from hybridrl.trainer.ppo.metric_utils import (
    compute_data_metrics,
    compute_rollout_probs_diff,
    compute_throughput_metrics,
    compute_timing_metrics,
    pop_worker_metrics,
    reduce_metrics,
    timer,
)
from hybridrl.trainer.ppo.nonfinite_guard import NonFiniteStepGuard, check_finite_at_responses
from hybridrl.data.rl_dataset import create_rl_dataset, make_dataloader
from hybridrl.trainer.progress import ProgressReporter
from hybridrl.data.seqlen_balancing import balance_batch
from hybridrl.models.spec import critic_model_spec, policy_model_spec, reward_model_spec
from hybridrl.utils.tokenizer import policy_tokenizer
from hybridrl.trainer.tracking import Tracking
from hybridrl.reward.managers import load_reward_manager
from hybridrl.workers.rollout.engine_load import EngineLoad, engine_load


def resolve_device(requested: str) -> str:
    """`auto` picks cuda when the Ray cluster has GPUs (the driver itself may have none)."""
    has_gpu = ray.cluster_resources().get("GPU", 0) > 0
    if requested == "auto":
        return "cuda" if has_gpu else "cpu"
    if requested == "cuda" and not has_gpu:
        raise RuntimeError("trainer.device=cuda but the Ray cluster reports no GPU; use trainer.device=auto or cpu")
    return requested


class RayPPOTrainer:
    def __init__(self, config, run_control=None):
        """run_control: the driver's RunControl actor (trainer/run_control.py), asked between steps whether to stop;
        None (a trainer run in-process) never stops early."""
        self.config = config
        self.run_control = run_control
        self.tokenizer = policy_tokenizer(config)  # the one policy tokenizer of the run, handed to every process
        self.use_critic = config.critic.enable  # validation resolved null to (adv_estimator == gae)
        self.use_rm = config.reward_model.enable
        # What each role loads, resolved once here and handed to its workers (and the policy's to the engines).
        self.policy_spec = policy_model_spec(config)
        self.critic_spec = critic_model_spec(config) if self.use_critic else None
        self.rm_spec = reward_model_spec(config) if self.use_rm else None
        self.use_kl_in_reward = config.algorithm.use_kl_in_reward
        self.use_reference = config.actor_rollout_ref.actor.use_kl_loss or self.use_kl_in_reward
        self.kl_ctrl_in_reward = core_algos.get_kl_controller(config.algorithm.kl_ctrl) if self.use_kl_in_reward else None
        self.device = resolve_device(config.trainer.device)
        self.world_size = config.trainer.nnodes * config.trainer.n_gpus_per_node

        self.nonfinite_guard = NonFiniteStepGuard(config.trainer.max_consecutive_nonfinite_steps, self.world_size)
        self.train_dataloader, self.val_dataloader = self._create_dataloaders()
        self.eval_sets = self._create_eval_sets()  # data.eval_sets: [(EvalSet, its loader)]
        # the flow's generate function: agent loops on engine servers, else the engines' batched call (data/route.py)
        self.async_rollout = generates_on_engine_servers(config)
        self.agent_loop_manager: AgentLoopManager | None = None  # built by init_workers when async_rollout
        self.total_training_steps = self._total_training_steps()  # the workers' LR schedules get it at init

        self.reward_fn = load_reward_manager(config, self.tokenizer, num_examine=0)
        self.val_reward_fn = load_reward_manager(config, self.tokenizer, num_examine=1)
        self.global_steps = 0
        self.train_data_position = checkpointing.TrainDataPosition(self.train_dataloader)
        # The sample-group flow: the prompt source hands out groups (the buffer first: slime's) of rollout.n samples,
        # ReMax's greedy baseline last in each; the group rollout is built with the workers (init_workers). The one
        # place the controller reads rollout.n: everything else asks the prompt source.
        self.prompt_source = PromptSource(
            self.train_data_position.batches, config.actor_rollout_ref.rollout.n, config,
            load_hook("buffer_filter", config.data_flow.buffer_filter),
            baseline=config.algorithm.adv_estimator == core_algos.AdvantageEstimator.REMAX)
        self.placement = placement_for(config)  # where rollout runs, started by init_workers
        self.group_rollout: GroupRollout | None = None
        self.schedule: Schedule | None = None  # when rollout runs, chosen by init_workers once the flow is built
        self.tracking: Tracking | None = None  # set by fit(); _validate logs its generations to it
        self.latest_checkpoint_dir: str | None = None  # the last checkpoint this run saved

    # ------------------------------------------------------------------ set-up
    def _create_dataloaders(self):
        """The training loader, and the validation loader when the run validates (else None: not even read)."""
        data = self.config.data
        train_set = create_rl_dataset(data.train_files, self.tokenizer, data, max_samples=data.train_max_samples)
        train = make_dataloader(train_set, batch_size=data.train_batch_size, shuffle=data.shuffle,
                                seed=data.seed, drop_last=True, num_workers=data.dataloader_num_workers)
        if len(train) == 0:
            raise ValueError(f"data.train_files has {len(train_set)} prompts, fewer than "
                             f"data.train_batch_size={data.train_batch_size}: not one training batch")
        if not self.config.trainer.runs_validation() or not data.val_files:  # [] with data.eval_sets: only those
            return train, None
        val_set = create_rl_dataset(data.val_files, self.tokenizer, data, max_samples=data.val_max_samples)
        val = make_dataloader(val_set, batch_size=data.val_batch_size or len(val_set), shuffle=False,
                              seed=data.seed, drop_last=False, num_workers=data.dataloader_num_workers)
        return train, val

    def _create_eval_sets(self) -> list:
        """Each named eval set of data.eval_sets with its loader (evaluation.py); none when the run never validates."""
        if not self.config.trainer.runs_validation():
            return []
        data, loaders = self.config.data, []
        for eval_set in eval_sets_from_config(self.config):
            dataset = create_rl_dataset(list(eval_set.files), self.tokenizer, data, max_samples=eval_set.max_samples)
            loaders.append((eval_set, make_dataloader(dataset, batch_size=data.val_batch_size or len(dataset),
                                                      shuffle=False, seed=data.seed, drop_last=False,
                                                      num_workers=data.dataloader_num_workers)))
        return loaders

    def _total_training_steps(self) -> int:
        steps = len(self.train_dataloader) * self.config.trainer.total_epochs
        if self.config.trainer.total_training_steps is not None:
            steps = self.config.trainer.total_training_steps
        return steps

    def init_workers(self):
        """The trainer pool's ranks, each one Ray actor holding every role it runs (actor, ref, critic, reward model;
        colocated, the rollout too: the hybrid engine); the engines where the placement puts them; the sample-group
        flow generating on them; the schedule running it."""
        self.resource_pool = self._create_resource_pools()
        self._spawn_trainer_pool(self.placement.actor_role(self.use_reference))
        engines = self.placement.start(self.actor_rollout_wg, self._spawn_rollout_pool)
        rollout = self.config.actor_rollout_ref.rollout
        if self.async_rollout:  # one engine server per engine; agent-loop workers on the controller's node
            addresses = [address for address in engines.start_engine_server(
                [self.tokenizer.eos_token_id], self.tokenizer.pad_token_id) if address is not None]  # TP: leaders'
            self.agent_loop_manager = AgentLoopManager(self.config, self.tokenizer, addresses)
            generator = AgentLoopGenerate(self.agent_loop_manager, rollout)
        else:
            generator = BatchGenerate(engines, rollout, self.tokenizer, self.placement.engines_version)
        self.group_rollout = GroupRollout(self.config, generator, self.tokenizer,
                                          lambda batch, evaluation: self._score(
                                              batch, self.val_reward_fn if evaluation else self.reward_fn))
        self.placement.connect()  # a separate pool: the weight-transfer group, the engines' initial weights
        self.schedule = schedule_for(self.config, self.group_rollout, self.prompt_source, self.placement,
                                     self.total_training_steps)

    def _create_resource_pools(self) -> ResourcePoolManager:
        """The pools of every role (single_controller/resource_pool_manager.py), checked against the Ray cluster
        before any worker starts."""
        manager = ResourcePoolManager(pool_specs(self.config), role_mapping(self.config), use_gpu=self.device == "cuda")
        manager.create_pools()
        return manager

    def worker_init_args(self) -> dict:
        """The keyword arguments every worker class gets."""
        return dict(seed=self.config.trainer.seed, device=self.device, extensions=list(self.config.extensions))

    def rollout_engine_load(self) -> EngineLoad:
        """The sequences one rollout engine decodes at once under this run's schedule, the largest validation batch
        included (rollout/engine_load.py); the rollout workers' engines size their CUDA graphs for it."""
        val_n = self.config.actor_rollout_ref.rollout.val_kwargs.n
        loaders = [(val_n, self.val_dataloader)] if self.val_dataloader is not None else []
        loaders += [(eval_set.n, loader) for eval_set, loader in self.eval_sets]
        return engine_load(self.config, [(min(loader.batch_size, len(loader.dataset)), n) for n, loader in loaders])

    def _policy_worker(self, role: str) -> RayClassWithInitArgs:
        """The policy's worker class with its arguments, holding `role` (workers/actor_rollout_ref.py)."""
        from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker

        return RayClassWithInitArgs(ActorRolloutRefWorker, self.config.actor_rollout_ref, self.policy_spec, role=role,
                                    total_training_steps=self.total_training_steps, tokenizer=self.tokenizer,
                                    engine_load=self.rollout_engine_load() if "rollout" in role else None,
                                    **self.worker_init_args())

    def _spawn_trainer_pool(self, actor_role: str) -> None:
        """The policy worker (with `actor_role`), critic and reward model, colocated on the trainer pool's ranks;
        sets actor_rollout_wg, critic_wg, rm_wg."""
        from hybridrl.workers.critic import CriticWorker
        from hybridrl.workers.reward_model import RewardModelWorker

        trainer = self.config.trainer
        pool = self.resource_pool.pool_of("actor_rollout" if actor_role.startswith("actor_rollout") else "actor")
        # Colocated: "actor_rollout" holds the rollout too; a separate pool: "actor" (+ ref), the rollout elsewhere.
        common = self.worker_init_args()
        roles = {"actor_rollout": self._policy_worker(actor_role)}
        if self.use_critic:
            roles["critic"] = RayClassWithInitArgs(CriticWorker, self.config.critic, self.critic_spec,
                                                   rollout_n=self.prompt_source.n,
                                                   total_training_steps=self.total_training_steps, **common)
        if self.use_rm:
            roles["rm"] = RayClassWithInitArgs(RewardModelWorker, self.config.reward_model, self.rm_spec,
                                               policy_tokenizer=self.tokenizer, **common)
        all_roles = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=create_colocated_worker_cls(roles),
                                   watch=WorkerWatch.from_trainer_config(trainer))
        groups = all_roles.spawn(prefix_set=set(roles))
        if self.use_critic:
            self.critic_wg = groups["critic"]
            self.critic_wg.init_model()
        if self.use_rm:
            self.rm_wg = groups["rm"]
            self.rm_wg.init_model()
        # The actor/rollout goes last so an inference engine sizes its cache after the critic is in memory.
        self.actor_rollout_wg = groups["actor_rollout"]
        self.actor_rollout_wg.init_model()

    def _spawn_rollout_pool(self) -> RayWorkerGroup:
        """Rollout-only policy workers on the rollout pool (placement.SeparatePool starts them)."""
        rollout_wg = RayWorkerGroup(resource_pool=self.resource_pool.pool_of("rollout"),
                                    ray_cls_with_init=self._policy_worker("rollout"),
                                    watch=WorkerWatch.from_trainer_config(self.config.trainer))
        rollout_wg.init_model()
        return rollout_wg

    def shutdown(self):
        """Stop the workers and free their placement groups (so a later trainer in this Ray can start)."""
        if self.schedule is not None:
            self.schedule.close()
        if self.agent_loop_manager is not None:
            self.agent_loop_manager.shutdown()
        self.resource_pool.remove()

    # ------------------------------------------------------------------ the algorithm
    def fit(self):
        """Train for `total_training_steps`, validating before, every `test_freq` steps and at the end.

        Call `init_workers()` first. It first resumes from a checkpoint as `trainer.resume_mode` says, and saves
        one every `trainer.save_freq` steps and at the last step (see checkpointing.py). When the driver asks it to
        stop (a signal), it stops after the running step, saves that step first when `save_freq > 0`, and returns
        with `stopped_early` set in the summary."""
        trainer = self.config.trainer
        start = time.perf_counter()
        logger = Tracking(project_name=trainer.project_name, experiment_name=trainer.experiment_name,
                          default_backend=list(trainer.logger), config=dataclasses.asdict(self.config),
                          local_dir=trainer.default_local_dir)
        self.tracking = logger
        self.reward_errors = {"train": 0, "val": 0}  # samples whose scorer failed, in this run's steps
        self._resume()
        self._record_step()

        val_before = val_after = None
        if trainer.val_before_train:
            val_metrics = self._validate()
            val_before = val_after = _val_score(val_metrics, trainer.summary_metric)
            self._count_reward_errors(val_metrics)
            logger.log(val_metrics, step=self.global_steps)
        if trainer.val_only:
            return self._finish(logger, start, val_before, val_after)

        progress = ProgressReporter(self.total_training_steps, initial_step=self.global_steps)
        while self.global_steps < self.total_training_steps:
            if self._stop_requested():
                progress.close()
                self._save_before_stopping()
                return self._finish(logger, start, val_before, val_after, stopped_early=True)
            self.global_steps += 1
            metrics = self.train_step()
            is_last = self.global_steps >= self.total_training_steps
            if trainer.test_freq > 0 and (self.global_steps % trainer.test_freq == 0 or is_last):
                val_metrics = self._validate()
                val_after = _val_score(val_metrics, trainer.summary_metric)
                metrics.update(val_metrics)
            if checkpointing.should_save(trainer.save_freq, self.global_steps, is_last):
                save_timing: dict[str, float] = {}
                with timer("save_checkpoint", save_timing):
                    self._save_checkpoint()
                metrics.update(compute_timing_metrics(save_timing))
            self._count_reward_errors(metrics)
            logger.log(metrics, step=self.global_steps)
            progress.update(self.global_steps, metrics)
            self._record_step()
        progress.close()
        if trainer.test_freq <= 0 and trainer.val_before_train:
            val_metrics = self._validate()
            val_after = _val_score(val_metrics, trainer.summary_metric)
            self._count_reward_errors(val_metrics)
            logger.log(val_metrics, step=self.global_steps)
        return self._finish(logger, start, val_before, val_after)

    def _save_checkpoint(self) -> None:
        """This step's checkpoint (checkpointing.py), with the schedule's work in flight back in the prompt source's
        buffer first (the checkpoint saves it)."""
        self.schedule.return_in_flight()
        kl_coef = None if self.kl_ctrl_in_reward is None else self.kl_ctrl_in_reward.value
        prompt_source = self.prompt_source.state_dict()  # first: it waits for a prefetched batch's rows
        state = checkpointing.ControllerState(self.global_steps, self.train_data_position.state_dict(), kl_coef,
                                              prompt_source)
        self.latest_checkpoint_dir = checkpointing.save_checkpoint(self.config, self._checkpointed_workers(), state)

    def _resume(self) -> None:
        """The workers load the checkpoint trainer.resume_mode picks, if any; the controller takes back its state."""
        restored = checkpointing.load_checkpoint(self.config, self._checkpointed_workers())
        if restored is None:
            return
        self.global_steps = restored.global_step
        self.train_data_position.load_state_dict(restored.data_position)
        if self.kl_ctrl_in_reward is not None:
            self.kl_ctrl_in_reward.value = restored.kl_coef_in_reward
        if restored.prompt_source is not None:  # none: the source starts empty
            self.prompt_source.load_state_dict(restored.prompt_source)

    def _checkpointed_workers(self) -> checkpointing.CheckpointedWorkers:
        return checkpointing.CheckpointedWorkers(self.actor_rollout_wg, self.critic_wg if self.use_critic else None)

    def _stop_requested(self) -> bool:
        return self.run_control is not None and ray.get(self.run_control.stop_requested.remote())

    def _record_step(self) -> None:
        """Tell the driver the last step done, so a stop at once can report it."""
        if self.run_control is not None:
            self.run_control.record_step.remote(self.global_steps)

    def _save_before_stopping(self) -> None:
        """A checkpoint of the last step done, unless checkpoints are off or that step already has one."""
        trainer = self.config.trainer
        if trainer.save_freq > 0 and self.global_steps > 0 \
                and not checkpointing.has_checkpoint(trainer.default_local_dir, self.global_steps):
            print(f"stopping: saving a checkpoint of step {self.global_steps}", flush=True)
            self._save_checkpoint()

    def train_step(self) -> dict[str, float]:
        """One PPO/GRPO iteration on the groups the prompt source gives; returns its metrics."""
        timing: dict[str, float] = {}
        metrics: dict[str, float] = {}
        with timer("step", timing):
            # sync: generated now, the engines getting the current weights first; one_step_off: generated ahead,
            # the weights synced once it is in; fully_async: the first groups fresh enough from the stream
            batch = self.schedule.next_batch(self.global_steps, timing, metrics)
            batch = self.learn_step(batch, timing, metrics)
            self.schedule.after_update(self.global_steps, batch, timing, metrics)  # fully_async: weights synced
        return self.step_metrics(batch, timing, metrics)

    def learn_step(self, batch: DataProto, timing: dict[str, float], metrics: dict[str, float]) -> DataProto:
        """Everything after generation (the flow scored the batch): log-probs (old, reference), values, advantages,
        then the critic's and the actor's updates. Returns the batch with what each phase added."""
        batch.meta_info["temperature"] = self.config.actor_rollout_ref.rollout.temperature
        if self.config.trainer.balance_batch:  # equal tokens per rank in every pass below
            metrics.update(balance_batch(batch, self.world_size))

        with timer("old_log_prob", timing):
            batch = batch.union(pop_worker_metrics(self.actor_rollout_wg.compute_log_prob(
                worker_inputs.actor_forward(batch)), metrics))
        check_finite_at_responses(batch, "old_log_probs", "compute_log_prob", self.global_steps)
        metrics.update(compute_rollout_probs_diff(batch))
        if self.use_reference:
            with timer("ref", timing):
                batch = batch.union(pop_worker_metrics(self.actor_rollout_wg.compute_ref_log_prob(
                    worker_inputs.actor_forward(batch)), metrics))
            check_finite_at_responses(batch, "ref_log_prob", "ref", self.global_steps)
        if self.use_critic:
            with timer("values", timing):
                batch = batch.union(self.critic_wg.compute_values(worker_inputs.critic_forward(batch)))
            check_finite_at_responses(batch, "values", "compute_values", self.global_steps)

        with timer("adv", timing):
            if self.use_kl_in_reward:
                batch, kl_metrics = core_algos.apply_kl_penalty(
                    batch, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty=self.config.algorithm.kl_penalty)
                metrics.update(kl_metrics)
            else:
                batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
            algo = self.config.algorithm
            if "rollout_log_probs" in batch.batch.keys():  # IS weights, rejection (response_mask), rollout_corr/*
                metrics.update(compute_rollout_correction_and_add_to_batch(batch, algo.rollout_correction))
            batch = core_algos.compute_advantage(
                batch, adv_estimator=algo.adv_estimator, gamma=algo.gamma, lam=algo.lam,
                norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo, config=algo)

        if self.use_critic:
            with timer("update_critic", timing):
                critic_out = self.critic_wg.update_critic(worker_inputs.critic_update(batch))
            metrics.update(self.nonfinite_guard.after_update("update_critic", critic_out.meta_info["metrics"],
                                                             batch, self.global_steps))
            metrics.update(reduce_metrics(critic_out.meta_info["metrics"]))
        if self.global_steps > self.config.trainer.critic_warmup:
            with timer("update_actor", timing):
                actor_out = self.actor_rollout_wg.update_actor(
                    worker_inputs.actor_update(batch, self.config.actor_rollout_ref.actor.use_kl_loss))
            metrics.update(self.nonfinite_guard.after_update("update_actor", actor_out.meta_info["metrics"],
                                                             batch, self.global_steps))
            metrics.update(reduce_metrics(actor_out.meta_info["metrics"]))
        return batch

    def step_metrics(self, batch: DataProto, timing: dict[str, float], metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics: the phases' own plus data, timing and throughput (and the generations' dump)."""
        metrics["training/global_step"] = self.global_steps
        metrics.update(compute_data_metrics(batch, use_critic=self.use_critic))
        metrics.update(compute_timing_metrics(timing))
        metrics.update(compute_throughput_metrics(batch, timing, n_workers=self.world_size))
        if self.config.trainer.rollout_data_dir:
            records = rollout_records(self.tokenizer, batch) + \
                filtered_records(self.tokenizer, self.group_rollout.take_dropped())
            dump_generations(self.config.trainer.rollout_data_dir, self.global_steps, records,
                             max_mb=self.config.trainer.rollout_data_max_mb)
        return metrics

    # ------------------------------------------------------------------ the rollout, shared by training and validation
    def _score(self, batch: DataProto, reward_fn) -> dict:
        """The reward manager's result for `batch` (reward_tensor, reward_metrics, reward_extra_info); with a
        reward model its rm_scores are added to `batch` first (the managers add them to the rule scores)."""
        if self.use_rm:
            batch.union(self.rm_wg.compute_rm_score(batch))
        return reward_fn(batch, return_dict=True)

    def _validate(self) -> dict[str, float]:
        """The validation set with `rollout.val_kwargs` (greedy by default) and each named eval set with its own
        settings, all in one rollout-mode window: the training step's flow (data_flow.eval_function's groups, by
        default every prompt once), scored with the validation reward manager, once the schedule's generation ahead,
        if any, is done. Metrics: trainer/ppo/evaluation.py."""
        val_kwargs = self.config.actor_rollout_ref.rollout.val_kwargs
        sets = [(None, val_kwargs.n, Sampling(validate=True), self.val_dataloader)] if self.val_dataloader else []
        sets += [(eval_set, eval_set.n, Sampling(validate=True, do_sample=eval_set.do_sample,
                                                 overrides=tuple(sorted(eval_set.sampling_overrides().items()))),
                  loader) for eval_set, loader in self.eval_sets]
        self.schedule.before_validation()
        self.placement.rollout_mode()
        generated = [(eval_set, n, *self.group_rollout.eval_groups(
            self.global_steps, PromptSource(lambda loader=loader: iter(loader), n, self.config), n, sampling))
            for eval_set, n, sampling, loader in sets]
        self.placement.trainer_mode()
        results = ValidationResults(self.tokenizer, self.config.data.reward_fn_key)
        rollout = self.config.actor_rollout_ref.rollout
        for eval_set, n, groups, reward_metrics in generated:
            results.add_groups(groups, reward_metrics, n=n, eval_set=eval_set, prompt_length=rollout.prompt_length,
                               response_length=rollout.response_length, pad_token_id=self.tokenizer.pad_token_id)
        self._record_val_generations(results.samples)
        return results.metrics()

    def _record_val_generations(self, samples: list[tuple[str, str, float]]) -> None:
        """Dump them to `validation_data_dir`; log `log_val_generations` of them to the trackers."""
        trainer = self.config.trainer
        if trainer.validation_data_dir:
            records = [{"input": prompt, "output": response, "score": score} for prompt, response, score in samples]
            dump_generations(trainer.validation_data_dir, self.global_steps, records)
        if trainer.log_val_generations > 0 and self.tracking is not None:
            self.tracking.log_generations(select_val_samples(samples, trainer.log_val_generations),
                                          step=self.global_steps)

    def _count_reward_errors(self, metrics: dict[str, float]) -> None:
        """Add the samples whose reward scorer failed (scored 0) to the run's total, for summary.json."""
        for key, part in REWARD_ERROR_METRICS.items():
            self.reward_errors[part] += int(metrics.get(key, 0))

    def _finish(self, logger, start: float, val_before, val_after, stopped_early: bool = False) -> dict:
        """Write `summary.json` in the run directory and return the summary."""
        run_dir = self.config.trainer.default_local_dir
        os.makedirs(run_dir, exist_ok=True)
        summary = {"val_score_metric": self.config.trainer.summary_metric,  # null: the mean of val-core/*
                   "val_score_before": val_before, "val_score_after": val_after, "steps": self.global_steps,
                   "wall_s": round(time.perf_counter() - start, 2), "checkpoint_dir": self.latest_checkpoint_dir,
                   "stopped_early": stopped_early, "reward_errors": dict(self.reward_errors)}
        path = os.path.join(run_dir, "summary.json")
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
        logger.finish()
        summary["summary_path"] = os.path.abspath(path)
        return summary


# The per-step counts of samples whose scorer failed (reward managers' reward/errors; validation's summed), by the
# part of summary.json's reward_errors they add to.
REWARD_ERROR_METRICS = {"reward/errors": "train", "val-aux/reward/errors": "val"}


def _val_score(val_metrics: dict[str, float], metric: str | None) -> float | None:
    """summary.json's score of one validation: trainer.summary_metric, or without one the mean of val-core/*."""
    if metric is not None:
        if metric not in val_metrics:
            raise ValueError(f"trainer.summary_metric: expected one of this validation's metrics, got {metric!r}; "
                             f"it logged {sorted(val_metrics)}")
        return val_metrics[metric]
    scores = [v for k, v in val_metrics.items() if k.startswith("val-core/")]
    return float(np.mean(scores)) if scores else None

