"""CriticWorker: the value model on one rank — a causal LM backbone with a one-output head.

Data methods are Dispatch.DP_COMPUTE_PROTO and return only what they add (see workers/actor_rollout_ref.py).
With fsdp_config.param_offload / optimizer_offload the parameters and the optimizer state wait in
CPU memory between calls and come to the device only for the call that needs them (models/offload.py).
It lives in the critic package (not workers/critic.py, which the package would shadow) and is
exported as hybridrl.workers.critic.CriticWorker.
"""
from __future__ import annotations

import torch

from hybridrl.protocol import DataProto
from hybridrl.single_controller import Dispatch, Worker, register
from hybridrl.models.checkpoint import load_sharded_model_state, save_sharded_model_state
from hybridrl.utils.distributed import device_name, init_process_group_once
from hybridrl.models.fsdp_utils import build_lr_scheduler, build_optimizer, shard_model
from hybridrl.models.offload import FSDPOffload
from hybridrl.models.spec import ModelSpec
from hybridrl.utils.determinism import enable_full_determinism
from hybridrl.utils.import_utils import load_extensions
from hybridrl.workers.critic.dp_critic import DataParallelPPOCritic


class CriticWorker(Worker):
    def __init__(self, config, model_spec: ModelSpec, *, rollout_n: int, seed: int = 0, device: str | None = None,
                 extensions: list[str] = (), total_training_steps: int | None = None):
        """config: the `critic` section (how to train and shard). model_spec: the value model's backbone, resolved by
        the controller (models/spec.critic_model_spec). rollout_n: `actor_rollout_ref.rollout.n` (the critic's
        ppo_mini_batch_size counts prompts, each with rollout_n responses). seed/device/extensions/
        total_training_steps as for ActorRolloutRefWorker."""
        super().__init__()
        self.config = config
        self.model_spec = model_spec
        self.rollout_n = rollout_n
        self.device = device or device_name()
        load_extensions(list(extensions))
        if config.model.fsdp_config.full_determinism:  # before the process group: NCCL reads its settings at start
            enable_full_determinism(seed + self.rank)
        init_process_group_once("nccl" if self.device == "cuda" else "gloo")
        self.seed = seed
        self.total_training_steps = total_training_steps
        torch.manual_seed(seed + self.rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the backbone with a fresh value head (drawn from `seed`: the same on every rank), shard, optimise."""
        config, fsdp_config = self.config, self.config.model.fsdp_config
        # adapters (when the spec has LoRA) on the backbone only; the value head is trained in full
        module = self.model_spec.load(dtype=torch.float32, device=self.device, init_seed=self.seed, value_head=True)
        self.critic_module = shard_model(module, strategy=config.strategy, device=self.device,
                                         mixed_precision=self.device == "cuda",
                                         reshard_after_forward=fsdp_config.reshard_after_forward,
                                         cpu_offload=fsdp_config.offload_policy,
                                         forward_prefetch=fsdp_config.forward_prefetch)
        self.critic_optimizer = build_optimizer(self.critic_module, config.optim)
        self.critic_lr_scheduler = build_lr_scheduler(self.critic_optimizer, config.optim, self.total_training_steps)
        self.critic = DataParallelPPOCritic(config, self.critic_module, self.critic_optimizer,
                                            rollout_n=self.rollout_n, device=self.device,
                                            use_remove_padding=self.model_spec.use_remove_padding)
        self.critic_offload = FSDPOffload(self.critic_module, self.critic_optimizer,
                                          param_offload=fsdp_config.param_offload,
                                          optimizer_offload=fsdp_config.optimizer_offload, device=self.device)
        self.critic_offload.park()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """Adds values: V per response token, 0 outside response_mask."""
        with self.critic_offload.loaded():
            return DataProto.from_dict({"values": self.critic.compute_values(data)})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        """One value update, then one LR-schedule step. Returns only meta_info["metrics"]: critic/vf_loss,
        critic/vf_clipfrac, critic/vpred_mean, critic/grad_norm (per mini-batch step, averaged over
        the ranks) and critic/lr."""
        with self.critic_offload.loaded(optimizer=True):
            metrics = self.critic.update_critic(data)
        metrics["critic/lr"] = self.critic_lr_scheduler.get_last_lr()[0]
        self.critic_lr_scheduler.step()
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str) -> None:
        """Write this rank's shards of the critic (critic.checkpoint.save_contents) into local_path (a collective)."""
        with self.critic_offload.loaded(optimizer=True):
            save_sharded_model_state(self.critic_module, self.critic_optimizer, self.critic_lr_scheduler, local_path,
                                     self.rank, list(self.config.checkpoint.save_contents))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str) -> None:
        """Load what save_checkpoint wrote (critic.checkpoint.load_contents)."""
        with self.critic_offload.loaded(optimizer=True):
            load_sharded_model_state(self.critic_module, self.critic_optimizer, self.critic_lr_scheduler, local_path,
                                     self.rank, list(self.config.checkpoint.load_contents))
