"""Config checks of the trainer, registered with hybridrl.config.checks: loggers, resuming, the placement and
schedule of generation, evaluation sets; before the start the checkpoint to resume from (its model, files and batch
layout: resume_checks.py) and the run directory
(created and test-written here); and a warning when the checkpoints the run keeps will not fit in the free space."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from hybridrl.config.checks import Values, register_check
from hybridrl.config.schema import PPOConfig
from hybridrl.data.config_checks import usable_train_rows
from hybridrl.models.config_checks import parameter_counts
from hybridrl.trainer.resume_checks import (checkpoint_checked, checkpoint_problems, layout_warnings,
                                            resume_path_problems)
from hybridrl.utils.disk import free_bytes, human_bytes


# Checkpoint bytes per model parameter, by what checkpoint.save_contents holds: the actor and critic train fp32
# weights, and AdamW keeps two fp32 moments per trainable parameter. "extra" (LR schedule, RNG) is a few KiB.
CHECKPOINT_BYTES_PER_PARAMETER = {"model": 4, "optimizer": 8, "extra": 0}


@register_check()
def _check_loggers(values: Values, problems: list[str]) -> None:
    from hybridrl.trainer.tracking import VALID_LOGGERS

    loggers = values("trainer.logger")
    for index, logger in enumerate(loggers):
        if logger not in VALID_LOGGERS:
            problems.append(f"trainer.logger[{index}]: expected one of {sorted(VALID_LOGGERS)}, got {logger!r}")


@register_check()
def _resume_path_given(values: Values, problems: list[str]) -> None:
    if values("trainer.resume_mode") == "resume_path" and values("trainer.resume_from_path") is None:
        problems.append("trainer.resume_from_path: expected a checkpoint directory when "
                        "trainer.resume_mode='resume_path', got None")


@register_check()
def _placement_and_schedule(values: Values, problems: list[str]) -> None:
    """hybrid_engine=false puts the rollout on its own pool, where it serves agent loops (rollout.mode=async);
    an overlapping schedule (async_training.mode) needs that separate pool, and generates ahead of the update."""
    schedule = values("async_training.mode")
    if values("actor_rollout_ref.hybrid_engine"):
        if schedule != "sync":
            problems.append(f"async_training.mode: expected 'sync' with actor_rollout_ref.hybrid_engine=true "
                            f"(generation overlaps training only on separate pools: set "
                            f"actor_rollout_ref.hybrid_engine=false and rollout.n_gpus_per_node), got {schedule!r}")
        return
    if values("actor_rollout_ref.rollout.mode") != "async":
        problems.append("actor_rollout_ref.rollout.mode: expected 'async' with actor_rollout_ref.hybrid_engine=false "
                        "(the rollout pool's ranks are engine servers that agent loops call), got "
                        f"{values('actor_rollout_ref.rollout.mode')!r}")


@register_check()
def _eval_sets_settings(values: Values, problems: list[str]) -> None:
    """Each named eval set is well formed (trainer/ppo/evaluation.py); validating needs something to validate."""
    entries = values("data.eval_sets")
    if entries:
        from hybridrl.trainer.ppo.evaluation import eval_set_problems

        problems += eval_set_problems(entries, values("actor_rollout_ref.rollout.response_length"))
    validates = values("trainer.val_before_train") or values("trainer.test_freq") > 0
    if validates and not entries and not values("data.val_files"):
        problems.append("data.val_files: expected at least one .parquet file when the run validates "
                        "(trainer.val_before_train or trainer.test_freq > 0) and data.eval_sets is empty, got []")


@register_check()
def _summary_metric_is_logged(values: Values, problems: list[str]) -> None:
    """trainer.summary_metric must be a metric a validation logs (trainer/ppo/evaluation.py); whether a val-core/ or
    val-aux/ name is logged shows at the first validation, which names the ones it has. (A run that does not validate
    writes None, as it does without the key.)"""
    metric = values("trainer.summary_metric")
    if metric is None:
        return
    set_names = sorted(entry["name"] for entry in values("data.eval_sets")
                       if isinstance(entry, dict) and isinstance(entry.get("name"), str))
    prefix, _, rest = metric.partition("/")
    eval_set = rest.split("/")[0].removesuffix("-truncated_ratio")
    if not (prefix in ("val-core", "val-aux") and rest or prefix == "eval" and eval_set in set_names):
        problems.append(f"trainer.summary_metric: expected a validation metric, val-core/..., val-aux/... or "
                        f"eval/<a name of data.eval_sets: {set_names}>[/...], got {metric!r}")


@register_check("paths")
def _resume_checkpoint_exists(config: PPOConfig, problems: list[str]) -> None:
    if config.trainer.resume_mode == "resume_path" and not os.path.isdir(config.trainer.resume_from_path):
        problems.append(f"trainer.resume_from_path: expected an existing checkpoint directory, "
                        f"got {config.trainer.resume_from_path!r}")


@register_check("preflight")
def _check_resume_checkpoint(config: PPOConfig, problems: list[str]) -> None:
    """The checkpoint resume_mode picks belongs to this model, is complete and has this batch layout
    (resume_checks.py)."""
    problems += resume_path_problems(config)
    step_dir = checkpoint_checked(config)
    if step_dir is not None:
        problems += checkpoint_problems(config, step_dir)


@register_check("warnings")
def _resume_layout_accepted(config: PPOConfig) -> list[str]:
    step_dir = checkpoint_checked(config)
    return [] if step_dir is None else layout_warnings(config, step_dir)


@register_check("preflight")
def _check_run_dir(config: PPOConfig, problems: list[str]) -> None:
    """Create trainer.default_local_dir and write, flush and remove a small file in it, as the first checkpoint
    would."""
    path = config.trainer.default_local_dir
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_test_") as probe:
            probe.write(b"hybridrl")
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as err:
        problems.append(f"trainer.default_local_dir: expected a directory this process can create and write "
                        f"(checkpoints, metrics and summary.json go there), got {path!r} ({err})")


@register_check("warnings")
def _disk_space(config: PPOConfig) -> list[str]:
    return _disk_space_warnings(config, usable_train_rows(config), parameter_counts(config))


@dataclass
class _SavedRole:
    """One model a checkpoint holds (the actor, the critic) and how many of its checkpoints are kept."""
    model_key: str
    parameters: int | None  # None: not read from safetensors, so its size is unknown
    bytes_per_parameter: int
    keep_key: str
    keep: int | None  # None keeps all (verl's default)

    @property
    def checkpoint_bytes(self) -> int:
        return self.parameters * self.bytes_per_parameter

    def held_at_once(self, saves: int) -> int:
        """A save is published before the old ones are pruned: keep + 1 exist for a moment."""
        return saves if self.keep is None else min(saves, self.keep + 1)


def _disk_space_warnings(config: PPOConfig, train_rows: int | None, parameters: dict[str, int | None]) -> list[str]:
    """Warn when one checkpoint, or all the checkpoints the run holds at once, will not fit in the free space."""
    trainer = config.trainer
    roles = _saved_roles(config, parameters)
    if trainer.save_freq <= 0 or any(role.parameters is None for role in roles):
        return []
    path, free = trainer.default_local_dir, free_bytes(trainer.default_local_dir)
    one = sum(role.checkpoint_bytes for role in roles)
    if one > free:
        sizes = "; ".join(f"{role.model_key}: {role.parameters / 1e6:.2f}M parameters x {role.bytes_per_parameter} B"
                          for role in roles)
        return [f"trainer.default_local_dir: one checkpoint needs about {human_bytes(one)} ({sizes}), but {path!r} "
                f"has {human_bytes(free)} free: the first save (step {trainer.save_freq}) will fail"]
    saves = _number_of_saves(config, train_rows)
    if saves is None:
        return []
    peak = sum(role.held_at_once(saves) * role.checkpoint_bytes for role in roles)
    if peak <= free:
        return []
    keeps = ", ".join(f"{role.keep_key}={'null: all' if role.keep is None else role.keep}" for role in roles)
    return [f"trainer.default_local_dir: this run saves {saves} checkpoints (trainer.save_freq={trainer.save_freq}) "
            f"and holds up to {max(role.held_at_once(saves) for role in roles)} at once ({keeps}), about "
            f"{human_bytes(peak)} at {human_bytes(one)} each, but {path!r} has {human_bytes(free)} free; lower "
            f"{' and '.join(role.keep_key for role in roles)} or free space, or saves will fail with 'No space left "
            f"on device'"]


def _saved_roles(config: PPOConfig, parameters: dict[str, int | None]) -> list[_SavedRole]:
    actor, critic, trainer = config.actor_rollout_ref, config.critic, config.trainer
    roles = [_SavedRole("actor_rollout_ref.model.path", parameters.get("actor_rollout_ref.model.path"),
                        _bytes_per_parameter(actor.actor.checkpoint.save_contents, actor.model.lora_rank),
                        "trainer.max_actor_ckpt_to_keep", trainer.max_actor_ckpt_to_keep)]
    if critic.enable:
        roles.append(_SavedRole("critic.model.path", parameters.get("critic.model.path"),
                                _bytes_per_parameter(critic.checkpoint.save_contents, critic.model.lora_rank),
                                "trainer.max_critic_ckpt_to_keep", trainer.max_critic_ckpt_to_keep))
    return roles


def _bytes_per_parameter(save_contents: list[str], lora_rank: int) -> int:
    """Under LoRA the optimizer holds only the adapters' moments: not counted."""
    return sum(CHECKPOINT_BYTES_PER_PARAMETER[content] for content in save_contents
               if not (content == "optimizer" and lora_rank > 0))


def _number_of_saves(config: PPOConfig, train_rows: int | None) -> int | None:
    """Saves every save_freq steps and at the last step; None when the number of steps depends on unknown rows."""
    trainer = config.trainer
    steps = trainer.total_training_steps
    if steps is None:
        if train_rows is None:
            return None
        steps = train_rows // config.data.train_batch_size * trainer.total_epochs
    return steps // trainer.save_freq + (1 if steps % trainer.save_freq else 0)
