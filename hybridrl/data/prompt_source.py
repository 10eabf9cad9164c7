"""The prompt source of the data flow: groups come from the buffer first, then from the training data.

    buffer (groups added back: aborted ones with their tokens so far, or reset ones)
      └─ data_flow.buffer_filter picks which (default pop_first: first in, first out)
    training data (trainer/ppo/checkpointing.TrainDataPosition, the same batches a plain run sees, in order)
      └─ each row becomes a group of rollout.n pending samples (and, for ReMax, its pending greedy baseline last:
         data/sample.py)

Rows of a dataset batch not yet handed out wait in `pending_rows`, so a step that asks for fewer groups than a
batch holds takes the next rows next time. `state_dict` holds the buffer (Sample records as plain values), the
pending rows and the index counters; the dataloader's position is saved by checkpointing.py next to it. Together
they resume exactly: the resumed run hands out the groups (and the partial tokens) the uninterrupted one would.

`prefetch` reads the next dataset batch on a thread (the synchronous schedule calls it once a step has its groups),
so tokenising the next step's prompts overlaps the workers' update instead of delaying the next generation. Its
rows are pending rows like any others: `get_groups` and `state_dict` wait for them first, so the groups handed out,
and a checkpoint, are the same as without it.
"""
from __future__ import annotations

import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Iterator
from typing import Any, Callable, Optional

from hybridrl.data.filters import pop_first
from hybridrl.data.sample import Sample, baseline_of, new_group, sampled, to_plain, with_baseline


class PromptSource:
    def __init__(self, batches: Callable[[], Iterator[dict]], n: int, config,
                 buffer_filter: Optional[Callable] = None, baseline: bool = False):
        """batches: makes the iterator of collated dataset batches (training: TrainDataPosition.batches, endless;
        validation: one pass over the loader, after which get_groups hands out fewer groups, then none);
        n: sampled responses per group; config: the run config (handed to the buffer filter); baseline: every group
        also has its greedy baseline, last (ReMax)."""
        self.batches = batches
        self.n = n
        self.baseline = baseline
        self.config = config
        self.buffer_filter = buffer_filter or pop_first
        self.buffer: list[list[Sample]] = []
        self.pending_rows: list[dict[str, Any]] = []
        self.next_group_index = 0
        self.next_sample_index = 0
        self._batches: Optional[Iterator[dict]] = None  # created on first use, after a resume set the position
        self._prefetched: Optional[Future] = None  # the next batch's rows being read (prefetch)
        self._reader: Optional[ThreadPoolExecutor] = None

    def get_groups(self, num_groups: int, step: int) -> list[list[Sample]]:
        """Up to `num_groups` from the buffer (as the buffer filter picks), the rest fresh from the data."""
        groups = self._from_buffer(num_groups, step)
        self._take_prefetched()
        while len(groups) < num_groups:
            if not self.pending_rows:
                batch = next(self._data_batches(), None)
                if batch is None:  # a finite source (validation) is used up
                    break
                self.pending_rows = _rows(batch)
            row = self.pending_rows.pop(0)
            groups.append(new_group(row, self.n, self.next_group_index, self.next_sample_index, self.baseline))
            self.next_group_index += 1
            self.next_sample_index += self.n + int(self.baseline)
        return groups

    def prefetch(self) -> None:
        """Start reading the next dataset batch's rows on a thread, unless rows are pending already. A row that
        fails (bad input) raises in the `get_groups` or `state_dict` that waits for it."""
        if self.pending_rows or self._prefetched is not None:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="prompt-prefetch")
        batches = self._data_batches()

        def next_rows() -> list[dict[str, Any]]:
            time.sleep(YIELD_TO_CALLER_S)
            batch = next(batches, None)
            return [] if batch is None else _rows(batch)

        self._prefetched = self._reader.submit(next_rows)

    def _take_prefetched(self) -> None:
        """The prefetched rows (if any) become the pending rows; a finite source's end gives none."""
        if self._prefetched is not None:
            future, self._prefetched = self._prefetched, None
            self.pending_rows = future.result()

    def add_groups(self, groups: list[list[Sample]], first: bool = False) -> None:
        """Put whole groups back (partial rollout's aborted ones, or groups a rollout did not use); `first`: before
        the groups already there (finished groups a checkpoint returns, which the next step would have trained)."""
        for group in groups:
            if len(sampled(group)) != self.n or len({sample.group_index for sample in group}) != 1 \
                    or (baseline_of(group) is not None) != self.baseline or len(group) != self.n + self.baseline:
                what = " and its baseline last" if self.baseline else ""
                raise ValueError(f"add_groups: a group must be {self.n} samples (rollout.n){what} of one prompt, got "
                                 f"{len(group)} samples ({sum(s.is_baseline for s in group)} baselines) of group "
                                 f"indices {sorted({s.group_index for s in group})}")
        self.buffer = [*groups, *self.buffer] if first else [*self.buffer, *groups]

    def _from_buffer(self, num_groups: int, step: int) -> list[list[Sample]]:
        if not self.buffer or num_groups == 0:
            return []
        # the filter sees the groups' sampled responses (ReMax's baselines left out, as every filter sees them)
        given = [sampled(group) for group in self.buffer] if self.baseline else list(self.buffer)
        views = {id(view): group for view, group in zip(given, self.buffer)}
        try:
            taken = list(self.buffer_filter(self.config, step, given, num_groups))
        except Exception as err:  # user logic: fail the step, naming the hook, with its traceback
            raise RuntimeError(f"data_flow.buffer_filter raised:\n{traceback.format_exc()}") from err
        if len(taken) > num_groups:
            raise ValueError(f"data_flow.buffer_filter returned {len(taken)} groups, more than the {num_groups} "
                             f"asked for")
        if any(id(group) not in views for group in taken):
            raise ValueError("data_flow.buffer_filter must return groups of the buffer it was given")
        taken = [views[id(group)] for group in taken]
        taken_ids = {id(group) for group in taken}  # a filter that also deleted them in place (slime's) is fine
        remaining = [group for group in self.buffer if id(group) not in taken_ids]
        self.buffer = remaining
        return taken

    def _data_batches(self) -> Iterator[dict]:
        if self._batches is None:
            self._batches = self.batches()
        return self._batches

    def state_dict(self) -> dict[str, Any]:
        self._take_prefetched()  # its batch counts as read in the data position: its rows are pending
        return {"buffer": [[sample.to_dict() for sample in group] for group in self.buffer],
                "pending_rows": to_plain(self.pending_rows), "next_group_index": self.next_group_index,
                "next_sample_index": self.next_sample_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A buffered group of a run whose estimator did (not) use ReMax's baseline gets a pending one (loses it)."""
        self._take_prefetched()  # read from the position being replaced: dropped with it
        self.pending_rows = list(state["pending_rows"])
        self.next_group_index = state["next_group_index"]
        self.next_sample_index = state["next_sample_index"]
        self.buffer = []
        for saved in state["buffer"]:
            group = [Sample.from_dict(sample) for sample in saved]
            fitted = with_baseline(group, self.baseline, index=self.next_sample_index)
            self.next_sample_index += len(fitted) > len(group)
            self.buffer.append(fitted)
        self._batches = None


# How long the reading thread waits before it reads: the caller's next worker call goes out first. Reading (the chat
# template, the tokenizer: Python holding the GIL) started at once took the GIL from the controller while it planned
# and submitted that call, which waited up to the interpreter's 5 ms switch interval for it (the synchronous step's
# compute_log_prob went out 3.7 ms after its submission began, against 1.45 ms with no reading thread, on the 2-core
# default). The rows are needed a step later.
YIELD_TO_CALLER_S = 0.005


def _rows(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """A collated dataset batch as one dict per row: its non-tensor columns, plus raw_prompt_ids (from the padded
    prompt when a custom dataset does not give them)."""
    size = len(batch["input_ids"])
    rows = [{key: to_plain(value[i]) for key, value in batch.items() if not hasattr(value, "dim")}
            for i in range(size)]
    for row, ids, mask in zip(rows, batch["input_ids"], batch["attention_mask"]):
        if "raw_prompt_ids" not in row:
            row["raw_prompt_ids"] = ids[mask.bool()].tolist()
    return rows
