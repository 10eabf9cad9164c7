"""Trainer mode <-> rollout mode for one rank, driven through the engine lifecycle contract (rollout/base.py).

The same order serves every engine (hf, sglang, a user's `custom_cls`):

    rollout_mode(weights_version):
        1. the trainer's parked parameters come to the device (param_offload; the sync reads them)
        2. resume(("weights",))                                           timing_s/resume_weights
        3. update_weights(iter_rollout_weights(actor))                    timing_s/update_weights
           -- skipped when the engine shares the trainer's module (hf), or already holds
              `weights_version` (see below)
        4. park the trainer's state again (an engine with its own copy has room for the KV cache)
                                                                          timing_s/offload_trainer
        5. resume(("kv_cache",))                                          timing_s/resume_kv_cache
    trainer_mode():
        release(("kv_cache", "weights"))                                  timing_s/release_engine
        park the trainer's state (the next phase loads what it needs)

If rollout_mode fails (e.g. sglang's EngineMemoryError: no room to resume), what did resume is
released again, so the rank is back in trainer mode, and the error propagates.

Weights version: the worker counts its weight changes (one per optimizer step or checkpoint load).
The switch remembers the version the engine was last loaded with, and forgets it when a release
drops the weight contents (`weights_survive_release` false, sglang's memory saver). So validation
before training and step 1 push the same weights once, for an engine that keeps them.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from hybridrl.models.offload import FSDPOffload
from hybridrl.workers.rollout.weight_sync import iter_rollout_weights

logger = logging.getLogger(__name__)

ALL_TAGS = ("kv_cache", "weights")


class RolloutModeSwitch:
    def __init__(self, actor_module: nn.Module, rollout: Any, trainer_state: FSDPOffload | None = None,
                 reload_trainer_state: bool = False):
        """`actor_module`: the FSDP actor (the weights' source). `trainer_state`: its parking rules
        (fsdp_config.param_offload / optimizer_offload); with an engine that holds its own copy, what they
        name waits in CPU memory during the rollout. reload_trainer_state: bring it back in trainer_mode (the
        worker passes False: each of its phases loads what it needs; the benchmark times the full round trip)."""
        self.actor_module = actor_module
        self.rollout = rollout
        self.trainer_state = trainer_state
        self.reload_trainer_state = reload_trainer_state
        self.in_rollout_mode = False
        self.engine_weights_version: int | None = None  # the version the engine holds; None: unknown / lost
        self.weights_pushed = 0  # pushes so far (a test reads it)

    @property
    def shares_trainer_weights(self) -> bool:
        return bool(getattr(self.rollout, "shares_trainer_weights", False))

    def rollout_mode(self, weights_version: int) -> dict[str, float]:
        """Trainer mode -> rollout mode with the trainer's weights of `weights_version`; returns the parts' timings."""
        if self.in_rollout_mode:
            raise RuntimeError("rollout_mode: already in rollout mode (call trainer_mode first)")
        timing: dict[str, float] = {}
        try:
            if self.trainer_state is not None:
                self.trainer_state.load()
            self._timed(timing, "resume_weights", self.rollout.resume, ("weights",))
            if not self.shares_trainer_weights and self.engine_weights_version != weights_version:
                self._timed(timing, "update_weights", self.rollout.update_weights,
                            iter_rollout_weights(self.actor_module))
                self.engine_weights_version = weights_version
                self.weights_pushed += 1
            if not self.shares_trainer_weights and self.trainer_state is not None \
                    and self.trainer_state.parks_anything:
                self._timed(timing, "offload_trainer", self.trainer_state.park)
            self._timed(timing, "resume_kv_cache", self.rollout.resume, ("kv_cache",))
        except BaseException:
            self._give_back_after_failure()
            raise
        self.in_rollout_mode = True
        return {**{f"timing_s/{part}": seconds for part, seconds in timing.items()}, **self._engine_metrics()}

    def trainer_mode(self) -> dict[str, float]:
        """Rollout mode -> trainer mode: the engine releases its memory; returns the parts' timings."""
        if not self.in_rollout_mode:
            raise RuntimeError("trainer_mode: not in rollout mode (call rollout_mode first)")
        timing: dict[str, float] = {}
        self.in_rollout_mode = False
        try:
            self._timed(timing, "release_engine", self.rollout.release, ALL_TAGS)
            if not getattr(self.rollout, "weights_survive_release", False):
                self.engine_weights_version = None
        finally:
            if self.trainer_state is not None:
                self.trainer_state.park()
                if self.reload_trainer_state:
                    self._timed(timing, "reload_trainer", self.trainer_state.load, True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return {**{f"timing_s/{part}": seconds for part, seconds in timing.items()}, **self._engine_metrics()}

    def _give_back_after_failure(self) -> None:
        """A failed rollout_mode: release whatever did resume (nothing generated; the trainer keeps its state)."""
        self.engine_weights_version = None
        try:
            self.rollout.release(ALL_TAGS)
        except Exception:  # the original error is the one to report
            logger.exception("rollout_mode failed; releasing the engine's memory failed too")
        if self.trainer_state is not None:
            self.trainer_state.park()

    def _engine_metrics(self) -> dict[str, float]:
        take = getattr(self.rollout, "take_metrics", None)
        return take() if take is not None else {}

    @staticmethod
    def _timed(timing: dict[str, float], part: str, fn, *args):
        synchronize = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        if synchronize:
            synchronize()
        started = time.perf_counter()
        result = fn(*args)
        if synchronize:
            synchronize()
        timing[part] = time.perf_counter() - started
        return result
