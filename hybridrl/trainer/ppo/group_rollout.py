"""The sample-group flow (slime's data flow): the one route by which every step, in every schedule and with every
engine, gets its batch, and validation its scored groups. Groups in flight, scored as they finish, filtered, the
stragglers aborted.

    prompt_source.get_groups ──► submit: the generate function (generate.py; data/route.py picks it): one batched
                                   │ call of the colocated engines, or one agent-loop worker call per group
                                   ▼
    as groups finish:       score_groups (reward manager or data_flow.reward_function), the one place scores
                            dynamic-sampling filter: keep or drop (counted); refill while short
    enough kept:            abort the engine servers; groups still in flight come back with their tokens so far
                            (and groups that finished beyond what was needed)
                            partial_rollout: into the buffer as they are (continued next step, new weights)
                            else: reset to their prompt and into the buffer (generated again next step)
    over-sampling filter:   orders what was kept; the first data.train_batch_size groups are trained on

With ReMax (algorithm.adv_estimator=remax) every training group also holds its prompt's greedy baseline, last
(data/sample.py), the one place ReMax's baseline is made: it is submitted with the group (greedy sampling: the same
agent-loop worker call, or the batched call's greedy twin in the same rollout window), so it is generated from the
same weights, scored with the group, aborted, buffered and continued or reset with it; the
filters, the trained batch and the counts of samples see only the `rollout.n` sampled responses (`sampled`), and
its score becomes the group's `reward_baselines` in `to_batch` (data_flow/baseline_reward/mean).

`generate_rollout` is that loop, the built-in `data_flow.rollout_function`; a custom one gets the same
`GroupRollout` (submit / wait / score_group / abort / record) and prompt source. Counts go to the step's metrics
under data_flow/* (README, "Sample buffer, dynamic sampling, partial rollout").

How many are in flight: `data_flow.over_sampling_batch_size` groups are requested at a time (null: as many as
data.train_batch_size), and again whenever kept + in flight fall below the target (train_batch_size, or
over_sampling_batch_size with an over-sampling filter), at most `max_num_gen_batches` times a step (0: no cap).
When the cap is reached with too few groups kept, `insufficient_groups` says what happens: `fail`, or `train` on
the kept groups (cut to a whole number of mini-batches; the rest go back to the buffer), counted in
data_flow/num_groups_short.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from hybridrl.agent_loop.base import AgentLoopMetrics
from hybridrl.agent_loop.manager import agent_loop_metrics
from hybridrl.data.filters import metric_nonzero_std
from hybridrl.data.hooks import load_all_hooks
from hybridrl.data.prompt_source import PromptSource
from hybridrl.algorithms.core_algos import AdvantageEstimator
from hybridrl.data.sample import (ABORTED, Sample, baseline_of, groups_to_batch, partial_rollout_metrics, reset_group,
                                  sampled, samples_to_batch)
from hybridrl.data.route import data_flow_switch, engine_servers_switch
from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.generate import GREEDY, TRAINING, Sampling


def generates_on_engine_servers(config) -> bool:
    """Whether the flow generates through agent loops on engine servers (data/route.engine_servers_switch), else
    by the colocated engines' batched call."""
    return engine_servers_switch(config.actor_rollout_ref.rollout.mode,
                                 config.data_flow.custom_generate_function.name) is not None


@dataclass
class StepCounts:
    """What a step's generation counted: data_flow/* (and reward/*) records, the rewards given (kept groups or not),
    the samples finished and the tracebacks of failed agent loops."""
    metrics: dict[str, float] = field(default_factory=dict)
    scored: list[float] = field(default_factory=list)
    generated: int = 0
    errors: list[str] = field(default_factory=list)
    reward_seconds: float = 0.0  # spent scoring: verl's timing_s/reward (within timing_s/gen)
    engine_seconds: float = 0.0  # inside the engines' batched calls, and the tokens they made (generate.py)
    engine_tokens: int = 0


class GroupRollout:
    """The controller's handle on group generation for one run (built by the trainer with its workers)."""

    def __init__(self, config, generator, tokenizer, score_batch: Callable[[DataProto, bool], dict]):
        """generator: the generate function (generate.py); score_batch(batch, evaluation): the reward manager (and
        reward model) on a padded batch (RayPPOTrainer._score)."""
        self.config = config
        self.flow = config.data_flow
        self.generator = generator
        self.tokenizer = tokenizer
        self.score_batch = score_batch
        self.hooks = load_all_hooks(self.flow)
        # the data flow's features on (data/route.py): its data_flow/* counts are logged; off, a step's metrics are
        # those of a plain synchronous run
        self.features_on = data_flow_switch(self.flow.enable, config.algorithm.filter_groups.enable,
                                            config.async_training.mode) is not None
        self.max_num_gen_batches = self.flow.max_num_gen_batches
        filter_groups = config.algorithm.filter_groups
        if filter_groups.enable:  # verl's DAPO keys: the same machinery, its filter on `metric`
            self.hooks["dynamic_sampling_filter"] = self.hooks["dynamic_sampling_filter"] or \
                metric_nonzero_std(filter_groups.metric)
            self.max_num_gen_batches = filter_groups.max_num_gen_batches
        self.rollout_config = config.actor_rollout_ref.rollout
        # ReMax: each training group carries its greedy baseline (the prompt source makes it)
        self.with_baseline = config.algorithm.adv_estimator == AdvantageEstimator.REMAX
        self.eval_sampling = Sampling(validate=True)  # what submit(evaluation=True) draws with (an eval set's own)
        self.counts = StepCounts()  # of the step being generated
        # the groups the dynamic-sampling filter dropped, held for the rollout dump (trainer.rollout_data_dir) until
        # the trainer takes them (take_dropped); none are held when nothing dumps them
        self.dropped: list[list[Sample]] = []
        self.keep_dropped = bool(config.trainer.rollout_data_dir)
        self.step = 0  # the step being generated, and how many groups it has submitted (start_counting resets them)
        self.submitted = 0
        # True: training groups are scored only when the step takes them (score_taken), on the thread that calls
        # it; one_step_off sets it with a reward model, whose forward must not run on its generating thread
        self.score_when_taken = False

    # ------------------------------------------------------------------ what rollout functions use
    @property
    def train_batch_size(self) -> int:
        return self.config.data.train_batch_size

    def submit(self, group: list[Sample], evaluation: bool = False):
        """Start generating one group; `wait` returns it when it is done. Its ReMax baseline, if it has one,
        generates with it, greedily. Returns the group's handle."""
        sampling = self.eval_sampling if evaluation else TRAINING
        position, self.submitted = self.submitted, self.submitted + 1
        return self.generator.submit(group, sampling, GREEDY if self.with_baseline and not evaluation else None,
                                     self.step, position)

    def wait(self, handles: list) -> list[tuple[Any, list[Sample]]]:
        """Block until at least one of `handles` is done; (handle, group) of each finished one. A worker's error (an
        engine's, a custom generate function's) is raised here, with its traceback."""
        finished = self.generator.wait(handles)
        seconds, tokens = self.generator.take_engine_time()
        self.counts.engine_seconds += seconds
        self.counts.engine_tokens += tokens
        return finished

    def abort(self, handles: list) -> list[list[Sample]]:
        """Stop the groups of `handles` (submitted, not finished) and return them with their tokens so far (status
        aborted; generate.py says how each generate function stops). Counts data_flow/num_aborted_groups
        (the groups in flight at the abort) and num_aborted_samples (of their sampled responses; a ReMax baseline is
        aborted with its group and not counted)."""
        groups = self.generator.abort(handles)
        self.record("data_flow/num_aborted_groups", len(groups))
        self.record("data_flow/num_aborted_samples",
                    sum(sample.status == ABORTED for group in groups for sample in sampled(group)))
        return groups

    def score_group(self, group: list[Sample], evaluation: bool = False) -> list[Sample]:
        """score_groups of one group."""
        return self.score_groups([group], evaluation)[0]

    def score_groups(self, groups: list[list[Sample]], evaluation: bool = False) -> list[list[Sample]]:
        """Reward every sample of finished groups that has none yet (a custom generate function or an agent loop may
        set its own), ReMax baselines too, all in one reward call; with score_when_taken, training groups are scored
        later, when their step takes them. Every finished group passes here, so the agent loops' failures are counted
        here too (a baseline's loop among them: it ran like the others)."""
        samples = [sample for group in groups for sample in group]
        self.counts.generated += len(samples)
        self.counts.errors += [sample.error for sample in samples if sample.error is not None]
        if evaluation or not self.score_when_taken:
            self._score_samples([sample for sample in samples if sample.reward is None], evaluation, self.counts)
        return groups

    def score_taken(self, groups: list[list[Sample]]) -> dict[str, float]:
        """score_when_taken: score the training groups a step takes (what is not scored yet, in one batch, on the
        calling thread, baselines too), and the metrics of it: reward/*, data_flow/generated_reward/mean (over these
        groups' sampled responses: the only ones scored). It touches no count of a generation under way."""
        counts = StepCounts()
        self._score_samples([sample for group in groups for sample in group if sample.reward is None], False, counts)
        metrics = dict(counts.metrics)
        if counts.scored:
            metrics["data_flow/generated_reward/mean"] = float(np.mean(counts.scored))
        metrics.update(_reward_extra_means(groups))
        return metrics

    def _score_samples(self, todo: list[Sample], evaluation: bool, counts: StepCounts) -> None:
        """The one place scoring happens: data_flow.reward_function when set, else the reward manager (and the
        reward model, when the run has one), on all of `todo` at once; counted in `counts` (counts.scored: the sampled
        responses' rewards, not the baselines'; reward_seconds: the time it took). A group reward function gets a group's baseline with its samples (the last, is_baseline), so
        that its score is on the same scale as theirs."""
        if not todo:
            return
        started = time.perf_counter()
        self._score_with_the_reward(todo, evaluation, counts)
        counts.reward_seconds += time.perf_counter() - started

    def _score_with_the_reward(self, todo: list[Sample], evaluation: bool, counts: StepCounts) -> None:
        reward_fn = self.hooks["reward_function"]
        if reward_fn is not None:
            rewards = call_hook("data_flow.reward_function", _call_reward_function, reward_fn, self.config, todo,
                                self.flow.group_reward)
            for sample, reward in zip(todo, rewards):
                sample.reward, sample.reward_key = reward, self.flow.reward_key
                if not sample.is_baseline:
                    counts.scored.append(sample.reward_value())
            return
        batch = samples_to_batch(todo, prompt_length=self.rollout_config.prompt_length,
                                 response_length=self.rollout_config.response_length,
                                 pad_token_id=self.tokenizer.pad_token_id, with_log_probs=False, scored=False)
        reward = self.score_batch(batch, evaluation)
        scores = reward["reward_tensor"].sum(-1).tolist()
        extras = reward.get("reward_extra_info", {})
        for row, (sample, score) in enumerate(zip(todo, scores)):
            sample.reward, sample.reward_key = float(score), None
            if not sample.is_baseline:
                counts.scored.append(float(score))
            if extras:
                sample.metadata["reward_extra_info"] = {key: values[row] for key, values in extras.items()}
        for key, value in reward.get("reward_metrics", {}).items():
            counts.metrics[key] = counts.metrics.get(key, 0.0) + float(value)

    def keep(self, group: list[Sample]) -> bool:
        """The dynamic-sampling filter's verdict on a scored group, judged on its sampled responses (no filter:
        keep)."""
        dynamic_filter = self.hooks["dynamic_sampling_filter"]
        if dynamic_filter is None:
            return True
        verdict = call_hook("data_flow.dynamic_sampling_filter", dynamic_filter, self.config, sampled(group))
        if not isinstance(verdict, (bool, np.bool_)):
            raise TypeError(f"data_flow.dynamic_sampling_filter returned {verdict!r}, expected True (keep) or False")
        return bool(verdict)

    def record(self, name: str, value: float) -> None:
        """Add to a data_flow/* (or reward/*) count of this step."""
        self.counts.metrics[name] = self.counts.metrics.get(name, 0.0) + float(value)

    def drop(self, group: list[Sample]) -> None:
        """A scored group the dynamic-sampling filter refused: counted, and held for the rollout dump."""
        self.record("data_flow/num_dropped_groups", 1)
        if self.keep_dropped:
            self.dropped.append(group)

    def take_dropped(self) -> list[list[Sample]]:
        """The groups dropped since the last call (in the async schedules, some may be those generated ahead for
        the next step)."""
        taken, self.dropped = self.dropped, []
        return taken

    # ------------------------------------------------------------------ what the trainer calls
    def train_batch(self, step: int, prompt_source: PromptSource,
                    weights_version: int) -> tuple[DataProto, dict[str, float]]:
        """The step's training batch (scored: token_level_scores set) from the rollout function, and its metrics.
        Needs rollout mode; `weights_version`: the version of the weights the engines hold (the tokens generated now
        carry it; older ones come from the buffer, data_flow/staleness/*)."""
        groups, metrics = self.train_groups(step, prompt_source)
        batch, version_metrics = self.to_batch(groups, weights_version)
        return batch, {key: value for key, value in {**metrics, **version_metrics}.items()
                       if self.features_on or not key.startswith("data_flow/")}

    def train_groups(self, step: int, prompt_source: PromptSource) -> tuple[list[list[Sample]], dict[str, float]]:
        """The step's kept groups from the rollout function, and the metrics of making them; scored, unless
        score_when_taken (then score_taken scores them). (The one-step-off schedule runs this on its generating
        thread and holds the groups until the step takes them, so that a checkpoint can put them back into the
        prompt source's buffer: schedule.py.)"""
        self.start_counting(step)
        rollout_fn = self.hooks["rollout_function"] or generate_rollout
        groups = rollout_fn(self, step, prompt_source, False)
        groups = self._check_groups(groups, "data_flow.rollout_function", prompt_source.n,
                                    scored=not self.score_when_taken, baseline=self.with_baseline)
        return groups, self.step_metrics(groups, prompt_source)

    def start_counting(self, step: int) -> None:
        """A new step's counts: data_flow/* records, rewards given, samples finished, failed agent loops; and its
        number, and no group submitted yet (the groups' places in the step: rollout/request_seeds.py)."""
        self.counts = StepCounts()
        self.step, self.submitted = step, 0

    def step_metrics(self, groups: list[list[Sample]], prompt_source: PromptSource) -> dict[str, float]:
        """The metrics of the step that trains `groups`, from the counts since `start_counting`; fails the step
        when too many agent loops failed (agent_loop.manager.report_failures)."""
        counts = self.counts
        self.generator.report_failures(counts.errors, counts.generated)
        metrics = dict(counts.metrics)
        metrics["timing_s/reward"] = counts.reward_seconds
        if counts.engine_seconds > 0:  # the batched call's share of timing_s/gen (the rest: dispatch, packing)
            metrics["timing_s/engine_generate"] = counts.engine_seconds
            metrics["rollout/engine_tokens_per_s"] = counts.engine_tokens / counts.engine_seconds
        metrics["data_flow/buffer_size"] = float(len(prompt_source.buffer))
        metrics["data_flow/num_groups_trained"] = float(len(groups))
        if counts.scored:  # the policy's own success, before any filter chose (the trained batch's is biased)
            metrics["data_flow/generated_reward/mean"] = float(np.mean(counts.scored))
        metrics.update(_reward_extra_means(groups))
        metrics.update(_agent_loop_metrics(groups, len(counts.errors)))
        return metrics

    def to_batch(self, groups: list[list[Sample]], weights_version: int) -> tuple[DataProto, dict[str, float]]:
        """Scored groups as a training batch (their sampled responses; with ReMax their baselines' scores as
        reward_baselines), and data_flow/staleness/* against `weights_version` (the version the engines held when
        these groups were generated: tokens older than it came from the buffer), data_flow/baseline_reward/mean."""
        batch = groups_to_batch(groups, prompt_length=self.rollout_config.prompt_length,
                                response_length=self.rollout_config.response_length,
                                pad_token_id=self.tokenizer.pad_token_id,
                                with_log_probs=self.rollout_config.calculate_log_probs, scored=True,
                                current_version=weights_version,
                                mask_stale_tokens=self.flow.mask_offpolicy_in_partial_rollout)
        metrics = partial_rollout_metrics(batch, weights_version)
        if self.with_baseline:  # the greedy baselines' mean score, over the trained groups
            metrics["data_flow/baseline_reward/mean"] = float(np.mean(
                [baseline_of(group).reward_value() for group in groups]))
        return batch, metrics

    def eval_groups(self, step: int, prompt_source: PromptSource, n: int,
                    sampling: Sampling) -> tuple[list[list[Sample]], dict[str, float]]:
        """The scored groups of `n` samples each of every prompt of `prompt_source`, drawn with `sampling`, from
        data_flow.eval_function (the built-in: every prompt once, all in flight together), and the reward metrics of
        scoring them. Needs rollout mode."""
        self.start_counting(step)
        self.eval_sampling = sampling
        eval_function = self.hooks["eval_function"] or generate_rollout
        groups = self._check_groups(eval_function(self, step, prompt_source, True), "data_flow.eval_function", n)
        self.generator.report_failures(self.counts.errors, self.counts.generated)
        return groups, dict(self.counts.metrics)

    def _check_groups(self, groups, key: str, n: int, scored: bool = True, baseline: bool = False) -> list[list[Sample]]:
        """Each group is `n` samples (and, `baseline`, ReMax's baseline last, as the prompt source made it), scored
        unless not `scored`."""
        if not isinstance(groups, list) or not groups:
            raise ValueError(f"{key} returned {type(groups).__name__} of {len(groups or [])} groups, expected a "
                             f"non-empty list of groups (lists of Sample)")
        for position, group in enumerate(groups):
            if not isinstance(group, list) or not all(isinstance(s, Sample) for s in group) \
                    or len(sampled(group)) != n:
                raise ValueError(f"{key}: group {position} is not a list of {n} Samples (rollout.n): {group!r:.200}")
            if baseline and (baseline_of(group) is None or len(group) != n + 1):
                raise ValueError(f"{key}: group {position} has no ReMax baseline as its last sample "
                                 f"(algorithm.adv_estimator=remax: return the groups of the prompt source, whose last "
                                 f"sample, is_baseline, is generated and scored with them): {group!r:.200}")
            if not scored:
                continue
            unscored = [sample.index for sample in group if sample.reward is None]
            if unscored:
                raise ValueError(f"{key}: group {position} has samples without a reward (indices {unscored}); score "
                                 f"them with rollout.score_group")
        return groups


class HookFailed(RuntimeError):
    """A user hook raised: the step fails, naming the hook's key, with the hook's traceback."""


def call_hook(key: str, function, *args):
    """function(*args); what it raises fails the step as HookFailed naming `key`, with the original traceback (a
    filter's bug is user logic, never a reason to drop a sample quietly)."""
    try:
        return function(*args)
    except HookFailed:
        raise
    except Exception as err:
        raise HookFailed(f"{key} raised:\n{traceback.format_exc()}") from err


# ---------------------------------------------------------------------- the built-in rollout function

def generate_rollout(rollout: GroupRollout, step: int, prompt_source: PromptSource,
                     evaluation: bool) -> list[list[Sample]]:
    """The built-in data_flow.rollout_function (and eval_function): see the module docstring."""
    if evaluation:
        return _evaluate(rollout, step, prompt_source)
    flow = rollout.flow
    chunk = flow.over_sampling_batch_size or rollout.train_batch_size
    over_sampling_filter = rollout.hooks["over_sampling_filter"]
    target = chunk if over_sampling_filter is not None else rollout.train_batch_size
    in_flight: dict[Any, None] = {}
    kept: list[list[Sample]] = []
    chunks = 0
    for count in ("num_dropped_groups", "num_aborted_groups", "num_aborted_samples"):  # every step logs each, 0 too
        rollout.record(f"data_flow/{count}", 0)
    while True:
        while len(kept) + len(in_flight) < target and (rollout.max_num_gen_batches == 0
                                                        or chunks < rollout.max_num_gen_batches):
            for group in prompt_source.get_groups(chunk, step):
                in_flight[rollout.submit(group)] = None
            chunks += 1
        if len(kept) >= target or not in_flight:
            break
        finished = rollout.wait(list(in_flight))
        for ref, _ in finished:
            del in_flight[ref]
        for group in rollout.score_groups([group for _, group in finished]):
            if len(kept) < target and rollout.keep(group):
                kept.append(group)
            elif len(kept) < target:
                rollout.drop(group)
            else:  # finished together with the last one needed: back to the buffer (reset unless partial rollout,
                # so that without it every trained token comes from the weights of its step)
                prompt_source.add_groups([group if flow.partial_rollout else reset_group(group)])
    rollout.record("data_flow/num_gen_batches", chunks)
    _stop_stragglers(rollout, list(in_flight), prompt_source)
    kept.sort(key=lambda group: group[0].group_index)  # in submission order, not finish order: the same every run
    if over_sampling_filter is not None:
        kept = _order(rollout, over_sampling_filter, kept)
    trained, rest = kept[:rollout.train_batch_size], kept[rollout.train_batch_size:]
    rollout.record("data_flow/num_over_sampling_dropped", len(rest))
    if len(trained) < rollout.train_batch_size:
        trained = too_few_groups(rollout, trained, prompt_source)
    return trained


def _stop_stragglers(rollout: GroupRollout, refs: list, prompt_source: PromptSource) -> None:
    """Abort what is still generating and put those groups back: as they are (partial rollout) or reset."""
    if not refs:
        return
    groups = rollout.abort(refs)
    prompt_source.add_groups(groups if rollout.flow.partial_rollout else [reset_group(group) for group in groups])


def _order(rollout: GroupRollout, over_sampling_filter, kept: list[list[Sample]]) -> list[list[Sample]]:
    """The over-sampling filter's order of the kept groups, which it judges by their sampled responses."""
    given = [sampled(group) for group in kept] if rollout.with_baseline else list(kept)
    views = {id(view): group for view, group in zip(given, kept)}
    ordered = call_hook("data_flow.over_sampling_filter", over_sampling_filter, rollout.config, list(given))
    if not isinstance(ordered, list) or any(id(group) not in views for group in ordered):
        raise ValueError("data_flow.over_sampling_filter must return a list of the groups it was given, ordered")
    return [views[id(group)] for group in ordered]


def too_few_groups(rollout: GroupRollout, kept: list[list[Sample]], prompt_source) -> list[list[Sample]]:
    """max_num_gen_batches reached with fewer than data.train_batch_size groups kept: fail, or train on a whole number
    of mini-batches of them (the rest go back to the buffer)."""
    flow, wanted = rollout.flow, rollout.train_batch_size
    where = (f"max_num_gen_batches={rollout.max_num_gen_batches} batches of "
             f"{flow.over_sampling_batch_size or wanted} groups kept {len(kept)} of the {wanted} groups "
             f"data.train_batch_size asks for")
    unit = _mini_batch_groups(rollout.config)
    usable = len(kept) // unit * unit
    if flow.insufficient_groups == "fail" or usable == 0:
        raise RuntimeError(f"{where} (data_flow.insufficient_groups={flow.insufficient_groups!r}"
                           f"{'' if usable else f'; fewer than one mini-batch of {unit} groups'}): raise "
                           f"max_num_gen_batches or loosen data_flow.dynamic_sampling_filter")
    print(f"data_flow: {where}; training on {usable}", flush=True)
    prompt_source.add_groups(kept[usable:])
    rollout.record("data_flow/num_groups_short", wanted - usable)
    return kept[:usable]


def _mini_batch_groups(config) -> int:
    """Groups that keep a batch a whole number of actor (and critic) mini-batches, hence divisible by the ranks."""
    sizes = [config.actor_rollout_ref.actor.ppo_mini_batch_size]
    if config.critic.enable:
        sizes.append(config.critic.ppo_mini_batch_size)
    return math.lcm(*sizes)


def _evaluate(rollout: GroupRollout, step: int, prompt_source: PromptSource) -> list[list[Sample]]:
    """Every validation prompt once, all in flight together, scored with the validation reward manager."""
    groups = prompt_source.get_groups(1 << 62, step)  # a finite source: all of it
    handles = [rollout.submit(group, evaluation=True) for group in groups]
    finished: dict = {}
    while len(finished) < len(handles):
        finished.update(rollout.wait([handle for handle in handles if handle not in finished]))
    return rollout.score_groups([finished[handle] for handle in handles], evaluation=True)


def _call_reward_function(reward_fn, config, samples: list[Sample], group_reward: bool) -> list:
    """data_flow.reward_function on one sample at a time (concurrently when async) or, group_reward, on them all."""
    if group_reward:
        rewards = reward_fn(config, samples)
        rewards = asyncio.run(rewards) if inspect.isawaitable(rewards) else rewards
        if not isinstance(rewards, list) or len(rewards) != len(samples):
            raise ValueError(f"data_flow.reward_function (group_reward=true) returned {rewards!r:.200}, expected a "
                             f"list of {len(samples)} rewards")
    elif inspect.iscoroutinefunction(reward_fn):
        async def score_all():
            return await asyncio.gather(*(reward_fn(config, sample) for sample in samples))
        rewards = list(asyncio.run(score_all()))
    else:
        rewards = [reward_fn(config, sample) for sample in samples]
    for reward in rewards:
        if not isinstance(reward, (int, float, dict)) or isinstance(reward, bool):
            raise TypeError(f"data_flow.reward_function returned {reward!r}, expected a number or a dict")
    return rewards


def _reward_extra_means(groups: list[list[Sample]]) -> dict[str, float]:
    values: dict[str, list] = {}
    for group in groups:
        for sample in sampled(group):
            for key, value in (sample.metadata.get("reward_extra_info") or {}).items():
                if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
                    values.setdefault(key, []).append(float(value))
    return {f"reward/{key}/mean": float(np.mean(items)) for key, items in values.items() if items}


def _agent_loop_metrics(groups: list[list[Sample]], failed: int) -> dict[str, float]:
    """The agent-loop metrics of the trained samples that an agent loop generated (the async rollout's, manager.py's
    agent_loop_metrics; a failed loop counts with empty metrics, as there), and agent_loop/num_failed over the step;
    none when no loop ran."""
    ran = [sample for group in groups for sample in sampled(group) if sample.agent_metrics is not None or sample.error]
    if not ran and not failed:
        return {}
    metrics = {"agent_loop/num_failed": float(failed)}
    if ran:
        metrics.update(agent_loop_metrics([sample.num_turns for sample in ran],
                                          [AgentLoopMetrics(**(sample.agent_metrics or {})) for sample in ran],
                                          [(len(sample.prompt_ids), len(sample.response_ids)) for sample in ran]))
    return metrics

