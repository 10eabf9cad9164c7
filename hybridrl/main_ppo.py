"""Entry point: `python -m hybridrl.main_ppo [group=choice] [a.b=c] [+x.y=z]` trains with PPO/GRPO.

Groups are chosen as Hydra does it: `algorithm=gae`; the groups placed under actor_rollout_ref are
named with their package, `actor@actor_rollout_ref.actor=dp_actor` (likewise rollout@..., ref@...).

Wiring only: Hydra composes hybridrl/config/ppo_trainer.yaml with the command-line overrides,
`validate_config` turns it into a typed PPOConfig, `check_before_start` checks the files, models,
resources and run directory it names (either prints one `config error:` line per problem and exits
with code 2), then `run_ppo` starts Ray and hands the config to a TaskRunner actor, which builds the
trainer. A failure after that prints one `run error: <type>: <message>` line, the exception where it was raised
(a worker's, not Ray's wrapper), then that traceback once, and exits with code 1 (config/cli_errors.py).
`--cfg job` prints the composed config and starts nothing.

Without `ray_init.address` the driver starts a Ray cluster of this machine alone, on 127.0.0.1, that dies with it
(single_controller/local_cluster.py). SIGTERM and SIGINT stop the run as `trainer.stop_on_signal` says and exit with
143 / 130 (trainer/run_control.py). Ray is imported only once the driver's process is set up for that.

Your own YAML on top of ours, e.g. my_configs/my_run.yaml:

    hydra:
      searchpath:
        - pkg://hybridrl.config      # where Hydra finds ppo_trainer and its groups (needed with --config-path)
    defaults:
      - ppo_trainer                  # everything from hybridrl's config ...
      - override algorithm: gae      # ... with other group choices ("override" is required) ...
      - _self_                       # ... and then the keys below win
    data:
      train_batch_size: 32
    actor_rollout_ref:
      actor:
        optim:
          lr: 1e-6

Run it with either
    python -m hybridrl.main_ppo --config-path /abs/my_configs --config-name my_run [overrides...]
        (Hydra reads a relative --config-path from the hybridrl/ folder: give it absolute), or
    python -m hybridrl.main_ppo --config-dir my_configs --config-name my_run [overrides...]
        (relative to the current directory; works even without the `hydra: searchpath` lines).
The compose API takes the same file (searchpath lines included):
`compose_config(config_name="my_run", config_dir="/abs/my_configs")`.
"""
from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from hybridrl.config import ConfigError, PPOConfig, check_before_start, validate_config
from hybridrl.config.cli_errors import exit_with_config_errors, exit_with_run_error, run_hydra_cli
from hybridrl.single_controller.local_cluster import ClusterStartError, LocalRayCluster, prepare_driver_process
from hybridrl.defaults.assets import ensure_default_assets
from hybridrl.defaults.tool_task import ensure_tool_task_assets
from hybridrl.trainer.forwarded_output import hide_end_of_output, print_end_of_output, wait_for_runner_output
from hybridrl.utils.import_utils import load_extensions

# Set in every Ray worker process: tokenizers' own thread pool deadlocks after fork, and NCCL's
# INFO chatter would drown the training log. SGLang's engine processes always run NCCL with
# NCCL_CUMEM_ENABLE=0; a trainer rank that shares an NCCL group with them (the weight-update group of
# disaggregated training) must use the same buffer kind, or the group's first broadcast fails with
# "Cuda failure 'invalid argument'" (seen on 2 H200s, 2026-11-27). A value the user exported wins.
WORKER_ENV_VARS = {"TOKENIZERS_PARALLELISM": "false", "NCCL_DEBUG": "WARN",
                   "NCCL_CUMEM_ENABLE": os.environ.get("NCCL_CUMEM_ENABLE", "0")}



@hydra.main(config_path="config", config_name="ppo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    import hybridrl.checks  # noqa: F401  registers the subsystems' config checks; here, not above: it imports torch

    try:
        config = validate_config(cfg)
        ensure_default_assets(config)  # prepares the built-in task and tiny model when the defaults are used
        ensure_tool_task_assets(config)  # the same for the arithmetic tool task (--config-name tool_default)
        warnings = check_before_start(config)
    except ConfigError as err:
        exit_with_config_errors(err.problems)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    from hybridrl.trainer.ppo.nonfinite_guard import NonFiniteTrainingError  # torch: only once a run starts

    try:
        summary = run_ppo(config)
    except NonFiniteTrainingError as err:  # a run that stopped learning: its reason as the last line, exit 1
        print(f"training stopped: {getattr(err, 'cause', err)}", file=sys.stderr, flush=True)
        sys.exit(1)
    except ClusterStartError as err:  # its own words say why and what to change; a traceback would bury them
        print(err, file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as err:  # noqa: BLE001 — any other failure after the start: its cause first, traceback once
        exit_with_run_error(err)
    # Printed by the driver, not the actor, so that the last line is exactly `summary: <path>` or the stop report
    # (no Ray prefix); run_ppo waited for the TaskRunner's last forwarded lines and shut Ray down first.
    if summary["stopped_by_signal"] is not None:
        print(summary["stop_report"], flush=True)
        sys.exit(128 + summary["stopped_by_signal"])
    print(f"accuracy before -> after: {summary['val_score_before']} -> {summary['val_score_after']}; "
          f"steps {summary['steps']}; wall {summary['wall_s']} s; checkpoint {summary['checkpoint_dir']}; "
          f"logs {config.trainer.default_local_dir}")
    print(f"summary: {summary['summary_path']}", flush=True)


def run_ppo(config: PPOConfig) -> dict:
    """Start (or join) Ray, run the whole job inside one TaskRunner actor, shut Ray down; returns the trainer's
    summary, with ``stopped_by_signal`` (None, or the number of the signal that stopped the run) and, after a stop,
    ``stop_report`` (the line to print).

    The driver only launches: the trainer lives in a Ray actor so that it is scheduled by Ray
    like everything else and its logs and failures go through Ray too.
    """
    local = config.ray_init.address is None
    if local:
        prepare_driver_process(config.ray_init.node_ip_address)
    hide_end_of_output()
    import ray  # only now: Ray reads its single-machine mode and its log filter when it is imported

    from hybridrl.trainer.run_control import RunControl, StopSignals, wait_or_stop

    signals = StopSignals()
    signals.install()
    cluster = LocalRayCluster(config.ray_init.num_cpus, config.ray_init.node_ip_address,
                              include_dashboard=config.ray_init.include_dashboard,
                              start_timeout_s=config.ray_init.start_timeout_s) if local else None
    try:
        address = cluster.start() if cluster else config.ray_init.address
        ray.init(address=address, runtime_env={"env_vars": WORKER_ENV_VARS})
        signals.install()  # ray.init sets a SIGTERM handler of its own
        control = RunControl.remote()
        runner = ray.remote(num_cpus=0)(TaskRunner).remote()
        try:
            return wait_or_stop(runner, runner.run.remote(config, control), control, signals, config.trainer)
        finally:
            wait_for_runner_output(runner)  # its last lines (the last step's) are printed before Ray goes
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.stop()
        signals.uninstall()


class TaskRunner:
    """The job's controller process, a Ray actor: builds the trainer and runs its loop.

    It reserves no CPU: it mostly waits on the workers, and on a 2-core laptop the workers' two
    CPU bundles already take every logical CPU a local Ray has.
    """

    def run(self, config: PPOConfig, run_control) -> dict:
        # A fresh process: the registries only hold what the extensions register once imported here too.
        load_extensions(config.extensions)
        from hybridrl.trainer.ppo.ray_trainer import RayPPOTrainer

        trainer = RayPPOTrainer(config, run_control=run_control)  # its placement and schedule: from the config
        trainer.init_workers()
        return trainer.fit()

    def end_output(self) -> None:
        """Called by the driver once `run` is over (trainer/forwarded_output.py)."""
        print_end_of_output()



def cli() -> None:
    run_hydra_cli(main)


if __name__ == "__main__":
    cli()
