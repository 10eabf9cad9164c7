"""ActorRolloutRefWorker: the policy's roles on one rank — train it (actor), sample from it (rollout),
and score with a frozen copy of its starting weights (ref).

One instance per rank, built by a RayWorkerGroup. `role` says which parts this instance holds:

    actor              trainable FSDP policy + AdamW + LR schedule (update_actor, compute_log_prob)
    rollout            FSDP policy + a rollout engine (rollout_mode, generate_sequences, trainer_mode)
    ref                frozen FSDP copy of the initial policy (compute_ref_log_prob); with LoRA
                       (the policy's ModelSpec has LoRA) the actor itself with its adapters disabled, no copy
    actor_rollout      actor and rollout share ONE model (the hybrid engine): the rollout
                       generates from the very weights being trained, no copy
    actor_rollout_ref  the above plus the reference
    actor_ref          actor and reference without a rollout: the trainer pool of a disaggregated run
                       (actor_rollout_ref.hybrid_engine=false), whose rollout-only workers get the weights
                       through workers/weight_transfer_worker.py

The controller moves the ranks between trainer mode and rollout mode explicitly: `rollout_mode()`
(the engine gets its memory and the current weights), any number of `generate_sequences`, then
`trainer_mode()` (the engine gives its memory back). See workers/rollout/mode_switch.py.

Every data method is Dispatch.DP_COMPUTE_PROTO (each rank gets its slice of the batch; results
are concatenated) and returns only the keys it adds, so the trainer `union`s them into its batch.
Log-probs are always taken under logits / `rollout.temperature` (the distribution the rollout
sampled from), whatever meta_info carries. With fsdp_config.param_offload / optimizer_offload the
models' state waits in CPU memory and each method brings what it needs to the device for its own
duration (models/offload.py).
"""
from __future__ import annotations

import contextlib
import time

import torch

from hybridrl.models.flops import model_flops_utilization
from hybridrl.protocol import DataProto
from hybridrl.single_controller import Dispatch, Worker, register
from hybridrl.utils.distributed import device_name, init_process_group_once
from hybridrl.utils.determinism import enable_full_determinism
from hybridrl.models.checkpoint import (load_sharded_model_state, save_hf_config_and_tokenizer,
                                        save_sharded_model_state)
from hybridrl.models.fsdp_utils import build_lr_scheduler, build_optimizer, fsdp_root, hf_module, shard_model
from hybridrl.models.memory import memory_metrics
from hybridrl.models.offload import FSDPOffload
from hybridrl.models.spec import ModelSpec
from hybridrl.utils.import_utils import load_extensions
from hybridrl.workers.actor.dp_actor import DataParallelPPOActor
from hybridrl.workers.rollout import build_rollout, load_rollout_class
from hybridrl.workers.rollout.engine_load import EngineLoad
from hybridrl.workers.rollout.mode_switch import RolloutModeSwitch
from hybridrl.workers.rollout.request_seeds import FIRST_ROW_KEY
from hybridrl.workers.weight_transfer_worker import WeightTransferMixin

ROLES = ("actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref", "actor_ref")


class ActorRolloutRefWorker(Worker, WeightTransferMixin):
    def __init__(self, config, model_spec: ModelSpec, role: str, seed: int = 0, device: str | None = None,
                 extensions: list[str] = (), total_training_steps: int | None = None, tokenizer=None,
                 engine_load: EngineLoad | None = None):
        """config: the `actor_rollout_ref` section (how to train, sample and shard). model_spec: the policy model,
        resolved by the controller (models/spec.policy_model_spec); the rollout engines load its path.
        seed: `trainer.seed`; torch's global RNG starts at seed + rank, so sampling is reproducible yet two ranks
        given the same prompt sample different responses (weights missing from a checkpoint use `seed` alone, see load_hf_model). device:
        "cuda" or "cpu" (default: cuda when visible). extensions: modules / .py files to import first.
        total_training_steps: the run length the trainer computed, for the actor's LR schedule (None: only
        a schedule that needs no run length can be built). tokenizer: the run's policy tokenizer, resolved by the
        controller (utils/tokenizer.py), written next to every checkpoint; an actor built without it cannot save.
        engine_load: the sequences the schedule decodes on one rollout engine at once, computed by the controller
        (rollout/engine_load.py); the engine captures CUDA graphs up to it."""
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"ActorRolloutRefWorker: role must be one of {list(ROLES)}, got {role!r}")
        self.config = config
        self.model_spec = model_spec
        self.role = role
        self.device = device or device_name()
        self._is_actor = role in ("actor", "actor_rollout", "actor_rollout_ref", "actor_ref")
        self._is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
        self._is_ref = role in ("ref", "actor_rollout_ref", "actor_ref")
        load_extensions(list(extensions))
        if self._wants_full_determinism():  # before the process group: NCCL reads its settings at start
            enable_full_determinism(seed + self.rank)
        init_process_group_once("nccl" if self.device == "cuda" else "gloo")
        self.seed = seed
        self.total_training_steps = total_training_steps
        self.tokenizer = tokenizer
        self.engine_load = engine_load
        torch.manual_seed(seed + self.rank)
        # The policy version of the actor's weights: training steps whose update produced them (+1 per update_actor;
        # a checkpoint's load sets its step's). The engine server reports it with every answer, the one source of the
        # per-token versions (data/batch_layout.py); the mode switch pushes the weights into an engine only when
        # the engine holds another version.
        self.weights_version = 0
        self.engine_server = None  # this rank's engine server, where they run (start_engine_server)

    def _wants_full_determinism(self) -> bool:
        """Whether a role this process holds asks for deterministic kernels (its fsdp_config.full_determinism, the
        rollout's full_determinism); the setting is per process, so one role's key covers the roles colocated with it."""
        config = self.config
        return ((self._is_actor and config.actor.fsdp_config.full_determinism)
                or (self._is_ref and config.ref.fsdp_config.full_determinism)
                or (self._is_rollout and config.rollout.full_determinism))

    # ------------------------------------------------------------------ set-up
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load and shard the models this role needs; build the optimizer, schedule and rollout engine."""
        actor, model = self.config.actor, self.model_spec
        # A rollout-only worker whose engine keeps its own copy (sglang) needs no FSDP model: weights arrive
        # over the weight-transfer group straight into the engine.
        self.actor_module = None
        if self._is_actor or (self._is_rollout and load_rollout_class(self.config.rollout).shares_trainer_weights):
            self.actor_module = self._load_and_shard(actor.strategy, torch.float32,
                                                     actor.fsdp_config.reshard_after_forward,
                                                     cpu_offload=actor.fsdp_config.offload_policy,
                                                     forward_prefetch=actor.fsdp_config.forward_prefetch,
                                                     with_lora=self._is_actor)
        if self._is_actor:
            self.actor_optimizer = build_optimizer(self.actor_module, actor.optim)
            self.actor_lr_scheduler = build_lr_scheduler(self.actor_optimizer, actor.optim, self.total_training_steps)
            rollout = self.config.rollout
            self.actor = DataParallelPPOActor(
                actor, self.actor_module, self.actor_optimizer, rollout_n=rollout.n, device=self.device,
                log_prob_micro_batch_size=(rollout.log_prob_micro_batch_size_per_gpu
                                           or actor.ppo_micro_batch_size_per_gpu),
                log_prob_max_token_len=(rollout.log_prob_max_token_len_per_gpu if rollout.log_prob_use_dynamic_bsz
                                        else None),
                use_remove_padding=model.use_remove_padding, use_fused_kernels=model.use_fused_kernels,
                gradient_checkpointing=model.gradient_checkpointing)
        if self.actor_module is not None:
            self.actor_offload = FSDPOffload(self.actor_module, getattr(self, "actor_optimizer", None),
                                             param_offload=actor.fsdp_config.param_offload,
                                             optimizer_offload=actor.fsdp_config.optimizer_offload and self._is_actor,
                                             device=self.device)
        elif self._is_rollout:
            self.actor_offload = FSDPOffload(None, param_offload=False, optimizer_offload=False, device=self.device)
        if self._is_rollout:
            module = None if self.actor_module is None else fsdp_root(self.actor_module)
            self.rollout = build_rollout(self.config.rollout, model, module, engine_load=self.engine_load)
            self.mode_switch = RolloutModeSwitch(self.actor_module, self.rollout, trainer_state=self.actor_offload)
        if self._is_ref:
            ref = self.config.ref
            self.ref_policy = DataParallelPPOActor(
                ref, self._reference_module(), None, device=self.device,
                log_prob_micro_batch_size=ref.log_prob_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu,
                log_prob_max_token_len=ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz else None,
                use_remove_padding=model.use_remove_padding, use_fused_kernels=model.use_fused_kernels)
        self._park_offloaded_state()

    def _park_offloaded_state(self) -> None:
        """Park what fsdp_config.param_offload / optimizer_offload name (models/offload.py) in CPU memory until a
        phase needs it. The LoRA reference is the actor's own module, so it follows the actor's rules."""
        if self._is_actor or self._is_rollout:
            self.actor_offload.park()
        if self._is_ref and self.model_spec.lora is not None:
            self.ref_offload = self.actor_offload
        elif self._is_ref:
            self.ref_offload = FSDPOffload(self.ref_policy.actor_module,
                                           param_offload=self.config.ref.fsdp_config.param_offload,
                                           optimizer_offload=False, device=self.device)
            self.ref_offload.park()

    def _reference_module(self):
        """The frozen initial policy. With LoRA it is the actor's own module, run with its adapters disabled
        (see `_adapters_disabled`), so no second copy of the weights exists; otherwise a frozen sharded copy."""
        if self.model_spec.lora is not None:
            self._require(self._is_actor, "a LoRA reference policy (the actor with adapters disabled)", "actor")
            return self.actor_module
        ref = self.config.ref
        # On a GPU the frozen copy is kept in bf16 (it only ever computes in bf16); on CPU in fp32.
        ref_dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        ref_module = self._load_and_shard(ref.strategy, ref_dtype, ref.fsdp_config.reshard_after_forward,
                                          cpu_offload=False, with_lora=False,
                                          forward_prefetch=ref.fsdp_config.forward_prefetch)
        ref_module.requires_grad_(False)
        return ref_module

    def _adapters_disabled(self):
        """A context in which the LoRA actor computes as its base model (a no-op without LoRA)."""
        if self.model_spec.lora is not None:
            return hf_module(self.actor_module).disable_adapter()
        return contextlib.nullcontext()

    def _load_and_shard(self, strategy: str, dtype: torch.dtype, reshard_after_forward: bool, cpu_offload: bool,
                        with_lora: bool = True, forward_prefetch: bool = False):
        """The policy model (the spec's, with LoRA adapters when with_lora and the spec has LoRA), sharded over the
        ranks (see fsdp_utils.shard_model)."""
        module = self.model_spec.load(dtype=dtype, device=self.device, init_seed=self.seed, with_lora=with_lora)
        return shard_model(module, strategy=strategy, device=self.device, mixed_precision=self.device == "cuda",
                           reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload,
                           forward_prefetch=forward_prefetch)

    # ------------------------------------------------------------------ mode switches
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_mode(self) -> dict[str, float]:
        """Trainer mode -> rollout mode: the engine resumes its memory and holds the actor's current weights;
        in rollout.mode=async its engine server then starts answering. Returns this rank's timing_s/<part> metrics
        (resume_weights, update_weights, offload_trainer, resume_kv_cache, the engine's own, reload_actor when
        parked parameters came back)."""
        self._require(self._is_rollout, "rollout_mode", "rollout")
        metrics = self.mode_switch.rollout_mode(self.weights_version)
        if self.engine_server is not None:  # serves only with the weights in place
            self.engine_server.serve(self.weights_version)
        return {**metrics, **self.actor_offload.take_timing("actor")}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def trainer_mode(self) -> dict[str, float]:
        """Rollout mode -> trainer mode: in rollout.mode=async the engine server first stops answering (requests
        wait for the next rollout mode); the engine releases its memory. Returns this rank's timing_s/<part>
        metrics (release_engine, the engine's own, offload_actor) and, in rollout.mode=async, what its server saw in
        the rollout window (async_server.window_metrics)."""
        self._require(self._is_rollout, "trainer_mode", "rollout")
        served = self.engine_server.pause() if self.engine_server is not None else {}
        metrics = self.mode_switch.trainer_mode()
        return {**served, **metrics, **self.actor_offload.take_timing("actor")}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_engine_server(self, eos_token_ids: list[int], pad_token_id: int) -> str | None:
        """With engine servers (rollout.mode=async, or the data flow in any mode): start this rank's engine server
        (rollout/async_server.py), answering only between rollout_mode and trainer_mode; returns its "host:port", or
        None on a rank of a tensor-parallel group whose engine another rank serves."""
        self._require(self._is_rollout, "start_engine_server", "rollout")
        import ray

        from hybridrl.workers.rollout.async_server import build_engine_server

        module = None if self.actor_module is None else fsdp_root(self.actor_module)
        self.engine_server = build_engine_server(self.rollout, self.config.rollout, module,
                                                 list(eos_token_ids), int(pad_token_id),
                                                 host=ray.util.get_node_ip_address())
        return None if self.engine_server is None else self.engine_server.address

    # ------------------------------------------------------------------ data methods
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """One response per prompt row: adds prompts, responses, input_ids, attention_mask, position_ids,
        response_mask (and rollout_log_probs with rollout.calculate_log_probs). Only in rollout mode."""
        self._require(self._is_rollout, "generate_sequences", "rollout")
        if not self.mode_switch.in_rollout_mode:
            raise RuntimeError("generate_sequences: the worker is in trainer mode; call rollout_mode() first "
                               "(and trainer_mode() after the last generation)")
        prompts.meta_info[FIRST_ROW_KEY] = self.rank * len(prompts)  # DP_COMPUTE_PROTO: equal chunks in rank order
        return self.rollout.generate_sequences(prompts)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """The current policy's log-probs of the responses: adds old_log_probs and entropys (per token)."""
        self._require(self._is_actor, "compute_log_prob", "actor")
        self._require_trainer_mode("compute_log_prob")
        with self.actor_offload.loaded():
            started = time.perf_counter()
            log_probs, entropys = self.actor.compute_log_prob(self._at_rollout_temperature(data),
                                                              calculate_entropy=True)
            seconds = time.perf_counter() - started
        output = DataProto.from_dict({"old_log_probs": log_probs, "entropys": entropys})
        output.meta_info["metrics"] = {**self._mfu("actor_infer", data, seconds, passes=1),
                                       **self.actor_offload.take_timing("actor")}
        return output

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """The reference policy's log-probs of the responses: adds ref_log_prob."""
        self._require(self._is_ref, "compute_ref_log_prob", "ref")
        self._require_trainer_mode("compute_ref_log_prob")
        with self.ref_offload.loaded(), self._adapters_disabled():
            started = time.perf_counter()
            log_probs, _ = self.ref_policy.compute_log_prob(self._at_rollout_temperature(data))
            seconds = time.perf_counter() - started
        output = DataProto.from_dict({"ref_log_prob": log_probs})
        output.meta_info["metrics"] = {**self._mfu("ref", data, seconds, passes=1), **self.ref_offload.take_timing("ref")}
        return output

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """One PPO update (all mini-batches and epochs), then one LR-schedule step.

        Returns no rows, only meta_info["metrics"]: actor/pg_loss, actor/pg_clipfrac, actor/ppo_kl,
        actor/pg_clipfrac_lower (vanilla loss), actor/entropy, actor/kl_loss and actor/kl_coef (with
        use_kl_loss), actor/grad_norm — one value per mini-batch step, already averaged over the
        ranks — and actor/lr, the learning rate this update used; perf/mfu/actor, the memory peaks since
        the previous update (perf/max_memory_*_gb) and the offload/reload times.
        """
        self._require(self._is_actor, "update_actor", "actor")
        self._require_trainer_mode("update_actor")
        with self.actor_offload.loaded(optimizer=True):
            started = time.perf_counter()
            metrics = self.actor.update_policy(self._at_rollout_temperature(data))
            seconds = time.perf_counter() - started
        metrics.update(self._mfu("actor", data, seconds, passes=3 * self.config.actor.ppo_epochs))
        engine_bytes = self.rollout.allocator_bytes if self._is_rollout else 0  # an in-process engine's own tensors
        metrics.update(memory_metrics(self.device, engine_bytes=engine_bytes))
        metrics.update(self.actor_offload.take_timing("actor"))
        metrics["actor/lr"] = self.actor_lr_scheduler.get_last_lr()[0]
        self.actor_lr_scheduler.step()
        self.weights_version += 1
        return DataProto(meta_info={"metrics": metrics})

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str) -> None:
        """Write this rank's shards of the actor (actor.checkpoint.save_contents: model, optimizer, extra = LR
        schedule + RNG) into local_path; rank 0 also writes the HF config and tokenizer to local_path/huggingface
        for the model merger. Every rank must be called (ONE_TO_ALL): the save is a collective."""
        self._require(self._is_actor, "save_checkpoint", "actor")
        self._require_trainer_mode("save_checkpoint")
        if self.tokenizer is None:
            raise ValueError("save_checkpoint: this worker was built without the policy tokenizer to write next to "
                             "the weights; pass the controller's (ActorRolloutRefWorker(..., tokenizer=...))")
        with self.actor_offload.loaded(optimizer=True):  # DCP reads the shards where training keeps them
            save_sharded_model_state(self.actor_module, self.actor_optimizer, self.actor_lr_scheduler, local_path,
                                     self.rank, list(self.config.actor.checkpoint.save_contents))
        if self.rank == 0:
            model = hf_module(self.actor_module)
            save_hf_config_and_tokenizer(local_path, model.config, self.tokenizer, model.generation_config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, weights_version: int) -> None:
        """Load what save_checkpoint wrote (actor.checkpoint.load_contents); a checkpoint from another world size
        is resharded, its RNG states are then not restored (see models/checkpoint.py). `weights_version`: the
        version of the loaded weights (the updates the checkpointed run had made), so that a resumed run's engines
        report the versions an uninterrupted run's would."""
        self._require(self._is_actor, "load_checkpoint", "actor")
        self._require_trainer_mode("load_checkpoint")
        with self.actor_offload.loaded(optimizer=True):  # loaded state lands on the device, then is parked
            load_sharded_model_state(self.actor_module, self.actor_optimizer, self.actor_lr_scheduler, local_path,
                                     self.rank, list(self.config.actor.checkpoint.load_contents))
        self.weights_version = weights_version
        if self._is_rollout:  # whatever the engine holds, it is not known to be what was just loaded: push it
            self.mode_switch.engine_weights_version = None

    # ------------------------------------------------------------------ helpers
    def _at_rollout_temperature(self, data: DataProto) -> DataProto:
        """`data` (same tensors) with meta_info["temperature"] = rollout.temperature."""
        return DataProto(data.batch, data.non_tensor_batch, {**data.meta_info,
                                                             "temperature": self.config.rollout.temperature})

    def _mfu(self, name: str, data: DataProto, seconds: float, passes: float) -> dict[str, float]:
        """perf/mfu/<name> over all ranks for `passes` forward-equivalents of this rank's rows (none on a CPU)."""
        seqlens = data.batch["attention_mask"].sum(-1).tolist()
        mfu = model_flops_utilization(hf_module(self.actor_module).config, seqlens, seconds, self.device, passes)
        return {} if mfu is None else {f"perf/mfu/{name}": mfu}

    def _require_trainer_mode(self, method: str) -> None:
        """Training and scoring run in trainer mode: in rollout mode the engine holds the memory (and the hf
        engine holds the actor gathered, in eval mode)."""
        if self._is_rollout and self.mode_switch.in_rollout_mode:
            raise RuntimeError(f"{method}: the worker is in rollout mode; call trainer_mode() first")

    def _require(self, present: bool, method: str, part: str) -> None:
        if not present:
            raise RuntimeError(f"{method} needs the {part} part, but this worker's role is {self.role!r}")
