"""The data flow as a stream (async_training.mode=fully_async): groups generate without pause on the rollout pool and
each training step takes the first ones to finish that are fresh enough.

    prompt source (buffer first, then data) ──► in flight on the engine servers (GroupRollout.submit)
         ▲                                          │ as each finishes (while a step waits for groups):
         │                                          ▼ score_group, dynamic-sampling filter: kept or dropped (counted)
         │                                     kept, in finishing order
         │                                          │ take(count, oldest_version): the first `count` whose oldest
         │                                          ▼ token version >= oldest_version; staler ones requeued
         └──── requeued (reset) / recalled ────  (reset, into the buffer first) or dropped (stale_samples)

At most `capacity` ((max_staleness + 1) x train_batch_size, rollout/engine_load.py sizes the engines for it) groups
are in flight or kept at once; the stream is topped up while a step waits (`take`) and right after each weight
sync, and groups are scored only then, on the controller's one thread: what finishes during an update waits. What
it counts from a take to the weight sync after the update (data_flow/*, async_training/dropped_groups and
requeued_groups) is that step's `step_metrics`.

`recall` stops what is in flight (the engine servers abort: each group comes back with its tokens so far), and puts
those groups first in the prompt source's buffer: with data_flow.partial_rollout as they are (continued under the
new weights when they are next taken, so their tokens span versions; staleness counts the oldest), else reset
(finished groups stay as they are: their samples are whole). Partial rollout recalls before every weight sync;
`return_to_source` (a checkpoint) recalls and puts the kept groups first of all. Groups that come back from the
buffer finished (kept or recalled ones) are scored and filtered there and then, never sent to the engines again.

A cap on the generation (data_flow.max_num_gen_batches, or algorithm.filter_groups') counts groups sent during one
take: at most max_num_gen_batches x train_batch_size; reached with too few kept, data_flow.insufficient_groups says
what happens (group_rollout.too_few_groups).
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import ray

from hybridrl.data.prompt_source import PromptSource
from hybridrl.data.sample import ABORTED, COMPLETED, TRUNCATED, Sample, reset_group
from hybridrl.trainer.ppo.group_rollout import GroupRollout, too_few_groups


class GroupStream:
    def __init__(self, rollout: GroupRollout, source: PromptSource, capacity: int, stale_samples: str):
        """capacity: groups in flight or kept ahead of the trainer; stale_samples: "drop" or "requeue"."""
        if stale_samples not in ("drop", "requeue"):
            raise ValueError(f"async_training.stale_samples must be drop or requeue, got {stale_samples!r}")
        self.rollout = rollout
        self.source = source
        self.capacity = capacity
        self.stale_samples = stale_samples
        self.in_flight: dict[ray.ObjectRef, None] = {}
        self.kept: list[list[Sample]] = []  # finished, scored, kept; in finishing order
        self._submitted = 0  # groups sent to the engines since the step's take began

    # ------------------------------------------------------------------ what a step calls
    def take(self, count: int, oldest_version: int, step: int) -> list[list[Sample]]:
        """The first `count` kept groups to finish whose oldest token version is `oldest_version` or later (fewer
        only when the generation cap is reached and data_flow.insufficient_groups=train)."""
        self._start_counting(step)
        taken: list[list[Sample]] = []
        while len(taken) < count:
            if not self.kept:
                self._fill(step, cap=self._cap())
                if not self.kept and not self.in_flight:  # the generation cap is reached
                    return too_few_groups(self.rollout, taken, self.source)
                if not self.kept:
                    for ref, group in self.rollout.wait(list(self.in_flight)):
                        del self.in_flight[ref]
                        self._finished(group)
                continue
            group = self.kept.pop(0)
            if oldest_token_version(group) >= oldest_version:
                taken.append(group)
            elif self.stale_samples == "requeue":
                self.source.add_groups([reset_group(group)], first=True)
                self.rollout.record("async_training/requeued_groups", 1)
            else:
                self.rollout.record("async_training/dropped_groups", 1)
        self._fill(step, cap=self._cap())
        return taken

    @contextmanager
    def weight_sync(self, next_step: int):
        """Around a weight sync: with data_flow.partial_rollout, the groups in flight are recalled first (then taken
        again first: continued under the new weights); without it the engines finish the requests under way on the
        old weights. Afterwards the stream is topped up at once (for `next_step`), so that the engines go on while
        the controller logs, validates or saves."""
        if self.rollout.flow.partial_rollout:
            self.recall()
        yield
        self._fill(next_step, cap=None)

    def step_metrics(self, groups: list[list[Sample]]) -> dict[str, float]:
        """The step's data_flow/* and async_training/{dropped,requeued}_groups, groups_ahead: what was counted since
        its take began (call it after the weight sync, so that the sync's recall counts in it)."""
        metrics = self.rollout.step_metrics(groups, self.source)
        metrics["data_flow/num_submitted_groups"] = float(self._submitted)
        metrics["async_training/groups_ahead"] = float(self.groups_ahead())
        return metrics

    def groups_ahead(self) -> int:
        return len(self.in_flight) + len(self.kept)

    def recall(self) -> None:
        """Abort what is in flight, wait for every group to come back, and put them first in the buffer (as they
        are with partial rollout, else reset unless finished)."""
        if not self.in_flight:
            return
        groups = self.rollout.abort(list(self.in_flight))
        self.in_flight.clear()
        if not self.rollout.flow.partial_rollout:
            groups = [reset_group(group) if any(s.status == ABORTED for s in group) else group for group in groups]
        self.source.add_groups(groups, first=True)

    def return_to_source(self) -> None:
        """Everything the stream holds back into the prompt source's buffer, the kept groups first (a checkpoint
        saves the buffer; the resumed run takes them in this order)."""
        self.recall()
        self.source.add_groups(self.kept, first=True)
        self.kept = []

    # ------------------------------------------------------------------ inside
    def _start_counting(self, step: int) -> None:
        self.rollout.start_counting(step)
        for count in ("data_flow/num_dropped_groups", "data_flow/num_aborted_groups",
                      "data_flow/num_aborted_samples", "async_training/dropped_groups",
                      "async_training/requeued_groups"):  # every step logs each, 0 too
            self.rollout.record(count, 0)
        self._submitted = 0

    def _cap(self) -> int | None:
        """Groups this take may still send (None: no cap)."""
        if self.rollout.max_num_gen_batches == 0:
            return None
        return max(0, self.rollout.max_num_gen_batches * self.rollout.train_batch_size - self._submitted)

    def _fill(self, step: int, cap: int | None) -> None:
        """Top the stream up to `capacity` from the prompt source: finished groups from the buffer are judged at
        once, the others sent to the engines (at most `cap` of them; None: no cap)."""
        while self.groups_ahead() < self.capacity:
            wanted = self.capacity - self.groups_ahead()
            groups = self.source.get_groups(wanted if cap is None else min(wanted, cap), step)
            if not groups:  # the cap is reached (or a finite source is used up)
                return
            for group in groups:
                if is_finished(group):
                    self._finished(group)
                    continue
                self.in_flight[self.rollout.submit(group)] = None
                self._submitted += 1
                cap = None if cap is None else cap - 1

    def _finished(self, group: list[Sample]) -> None:
        """A finished group: scored, then kept or dropped by the dynamic-sampling filter (counted)."""
        self.rollout.score_group(group)
        if self.rollout.keep(group):
            self.kept.append(group)
        else:
            self.rollout.drop(group)


def is_finished(group: list[Sample]) -> bool:
    """Every sample generated to its end (none pending or aborted)."""
    return all(sample.status in (COMPLETED, TRUNCATED) for sample in group)


def oldest_token_version(group: list[Sample]) -> int:
    """The oldest policy version among a group's generated tokens (inserted tokens carry -1): its staleness counts
    from there (a very large number when none was generated)."""
    versions = [version for sample in group for version in sample.token_versions if version >= 0]
    return min(versions) if versions else int(np.iinfo(np.int64).max)
