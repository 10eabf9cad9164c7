"""AgentLoopManager: the agent-loop workers that generate the sample-group flow's groups on engine servers.

    controller ── GroupRollout.submit(group) (trainer/ppo/group_rollout.py, through generate.AgentLoopGenerate)
                    │  one group per call, round-robin over rollout.agent.num_workers AgentLoopWorker Ray actors
                    ▼
                  AgentLoopWorker.generate_group (async actor): one asyncio task per sample → its agent loop `run`
                    │  server_manager.generate(request_id, prompt_ids, sampling_params)
                    ▼
                  engine servers, one per actor-rollout rank (workers/rollout/async_server.py)

Each sample's loop is chosen by its `agent_name` column, else rollout.agent.default_agent_loop; it gets every column
of its dataset row as keyword arguments. Its output becomes the sample (sample_generate.sample_from_loop), each
generated token with the weight version the engine server reported for it (VersionRecorder); each key of a loop's
extra_fields becomes a batch column when the batch is assembled, as in verl.

Partial rollout (`AgentLoopWorker.generate_group`): an aborted sample whose loop declares `can_resume` (tool_agent)
is continued by its loop from the sample's resume_state (`resume_from`); the tokens it already had keep their
versions, the new ones get the versions the engines report now. An aborted sample of any other loop is refused (its
groups are generated again when data_flow.partial_rollout is false).

Faults:
- a loop that raises (or returns an output that does not fit) costs its sample only: it gets a one-token response
  (EOS) with no loss and score 0, is counted in `agent_loop/num_failed`, and its traceback is printed once per place
  it fails at. When more than `rollout.agent.max_failed_sample_ratio` of a step's samples fail, the step fails with
  the first traceback.
- an engine server's error or death (EngineServerError, also when a loop wrapped it) fails the step.
- a loop that cannot be built (its __init__ or init_class reads a config key or attribute that does not exist)
  fails the run when the manager starts, naming the loop and the error: the default loop and every loop of
  rollout.agent.agent_loop_config_path are built once in a worker then. (Agent names are checked before the start:
  agent_loop/config_checks.py.)
"""
from __future__ import annotations

import asyncio
import os
import traceback
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np
import ray

from hybridrl.agent_loop.base import (AgentLoopMetrics, AgentLoopOutput, DictConfigWrap, ToolListWrap,
                                      instantiate_agent_loop, load_agent_loop_config, loop_can_resume,
                                      yaml_agent_loop_names)
from hybridrl.agent_loop.verl_config import verl_config
from hybridrl.agent_loop import sample_generate
from hybridrl.agent_loop.sample_generate import GenerateContext
from hybridrl.agent_loop.server_manager import AsyncLLMServerManager, EngineServerError
from hybridrl.data.hooks import load_hook
from hybridrl.data.sample import ABORTED, PENDING, Sample
from hybridrl.data.rl_dataset import get_dataset_class
from hybridrl.tools import initialize_tools_from_config
from hybridrl.utils.import_utils import load_extensions
from hybridrl.workers.rollout.request_seeds import turn_seed
from hybridrl.workers.rollout.sampling import SAMPLING_OVERRIDES, max_new_tokens, sampling_source


def rollout_sampling_params(rollout_config, validate: bool, do_sample: bool,
                            overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sampling parameters every loop of a batch gets (verl's keys; val_kwargs when validating; an eval set's
    own settings in `overrides`, workers/rollout/sampling.py)."""
    meta_info = {"validate": validate, SAMPLING_OVERRIDES: overrides or {}}
    source = sampling_source(rollout_config, meta_info)
    greedy = not do_sample or source.temperature == 0
    params = {"temperature": 0.0 if greedy else float(source.temperature), "top_p": float(source.top_p),
              "top_k": int(source.top_k), "repetition_penalty": 1.0,
              "logprobs": bool(rollout_config.calculate_log_probs)}
    if overrides and "max_tokens" in overrides:
        params["max_tokens"] = max_new_tokens(rollout_config, meta_info)
    return params


def check_agent_names(names, registry: dict[str, Any], where: str) -> None:
    """Refuse agent names that no loop is registered under, naming the known ones."""
    unknown = sorted({str(name) for name in names} - set(registry))
    if unknown:
        raise ValueError(f"{where}: agent loop(s) {unknown} are not registered; known: {sorted(registry)} "
                         f"(register with @register(name) or list them in "
                         f"actor_rollout_ref.rollout.agent.agent_loop_config_path)")


def _caused_by_server(error: BaseException) -> Optional[EngineServerError]:
    """The EngineServerError in an exception's cause/context chain, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, EngineServerError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


@ray.remote
class AgentLoopWorker:
    """Runs the agent loops of its share of a batch concurrently on one asyncio loop (an async Ray actor)."""

    def __init__(self, config, tokenizer, server_addresses: list[str]):
        """tokenizer: the run's policy tokenizer, resolved by the controller (utils/tokenizer.py)."""
        self.config = config
        load_extensions(list(config.extensions))  # loops an extension file registers with @register
        rollout = config.actor_rollout_ref.rollout
        self.tokenizer = tokenizer
        self.dataset_cls = get_dataset_class(config.data)
        self.registry = load_agent_loop_config(rollout.agent.agent_loop_config_path)
        # verl's loops since 0.8 get the worker's tools (built once here, for multi-turn runs) as `tools`
        multi_turn = rollout.multi_turn
        self.tools = ToolListWrap(initialize_tools_from_config(multi_turn.tool_config_path)
                                  if multi_turn.enable and multi_turn.tool_config_path else [])
        self.server_manager = AsyncLLMServerManager(server_addresses, stable_routing=rollout.full_determinism)
        self.generate_fn = None  # the data flow's generate function, loaded on first use

    async def generate_group(self, group: list[Sample], sampling_params: dict[str, Any],
                             baseline_params: Optional[dict[str, Any]] = None,
                             seeds: Optional[list[Optional[int]]] = None) -> list[Sample]:
        """The data flow (trainer/ppo/group_rollout.py): one group's samples generated concurrently, each by
        data_flow.custom_generate_function when set, else by its agent loop (sample_generate.py says which runs how).
        A ReMax baseline (Sample.is_baseline) is generated with `baseline_params` (greedy), the others with
        `sampling_params`: together, so from the same weights. `seeds`: each sample's request seed under
        rollout.full_determinism (rollout/request_seeds.py; None: unseeded), which its every request carries.
        Whatever a custom generate function raises fails the step with its traceback: it is user logic, not one
        sample's bad luck; an agent loop's failure costs its sample only, as in the async rollout."""
        if self.generate_fn is None:
            self.generate_fn = load_hook("custom_generate_function",
                                         self.config.data_flow.custom_generate_function) or self._generate_sample
        if baseline_params is None and any(sample.is_baseline for sample in group):
            raise ValueError(f"group {group[0].group_index} has a ReMax baseline but no baseline_params to generate "
                             f"it with")
        ctx = GenerateContext(server_manager=self.server_manager, tokenizer=self.tokenizer, config=self.config,
                              response_length=self.config.actor_rollout_ref.rollout.response_length)
        seeded = [ctx if seed is None else replace(ctx, server_manager=SeededRequests(self.server_manager, seed))
                  for seed in seeds or [None] * len(group)]
        outputs = await asyncio.gather(*(
            self.generate_fn(sample_ctx, sample, dict(baseline_params if sample.is_baseline else sampling_params))
            for sample, sample_ctx in zip(group, seeded)))
        for output in outputs:
            if not isinstance(output, Sample):
                raise TypeError(f"data_flow.custom_generate_function returned {type(output).__name__}, expected the "
                                f"Sample it was given (hybridrl.data.sample.Sample)")
        return list(outputs)

    async def _generate_sample(self, ctx: GenerateContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
        """One sample by its agent loop: the single-turn one continues aborted samples (sample_generate.generate);
        a loop that declares can_resume (tool_agent) continues an aborted conversation from its resume_state; any
        other loop runs whole, from the prompt, and cannot take an aborted sample."""
        agent_name = sample.metadata.get("agent_name") or self.config.actor_rollout_ref.rollout.agent.default_agent_loop
        if agent_name == "single_turn_agent":
            return await sample_generate.generate(ctx, sample, sampling_params)
        if sample.status not in (PENDING, ABORTED):
            return sample
        check_agent_names([agent_name], self.registry, f"sample {sample.index}'s agent_name")
        resume = None
        if sample.status == ABORTED:
            resume = self._resume_point(sample, agent_name)
        row = {**{key: value for key, value in sample.metadata.items() if key != "agent_name"},
               "raw_prompt_ids": list(sample.prompt_ids), "agent_name": agent_name}
        result = await self._run_row(row, sampling_params, ctx.server_manager, resume)
        return sample_generate.sample_from_loop(sample, result, self.tokenizer.eos_token_id,
                                                with_log_probs=bool(sampling_params.get("logprobs")))

    def _resume_point(self, sample: Sample, agent_name: str) -> "ResumePoint":
        """Where the aborted `sample`'s loop continues from; RuntimeError when its loop cannot resume."""
        if not loop_can_resume(agent_name, self.registry):
            raise RuntimeError(f"sample {sample.index} (agent loop {agent_name!r}) was aborted mid-conversation and "
                               f"data_flow.partial_rollout=true would continue it, but the loop does not declare "
                               f"can_resume = True (AgentLoopBase.can_resume): set data_flow.partial_rollout=false "
                               f"(aborted groups are generated again) or use a loop that can resume (tool_agent, "
                               f"the single-turn loop)")
        if sample.resume_state is None:
            raise RuntimeError(f"sample {sample.index} (agent loop {agent_name!r}) was aborted, but its loop returned "
                               f"no resume_state to continue from (a loop with can_resume = True must set it when a "
                               f"generate call is answered aborted)")
        return ResumePoint(AgentLoopOutput(
            prompt_ids=sample.prompt_ids, response_ids=sample.response_ids, response_mask=sample.loss_mask,
            response_logprobs=sample.rollout_log_probs, num_turns=sample.num_turns,
            metrics=AgentLoopMetrics(**(sample.agent_metrics or {})), resume_state=sample.resume_state),
            list(sample.token_versions))

    async def check_loops(self, agent_names: list[str]) -> None:
        """Build one instance of each named loop, as a row would: a loop that reads a key or attribute that does not
        exist fails here, at start, naming the loop, instead of on every row mid-run."""
        for agent_name in agent_names:
            try:
                self._new_loop(agent_name, self.server_manager)
            except Exception as error:
                target = self.registry[agent_name]["_target_"]
                raise RuntimeError(f"agent loop {agent_name!r} ({target}) cannot be built: {type(error).__name__}: "
                                   f"{error}") from error

    def _new_loop(self, agent_name: str, server_manager):
        config = verl_config(self.config)
        return instantiate_agent_loop(agent_name, self.registry, trainer_config=DictConfigWrap(config),
                                      server_manager=server_manager, tokenizer=self.tokenizer, processor=None,
                                      dataset_cls=self.dataset_cls, data_config=DictConfigWrap(config.data),
                                      tools=self.tools)

    async def _run_row(self, row: dict[str, Any], sampling_params: dict[str, Any], server_manager,
                       resume: Optional["ResumePoint"] = None) -> dict[str, Any]:
        """One row's loop run against `server_manager` (the worker's, or its seeded view): from the prompt, or
        (`resume`) continuing the conversation an abort interrupted."""
        row = dict(row)
        agent_name = row.pop("agent_name")
        recorder = VersionRecorder(server_manager)
        try:
            loop = self._new_loop(agent_name, recorder)
            if resume is not None:
                row["resume_from"] = resume.output
            output = await loop.run(dict(sampling_params), **row)
            check_output(output, self.config.actor_rollout_ref.rollout, agent_name)
            versions = recorder.token_versions(output.response_mask) if resume is None else \
                resume.token_versions(output, recorder)
            return {"output": output.model_dump(), "token_versions": versions, "aborted": recorder.aborted}
        except Exception as error:
            server_error = _caused_by_server(error)
            if server_error is not None:
                raise server_error
            return {"error": f"agent loop {agent_name!r}: {traceback.format_exc()}"}


@dataclass
class ResumePoint:
    """An aborted sample as its resumable loop continues it: the loop's output so far (with its resume_state) and the
    weight version of each of its response tokens."""
    output: AgentLoopOutput
    versions: list[int]

    def token_versions(self, output: AgentLoopOutput, recorder: "VersionRecorder") -> list[int]:
        """The continued output's versions: its first tokens are the ones it resumed from and keep their versions
        (-1 where the final mask leaves them untrained, as everywhere); the rest are this run's (the recorder's)."""
        before = len(self.output.response_ids)
        if output.response_ids[:before] != self.output.response_ids:
            raise ValueError(f"a resumed loop must return the response it resumed from followed by the rest; its "
                             f"first {before} response tokens differ from the ones it was given in resume_from")
        kept = [version if mask else -1 for version, mask in zip(self.versions, output.response_mask)]
        return kept + recorder.token_versions(output.response_mask[before:])


class SeededRequests:
    """The server manager as one sample sees it under rollout.full_determinism: every request it sends carries its
    turn's seed (the sample's seed, then one per later turn, numbered as they are sent) under one id per sample, which
    stable routing sends to the same server in every run (rollout/request_seeds.py)."""

    def __init__(self, server_manager: AsyncLLMServerManager, seed: int):
        self.server_manager = server_manager
        self.seed = seed
        self.sent = 0  # generate calls sent so far: the conversation's turns

    async def generate(self, request_id: str, **kwargs):
        kwargs["sampling_params"] = {**kwargs["sampling_params"], "seed": turn_seed(self.seed, self.sent)}
        self.sent += 1
        return await self.server_manager.generate(f"det-{self.seed}", **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.server_manager, name)


class VersionRecorder:
    """The server manager as one sample's loop sees it: it also notes which policy version generated each call's
    tokens, so that every generated token of the sample gets its version (a multi-turn sample may span weight
    updates between its turns)."""

    def __init__(self, server_manager: AsyncLLMServerManager):
        self.server_manager = server_manager
        self.calls: list[tuple[int, Optional[int]]] = []  # (tokens generated, weight_version) per generate call
        self.aborted = False  # an engine server answered a call as aborted (the data flow stopped the stragglers)

    async def generate(self, request_id: str, **kwargs):
        output = await self.server_manager.generate(request_id, **kwargs)
        self.calls.append((len(output.token_ids), output.weight_version))
        self.aborted = self.aborted or output.stop_reason == "aborted"
        return output

    def __getattr__(self, name: str):
        return getattr(self.server_manager, name)

    def token_versions(self, response_mask: list[int]) -> list[int]:
        """One version per response token: the generated ones (response_mask 1) take the calls' versions in order
        (a loop that kept fewer tokens than generated shifts nothing: it cuts at the end); others -1."""
        generated = [(-1 if version is None else version) for count, version in self.calls for _ in range(count)]
        last = generated[-1] if generated else -1
        versions, position = [], 0
        for mask in response_mask:
            if mask:
                versions.append(generated[position] if position < len(generated) else last)
                position += 1
            else:
                versions.append(-1)
        return versions


def check_output(output, rollout_config, agent_name: str) -> None:
    """An output that cannot enter the batch is the loop's fault: it fails that row, with what is wrong."""
    if not isinstance(output, AgentLoopOutput):
        raise TypeError(f"agent loop {agent_name!r} returned {type(output).__name__}, expected AgentLoopOutput")
    if rollout_config.calculate_log_probs and output.response_logprobs is None:
        raise ValueError("rollout.calculate_log_probs is on but the loop returned no response_logprobs (pass on "
                         "the server's TokenOutput.log_probs, 0.0 for tokens the model did not generate)")
    widths = {"response_mask": len(output.response_mask)}
    if output.response_logprobs is not None:
        widths["response_logprobs"] = len(output.response_logprobs)
    for name, width in widths.items():
        if width != len(output.response_ids):
            raise ValueError(f"{name} has {width} entries, response_ids has {len(output.response_ids)}")
    if not 0 < len(output.prompt_ids) <= rollout_config.prompt_length:
        raise ValueError(f"prompt_ids has {len(output.prompt_ids)} tokens, expected 1..rollout.prompt_length="
                         f"{rollout_config.prompt_length}")
    if len(output.response_ids) > rollout_config.response_length:
        raise ValueError(f"response_ids has {len(output.response_ids)} tokens, more than rollout.response_length="
                         f"{rollout_config.response_length}")
    if any(value not in (0, 1) for value in output.response_mask):
        raise ValueError("response_mask must hold only 0 and 1")
    for name in ("multi_modal_data", "mm_processor_kwargs", "mm_processor_output"):
        value = getattr(output, name)
        if value:
            shown = sorted(value) if isinstance(value, dict) else value
            raise ValueError(f"{name} is set ({shown}), but the models here are text-only: multi-modal training is "
                             f"not supported")


class AgentLoopManager:
    """Owns the AgentLoopWorker actors (GroupRollout submits groups to them) and reports their loops' failures."""

    def __init__(self, config, tokenizer, server_addresses: list[str]):
        """tokenizer: the run's policy tokenizer, resolved by the controller (utils/tokenizer.py); every worker gets
        this one (its EOS ends a failed row's response, its pad fills the batch)."""
        rollout = config.actor_rollout_ref.rollout
        self.max_failed_ratio = rollout.agent.max_failed_sample_ratio
        self.server_addresses = list(server_addresses)  # the data flow aborts them (server_manager.abort_servers)
        # The YAML's _target_ modules must import in the workers as they do here: they get this process's PYTHONPATH.
        env = {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}} if os.environ.get("PYTHONPATH") else None
        self.workers = [AgentLoopWorker.options(num_cpus=0, runtime_env=env).remote(config, tokenizer,
                                                                                    server_addresses)
                        for _ in range(rollout.agent.num_workers)]
        loops_used = [rollout.agent.default_agent_loop, *yaml_agent_loop_names(rollout.agent.agent_loop_config_path)]
        ray.get(self.workers[0].check_loops.remote(list(dict.fromkeys(loops_used))))
        self._reported: set[str] = set()

    def report_failures(self, errors: list[str], rows: int) -> None:
        """Print each failed loop's traceback once per place it fails at; fail the step when more than
        rollout.agent.max_failed_sample_ratio of the `rows` failed (the data flow calls it once per step)."""
        for error in errors:
            where = _failure_site(error)
            if where not in self._reported:
                self._reported.add(where)
                print(f"agent loop failed (its sample gets no loss; later failures at the same place are only counted "
                      f"in agent_loop/num_failed):\n{error}", flush=True)
        if errors and len(errors) > self.max_failed_ratio * rows:
            raise RuntimeError(f"{len(errors)} of {rows} agent loops failed, more than "
                               f"actor_rollout_ref.rollout.agent.max_failed_sample_ratio={self.max_failed_ratio}; "
                               f"the first:\n{errors[0]}")

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)


def agent_loop_metrics(turns: list[int], metrics: list[AgentLoopMetrics],
                       lengths: list[tuple[int, int]]) -> dict[str, float]:
    """The batch's agent-loop metrics from each sample's turns, AgentLoopMetrics and (prompt, response) token
    lengths, under verl's names where verl has them:
    - num_turns/{min,max,mean};
    - timing_s/agent_loop/{generate_sequences,tool_calls,compute_score}/{min,max,mean}: seconds per sample;
    - timing_s/agent_loop/slowest/*: the sample with the most of those seconds, which bounds the batch (its seconds
      of each, its preemptions, its prompt and response lengths). timing_s/agent_loop (the whole call) less its
      generate_sequences is how long the slowest sample waited before and after its requests;
    and agent_loop/* of ours: the engine's preemptions (mean over the samples that report them), the tool loop's
    counts (tool_agent.py), and the mean of every numeric metric a loop added of its own."""
    calls = sum(m.num_tool_calls for m in metrics)
    preempted = [m.num_preempted for m in metrics if m.num_preempted >= 0]
    seconds = {name: np.array([getattr(m, name) for m in metrics], dtype=float)
               for name in ("generate_sequences", "tool_calls", "compute_score")}
    slowest = int(np.argmax(sum(seconds.values())))
    return {
        **({"agent_loop/num_preempted/mean": float(np.mean(preempted))} if preempted else {}),
        **loop_defined_metrics(metrics),
        "num_turns/mean": float(np.mean(turns)),
        "num_turns/min": float(np.min(turns)),
        "num_turns/max": float(np.max(turns)),
        **{f"timing_s/agent_loop/{name}/{stat}": float(getattr(np, stat)(values))
           for name, values in seconds.items() for stat in ("min", "max", "mean")},
        **{f"timing_s/agent_loop/slowest/{name}": float(values[slowest]) for name, values in seconds.items()},
        "timing_s/agent_loop/slowest/num_preempted": float(metrics[slowest].num_preempted),
        "timing_s/agent_loop/slowest/prompt_length": float(lengths[slowest][0]),
        "timing_s/agent_loop/slowest/response_length": float(lengths[slowest][1]),
        "agent_loop/num_tool_calls/mean": float(np.mean([m.num_tool_calls for m in metrics])),
        "agent_loop/used_tools/mean": float(np.mean([m.num_tool_calls > 0 for m in metrics])),  # share of samples
        "agent_loop/num_tool_errors/sum": float(sum(m.num_tool_errors for m in metrics)),
        "agent_loop/tool_latency_s/mean": float(sum(m.tool_latency_s for m in metrics) / calls) if calls else 0.0,
        "agent_loop/tokenization_mismatch/sum": float(sum(m.tokenization_mismatch for m in metrics)),
        "agent_loop/response_cut/sum": float(sum(m.response_cut for m in metrics)),
    }


def loop_defined_metrics(metrics: list[AgentLoopMetrics]) -> dict[str, float]:
    """agent_loop/<name>/mean of each numeric field a loop added to its metrics (AgentLoopMetrics allows extras);
    a row without it is not in its mean."""
    values: dict[str, list[float]] = {}
    for row_metrics in metrics:
        for name, value in (row_metrics.model_extra or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values.setdefault(name, []).append(float(value))
    return {f"agent_loop/{name}/mean": float(np.mean(row_values)) for name, row_values in sorted(values.items())}


def _failure_site(error: str) -> str:
    """A failure's traceback without its message (which may name the sample): the same bug is reported once."""
    lines = error.rstrip().splitlines()
    return "\n".join(lines[:-1] + [lines[-1].split(":", 1)[0]]) if lines else error

