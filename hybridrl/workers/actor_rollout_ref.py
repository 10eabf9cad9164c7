"""ActorRolloutRefWorker: the policy's roles on one rank — train it (actor), sample from it (rollout),
and score with a frozen copy of its starting weights (ref).

One instance per rank, built by a RayWorkerGroup. `role` says which parts this instance holds:

    actor              trainable FSDP policy + AdamW + LR schedule (update_actor, compute_log_prob)
    rollout            FSDP policy + a rollout engine (generate_sequences)
    ref                frozen FSDP copy of the initial policy (compute_ref_log_prob)
    actor_rollout      actor and rollout share ONE model (the hybrid engine): the rollout
                       generates from the very weights being trained, no copy
    actor_rollout_ref  the above plus the reference

Every data method is Dispatch.DP_COMPUTE_PROTO (each rank gets its slice of the batch; results
are concatenated) and returns only the keys it adds, so the trainer `union`s them into its batch.
Log-probs are always taken under logits / `rollout.temperature` (the distribution the rollout
sampled from), whatever meta_info carries.
"""
from __future__ import annotations

import torch

from hybridrl.protocol import DataProto
from hybridrl.single_controller import Dispatch, Worker, register
from hybridrl.utils.distributed import device_name, init_process_group_once
from hybridrl.utils.fsdp_utils import build_lr_scheduler, build_optimizer, load_hf_model, shard_model
from hybridrl.utils.import_utils import load_extensions
from hybridrl.workers.actor.dp_actor import DataParallelPPOActor
from hybridrl.workers.rollout import build_rollout
from hybridrl.workers.sharding_manager.fsdp_hf import FSDPHFShardingManager

ROLES = ("actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref")


class ActorRolloutRefWorker(Worker):
    def __init__(self, config, role: str, seed: int = 0, device: str | None = None, extensions: list[str] = ()):
        """config: the `actor_rollout_ref` section. seed: `trainer.seed`; torch's global RNG starts at
        seed + rank, so sampling is reproducible yet two ranks given the same prompt sample different
        responses (weights missing from a checkpoint use `seed` alone, see load_hf_model). device:
        "cuda" or "cpu" (default: cuda when visible). extensions: modules / .py files to import first."""
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"ActorRolloutRefWorker: role must be one of {list(ROLES)}, got {role!r}")
        self.config = config
        self.role = role
        self.device = device or device_name()
        self._is_actor = role in ("actor", "actor_rollout", "actor_rollout_ref")
        self._is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
        self._is_ref = role in ("ref", "actor_rollout_ref")
        load_extensions(list(extensions))
        init_process_group_once("nccl" if self.device == "cuda" else "gloo")
        self.seed = seed
        torch.manual_seed(seed + self.rank)

    # ------------------------------------------------------------------ set-up
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load and shard the models this role needs; build the optimizer, schedule and rollout engine."""
        actor, model = self.config.actor, self.config.model
        if self._is_actor or self._is_rollout:
            self.actor_module = self._load_and_shard(actor.strategy, torch.float32,
                                                     actor.fsdp_config.reshard_after_forward,
                                                     cpu_offload=actor.fsdp_config.offload_policy)
        if self._is_actor:
            self.actor_optimizer = build_optimizer(self.actor_module, actor.optim)
            self.actor_lr_scheduler = build_lr_scheduler(self.actor_optimizer, actor.optim)
            self.actor = DataParallelPPOActor(
                actor, self.actor_module, self.actor_optimizer, rollout_n=self.config.rollout.n, device=self.device,
                log_prob_micro_batch_size=(self.config.rollout.log_prob_micro_batch_size_per_gpu
                                           or actor.ppo_micro_batch_size_per_gpu))
        if self._is_rollout:
            self.rollout = build_rollout(self.config.rollout, model, self.actor_module)
            self.rollout_sharding_manager = self._rollout_sharding_manager()
        if self._is_ref:
            ref = self.config.ref
            # On a GPU the frozen copy is kept in bf16 (it only ever computes in bf16); on CPU in fp32.
            ref_dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
            ref_module = self._load_and_shard(ref.strategy, ref_dtype, ref.fsdp_config.reshard_after_forward,
                                              cpu_offload=False)
            ref_module.requires_grad_(False)
            self.ref_policy = DataParallelPPOActor(
                ref, ref_module, None, device=self.device,
                log_prob_micro_batch_size=ref.log_prob_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu)

    def _rollout_sharding_manager(self):
        """The trainer<->rollout switch for the engine: SGLang's pushes the weights into its own engine;
        every other engine (hf, a user's class) generates from the FSDP module itself, gathered once."""
        rollout, fsdp_config = self.config.rollout, self.config.actor.fsdp_config
        if rollout.name == "sglang" and rollout.custom_cls.path is None:
            from hybridrl.workers.sharding_manager.fsdp_sglang import FSDPSGLangShardingManager

            return FSDPSGLangShardingManager(self.actor_module, self.rollout,
                                             optimizer=getattr(self, "actor_optimizer", None),
                                             offload_params=fsdp_config.param_offload,
                                             offload_optimizer=fsdp_config.optimizer_offload)
        return FSDPHFShardingManager(self.actor_module, reshard_after_forward=fsdp_config.reshard_after_forward)

    def _load_and_shard(self, strategy: str, dtype: torch.dtype, reshard_after_forward: bool, cpu_offload: bool):
        """The policy model from `model.path`, sharded over the ranks (see fsdp_utils.shard_model)."""
        model = self.config.model
        if model.external_lib:  # a module that registers a custom architecture with transformers' Auto classes
            load_extensions([model.external_lib])
        module = load_hf_model(model.path, trust_remote_code=model.trust_remote_code,
                               override_config=model.override_config, dtype=dtype,
                               gradient_checkpointing=model.enable_gradient_checkpointing, init_seed=self.seed)
        return shard_model(module, strategy=strategy, device=self.device, mixed_precision=self.device == "cuda",
                           reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload)

    # ------------------------------------------------------------------ data methods
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """One response per prompt row: adds prompts, responses, input_ids, attention_mask, position_ids,
        response_mask (and rollout_log_probs with rollout.calculate_log_probs)."""
        self._require(self._is_rollout, "generate_sequences", "rollout")
        with self.rollout_sharding_manager:
            return self.rollout.generate_sequences(prompts)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """The current policy's log-probs of the responses: adds old_log_probs and entropys (per token)."""
        self._require(self._is_actor, "compute_log_prob", "actor")
        log_probs, entropys = self.actor.compute_log_prob(self._at_rollout_temperature(data), calculate_entropy=True)
        return DataProto.from_dict({"old_log_probs": log_probs, "entropys": entropys})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """The reference policy's log-probs of the responses: adds ref_log_prob."""
        self._require(self._is_ref, "compute_ref_log_prob", "ref")
        log_probs, _ = self.ref_policy.compute_log_prob(self._at_rollout_temperature(data))
        return DataProto.from_dict({"ref_log_prob": log_probs})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """One PPO update (all mini-batches and epochs), then one LR-schedule step.

        Returns no rows, only meta_info["metrics"]: actor/pg_loss, actor/pg_clipfrac, actor/ppo_kl,
        actor/pg_clipfrac_lower (vanilla loss), actor/entropy, actor/kl_loss and actor/kl_coef (with
        use_kl_loss), actor/grad_norm — one value per mini-batch step, already averaged over the
        ranks — and actor/lr, the learning rate this update used.
        """
        self._require(self._is_actor, "update_actor", "actor")
        metrics = self.actor.update_policy(self._at_rollout_temperature(data))
        metrics["actor/lr"] = self.actor_lr_scheduler.get_last_lr()[0]
        self.actor_lr_scheduler.step()
        return DataProto(meta_info={"metrics": metrics})

    # ------------------------------------------------------------------ helpers
    def _at_rollout_temperature(self, data: DataProto) -> DataProto:
        """`data` (same tensors) with meta_info["temperature"] = rollout.temperature."""
        return DataProto(data.batch, data.non_tensor_batch, {**data.meta_info,
                                                             "temperature": self.config.rollout.temperature})

    def _require(self, present: bool, method: str, part: str) -> None:
        if not present:
            raise RuntimeError(f"{method} needs the {part} part, but this worker's role is {self.role!r}")
