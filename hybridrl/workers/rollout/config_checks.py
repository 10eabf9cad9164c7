"""Config checks of the rollout engines, registered with hybridrl.config.checks: the engine is registered and
installed (and has a GPU), tensor parallelism divides the world and the attention heads and runs where it is built,
engine_kwargs leave the keys the config sets alone, rollout.custom_cls.path exists, and (a warning) the schedule puts
no more sequences on one engine at once than rollout.max_num_seqs. An engine's own package (sglang, vllm) is never
imported here: the driver process must not load it."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os

from hybridrl.config.checks import Values, expect_file, register_check, register_registry
from hybridrl.config.schema import PPOConfig
from hybridrl.data.route import data_flow_switch, engine_servers_switch
from hybridrl.models.config_checks import INSTALL_GPU_EXTRAS, cuda_available
from hybridrl.workers.rollout.engine_load import engine_load


# Rollout engines that need a CUDA GPU: name -> how to install the package of the same name.
GPU_ENGINES = {"sglang": INSTALL_GPU_EXTRAS,
               "vllm": "pip install -e '.[vllm]'; offline GPU host: scripts/gpu/install_vllm.sh"}


def _known_rollout(name: str) -> None:
    """Like get_rollout_class, minus importing the engine (sglang, vllm) into the driver process:
    whether the engine can run here is `_engine_available`'s question."""
    from hybridrl.workers.rollout import BUILTIN_ROLLOUT_MODULES, ROLLOUT_REGISTRY

    known = set(ROLLOUT_REGISTRY) | set(BUILTIN_ROLLOUT_MODULES)
    if name not in known:
        raise ValueError(f"rollout.name={name!r} is not a registered rollout; known: {sorted(known)}")


register_registry("actor_rollout_ref.rollout.name", _known_rollout)


@register_check()
def _engine_available(values: Values, problems: list[str]) -> None:
    """sglang / vllm must be importable; CUDA is required up front only for a local Ray, because a driver
    joining a cluster (`ray_init.address`) may itself have no GPU (the trainer then checks the cluster)."""
    device, rollout = values("trainer.device"), values("actor_rollout_ref.rollout.name")
    if rollout in GPU_ENGINES and importlib.util.find_spec(rollout) is None:
        problems.append(f"actor_rollout_ref.rollout.name: expected a rollout whose engine is installed, got "
                        f"{rollout!r} (the {rollout} package is not importable: {GPU_ENGINES[rollout]})")
    if values("ray_init.address") is not None:
        return
    if device == "cuda" and not cuda_available():
        problems.append("trainer.device: expected 'cpu' or 'auto' on this machine (torch sees no CUDA GPU), "
                        "got 'cuda'")
    if rollout in GPU_ENGINES and (device == "cpu" or not cuda_available()):
        problems.append(f"actor_rollout_ref.rollout.name: expected 'hf' without a GPU (trainer.device={device!r}, "
                        f"CUDA available: {cuda_available()}), got {rollout!r} ({rollout} needs a CUDA GPU)")


@register_check()
def _tensor_parallel_divides(values: Values, problems: list[str]) -> None:
    """The engines' groups split the pool that holds the rollout: the trainer's (colocated) or its own."""
    pool = "trainer" if values("actor_rollout_ref.hybrid_engine") else "rollout"
    world = values(f"{pool}.nnodes") * values(f"{pool}.n_gpus_per_node")
    tp = values("actor_rollout_ref.rollout.tensor_model_parallel_size")
    if world % tp:
        problems.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size: expected a divisor of the world "
                        f"size {pool}.nnodes * {pool}.n_gpus_per_node = {world}, got {tp}")


@register_check()
def _tensor_parallel_engines_built(values: Values, problems: list[str]) -> None:
    """Where an engine spans tensor_model_parallel_size GPUs: sglang everywhere (one engine per group of ranks,
    rollout/tensor_parallel.py; in rollout.mode=async the group's leader serves it, async_server.build_engine_server,
    colocated or on the rollout pool), vllm in rollout.mode=sync (each rank its shard, stepping together on the same
    prompts, vllm_rollout.py: an engine server answers requests as they arrive on one rank, so its followers would
    have nothing to step with; the data flow runs on engine servers in rollout.mode=sync too)."""
    tp = values("actor_rollout_ref.rollout.tensor_model_parallel_size")
    servers = engine_servers_switch(values("actor_rollout_ref.rollout.mode"),
                                    values("data_flow.custom_generate_function")["name"])
    if values("actor_rollout_ref.rollout.name") == "vllm" and tp > 1 and servers is not None:
        problems.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size: expected 1 with "
                        f"actor_rollout_ref.rollout.name=vllm and {servers} (each rank holds a shard of vLLM's engine "
                        f"and all of them step together on the same prompts; an engine server takes requests on one "
                        f"rank as they arrive: use rollout.mode=sync, or rollout.name=sglang, "
                        f"whose tensor-parallel engine one rank serves), got {tp}")


# The engines that take a seed per request (rollout/request_seeds.py says how each does).
SEEDED_ENGINES = ("hf", "sglang", "vllm")


@register_check()
def _full_determinism_covered(values: Values, problems: list[str]) -> None:
    """rollout.full_determinism promises two runs of one config bitwise-equal metrics: refused, with the reason, where
    the run's generation is not made reproducible (README "Reproducibility")."""
    if not values("actor_rollout_ref.rollout.full_determinism"):
        return
    key = "actor_rollout_ref.rollout.full_determinism"
    name = values("actor_rollout_ref.rollout.name")
    if name not in SEEDED_ENGINES or values("actor_rollout_ref.rollout.custom_cls.path") is not None:
        problems.append(f"{key}: expected rollout.name in {list(SEEDED_ENGINES)} without rollout.custom_cls (the "
                        f"engines that take a seed per request), got rollout.name={name!r}")
    if values("actor_rollout_ref.rollout.tensor_model_parallel_size") > 1:
        problems.append(f"{key}: expected rollout.tensor_model_parallel_size=1 (a tensor-parallel group generates the "
                        f"prompts its ranks gather, whose request seeds are not carried with them), got "
                        f"{values('actor_rollout_ref.rollout.tensor_model_parallel_size')}")
    if not values("actor_rollout_ref.hybrid_engine"):
        problems.append(f"{key}: expected actor_rollout_ref.hybrid_engine=true (the rollout on its own pool is not "
                        f"shown bitwise-reproducible yet), got false")
    switch = data_flow_switch(values("data_flow.enable"), values("algorithm.filter_groups.enable"),
                              values("async_training.mode"))
    if switch is not None:
        problems.append(f"{key}: expected the data flow's features off (buffer, dynamic sampling, over-sampling, "
                        f"partial rollout, async schedules), got {switch} (with them the groups a step trains are "
                        f"the first to finish, the stragglers aborted and buffered: which samples make a batch, and "
                        f"under an async schedule which weights generate them, depends on timing)")


@register_check()
def _engine_kwargs_leave_config_keys_alone(values: Values, problems: list[str]) -> None:
    """rollout.engine_kwargs.<engine> adds engine arguments; one that a rollout key sets is refused up front (the
    engine would refuse it at start, on every worker)."""
    rollout = values("actor_rollout_ref.rollout.name")
    if rollout not in GPU_ENGINES:
        return
    extra = values(f"actor_rollout_ref.rollout.engine_kwargs.{rollout}") or {}
    module = importlib.import_module(f"hybridrl.workers.rollout.{rollout}_rollout")  # imports torch, not the engine
    owned = module.CONFIG_OWNED_ENGINE_KWARGS
    for key in sorted(set(extra) & set(owned)):
        problems.append(f"actor_rollout_ref.rollout.engine_kwargs.{rollout}.{key}: expected to be unset (set it "
                        f"through {owned[key]}), got {extra[key]!r}")


@register_check("paths")
def _custom_rollout_file_exists(config: PPOConfig, problems: list[str]) -> None:
    path = config.actor_rollout_ref.rollout.custom_cls.path
    if path is not None:
        expect_file("actor_rollout_ref.rollout.custom_cls.path", path, ".py", problems)


@register_check("preflight")
def _check_tensor_parallel_heads(config: PPOConfig, problems: list[str]) -> None:
    """A tensor-parallel engine splits the attention heads over its GPUs: their count must divide by the size
    (the engine would refuse at start, on every rank, after the trainer had loaded)."""
    tp = config.actor_rollout_ref.rollout.tensor_model_parallel_size
    path = os.path.join(config.actor_rollout_ref.model.path, "config.json")
    if tp == 1 or config.actor_rollout_ref.rollout.name == "hf" or not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            model = json.load(f)
        heads = model.get("text_config", model)["num_attention_heads"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # models/config_checks.py reports an unreadable config.json
    if heads % tp:
        problems.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size: expected a divisor of the model's "
                        f"num_attention_heads ({heads}, {path}), got {tp}")


@register_check("warnings")
def _engine_load_fits_max_num_seqs(config: PPOConfig) -> list[str]:
    """The engines run at most rollout.max_num_seqs sequences at once (sglang's max_running_requests, vllm's
    max_num_seqs, the hf engine server's batch); more in flight on one engine queue and wait for a free slot.
    The validation sets' sizes are not read here: only data.val_batch_size counts (rollout/engine_load.py)."""
    data, rollout = config.data, config.actor_rollout_ref.rollout
    servers = engine_servers_switch(rollout.mode, config.data_flow.custom_generate_function.name)
    if rollout.name not in GPU_ENGINES and servers is None:
        return []  # the hf rollout's batch call generates every row of its rank at once
    load = engine_load(config, [(data.val_batch_size, rollout.val_kwargs.n)] if data.val_batch_size else [])
    if load.peak <= rollout.max_num_seqs:
        return []
    return [f"actor_rollout_ref.rollout.max_num_seqs={rollout.max_num_seqs} is below the {load.peak} sequences the "
            f"schedule puts on one engine at once ({load.why}; data.train_batch_size={data.train_batch_size}, "
            f"actor_rollout_ref.rollout.n={rollout.n}): the rest queue until a sequence finishes; raise "
            f"actor_rollout_ref.rollout.max_num_seqs to {load.peak} to run them together"]
