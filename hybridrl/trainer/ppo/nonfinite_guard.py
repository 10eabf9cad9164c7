"""No silent non-learning: the controller's checks for numbers that are not finite.

Two kinds of event, checked after the phases of a training step:

- A skipped optimizer step (update_actor, update_critic). The worker skips a mini-batch step whose
  global gradient norm is NaN or inf (stepping would write NaN into every weight). Skipping one step
  now and then is survivable, so it is a counted, bounded event: `actor/skipped_steps` and
  `critic/skipped_steps` say how many of this training step's optimizer steps were skipped, and when
  `trainer.max_consecutive_nonfinite_steps` optimizer steps in a row of one role are skipped (the
  count runs across training steps) the run stops with a NonFiniteTrainingError. A NaN or inf loss
  is counted the same way: its gradient is non-finite too, and the message shows the loss terms.

- A non-finite log-prob at a response position (compute_log_prob: old_log_probs; ref: ref_log_prob;
  likewise the critic's compute_values). This stops the run at once instead of being counted: no
  optimizer step was skipped that a later step could make up for. The forward pass of the current
  (or the frozen reference) weights on this batch is itself broken: either the weights already hold
  NaN/inf, which every later step inherits, or the forward overflows on these inputs; and every loss
  term that reads the value would be NaN, so the update would only burn the skipped-step budget and
  then blame the gradient for what the forward pass did. Stopping here names the phase that
  produced the first bad number.

Each error names the training step, the phase, what was not finite (with the batch keys that hold
non-finite values at response positions, where there are any) and the likely causes.
"""
from __future__ import annotations

import math

import torch

from hybridrl.protocol import DataProto

# Batch keys that feed the losses; a non-finite value in one of them explains a non-finite step.
LOSS_INPUT_KEYS = ("token_level_scores", "token_level_rewards", "reward_baselines", "values", "returns",
                   "advantages", "old_log_probs", "ref_log_prob")
LOSS_TERMS = {"update_actor": ("actor/pg_loss", "actor/kl_loss", "actor/entropy"),
              "update_critic": ("critic/vf_loss", "critic/vpred_mean")}
BATCH_CAUSES = (
    "a reward function or reward model that returns NaN/inf (look at token_level_scores)",
    "advantages or returns computed from such rewards, or from non-finite values / log-probs",
)
UPDATE_CAUSES = (
    "a bf16/fp16 overflow in the update's forward or backward pass",
    "NaN from attention over padded positions (model.use_remove_padding=false)",
    "a learning rate too high (optim.lr), so that the losses blow up",
)
FORWARD_CAUSES = (
    "weights that already hold NaN/inf (a checkpoint or model file that does, or an earlier blow-up)",
    "a bf16/fp16 overflow in the forward pass",
    "NaN from attention over padded positions (model.use_remove_padding=false)",
    "for log-probs, a rollout.temperature so close to 0 that logits / temperature overflow",
)


class NonFiniteTrainingError(RuntimeError):
    """The run stopped because a phase of a training step produced numbers that are not finite."""


class NonFiniteStepGuard:
    """Counts skipped optimizer steps per update phase and stops the run at `max_consecutive` in a row."""

    def __init__(self, max_consecutive: int, world_size: int):
        """max_consecutive: `trainer.max_consecutive_nonfinite_steps`. world_size: data-parallel ranks (every
        rank reports every mini-batch step's metrics, so the workers' lists hold world_size copies)."""
        self.max_consecutive = max_consecutive
        self.world_size = world_size
        self.consecutive = {phase: 0 for phase in LOSS_TERMS}

    def after_update(self, phase: str, worker_metrics: dict[str, list[float]], batch: DataProto,
                     step: int) -> dict[str, float]:
        """Count this update's skipped steps (from its per-step grad_norm); returns `<role>/skipped_steps`.

        Raises NonFiniteTrainingError when the count of consecutive skipped steps reaches the limit.
        """
        role = phase.removeprefix("update_")
        norms = self._per_step(worker_metrics[f"{role}/grad_norm"])
        skipped = 0
        for index, norm in enumerate(norms):
            if math.isfinite(norm):
                self.consecutive[phase] = 0
                continue
            skipped += 1
            self.consecutive[phase] += 1
            if self.consecutive[phase] >= self.max_consecutive:
                raise NonFiniteTrainingError(self._update_message(phase, worker_metrics, batch, step, index,
                                                                  len(norms)))
        return {f"{role}/skipped_steps": float(skipped)}

    def _per_step(self, values: list[float]) -> list[float]:
        """One value per mini-batch step: the first rank's copy (every rank reports the same global value)."""
        return list(values)[:len(values) // self.world_size]

    def _update_message(self, phase: str, worker_metrics: dict[str, list[float]], batch: DataProto, step: int,
                        index: int, num_steps: int) -> str:
        terms = ", ".join(f"{key}={self._per_step(worker_metrics[key])[index]:g}"
                          for key in (f"{phase.removeprefix('update_')}/grad_norm", *LOSS_TERMS[phase])
                          if key in worker_metrics)
        bad_inputs = _non_finite_loss_inputs(batch)
        if bad_inputs:
            evidence = f"Non-finite values in this step's batch: {'; '.join(bad_inputs)}."
            causes = BATCH_CAUSES
        else:
            evidence = ("The batch's rewards, advantages and log-probs are all finite at response positions, so the "
                        "non-finite numbers arose in the update's own forward or backward pass.")
            causes = UPDATE_CAUSES
        return (f"{phase}: {self.consecutive[phase]} consecutive optimizer steps had a non-finite gradient norm "
                f"and were skipped (no weights changed), the last at training step {step} (mini-batch step "
                f"{index + 1} of {num_steps}); the run stops at trainer.max_consecutive_nonfinite_steps="
                f"{self.max_consecutive}. At that step: {terms}. {evidence} Likely causes: {'; '.join(causes)}.")


def check_finite_at_responses(batch: DataProto, key: str, phase: str, step: int) -> None:
    """Raise NonFiniteTrainingError at once if batch[key] (a forward pass's output) is NaN/inf at a response."""
    mask = batch.batch["response_mask"].bool()
    bad = mask & ~torch.isfinite(batch.batch[key])
    if bad.any():
        raise NonFiniteTrainingError(
            f"{phase}: {key} is not finite at {int(bad.sum())} of {int(mask.sum())} response positions "
            f"(rows {_rows(bad)}) at training step {step}; the run stops at once (an update on them could "
            f"only skip its steps). Likely causes: {'; '.join(FORWARD_CAUSES)}.")


def _non_finite_loss_inputs(batch: DataProto) -> list[str]:
    """The loss inputs of the batch that are NaN/inf at response positions (per row for per-row keys), described."""
    mask = batch.batch["response_mask"].bool()
    found = []
    for key in LOSS_INPUT_KEYS:
        if key not in batch.batch:
            continue
        values = batch.batch[key]
        per_token = values.dim() == 2  # (rows, response positions); reward_baselines has one value per row
        bad = ~torch.isfinite(values) & mask if per_token else ~torch.isfinite(values)
        if bad.any():
            where = "response positions" if per_token else "rows"
            found.append(f"{key} at {int(bad.sum())} {where} (rows {_rows(bad)})")
    return found


def _rows(bad: torch.Tensor, shown: int = 8) -> str:
    """The rows holding a True, e.g. "0, 3, 5" or "0, 1, 2, 3, 4, 5, 6, 7 and 8 more"."""
    rows = torch.nonzero(bad.reshape(len(bad), -1).any(dim=-1)).flatten().tolist()
    more = f" and {len(rows) - shown} more" if len(rows) > shown else ""
    return ", ".join(map(str, rows[:shown])) + more
