"""What a person watching the console sees: a progress bar over the run and a compact table per step.

The bar (tqdm, on stderr) shows steps done / total, the last step's time, tokens per second and the ETA. The table
(stdout) shows the handful of metrics that tell whether training is healthy, by verl's metric names; metrics that
a run does not produce (no critic, no KL loss, no GPU) are simply not in it.
"""
from __future__ import annotations

import sys

from tqdm import tqdm

from hybridrl.trainer.tracking import format_value

# (label in the table, metric name), in display order.
HEADLINE_METRICS = (
    ("score", "critic/score/mean"),
    ("reward", "critic/rewards/mean"),
    ("resp_len", "response_length/mean"),
    ("kl", "actor/ppo_kl"),
    ("kl_loss", "actor/kl_loss"),
    ("kl_penalty", "actor/reward_kl_penalty"),
    ("entropy", "actor/entropy"),
    ("pg_loss", "actor/pg_loss"),
    ("vf_loss", "critic/vf_loss"),
)
STEP_TIME_METRIC = "timing_s/step"
TOKENS_METRIC = "perf/total_num_tokens"
MEMORY_PREFIX = "perf/max_memory"


def format_step_table(metrics: dict[str, float], step: int, total_steps: int) -> str:
    """Up to three lines: headline metrics, per-phase timings (timing_s/*), GPU memory (perf/max_memory_*)."""
    headline = [f"{label} {format_value(metrics[name])}" for label, name in HEADLINE_METRICS if name in metrics]
    lines = [f"step {step}/{total_steps} | " + " | ".join(headline)]
    timings = [f"{name.removeprefix('timing_s/')} {value:.2f}" for name, value in metrics.items()
               if name.startswith("timing_s/")]
    if timings:
        lines.append("  time(s) | " + " | ".join(timings))
    memory = [f"{name.removeprefix('perf/')} {value:.2f}" for name, value in metrics.items()
              if name.startswith(MEMORY_PREFIX)]
    if memory:
        lines.append("  gpu mem(GB) | " + " | ".join(memory))
    return "\n".join(lines)


class ProgressReporter:
    """One bar over ``total_steps``; call ``update(step, metrics)`` once per finished step, ``close()`` at the end.

    ``initial_step`` is the step a resumed run starts after, so the bar and ETA count only the steps left.
    """

    def __init__(self, total_steps: int, initial_step: int = 0, show_table: bool = True, file=None):
        self.total_steps = total_steps
        self.show_table = show_table
        self.table_file = file if file is not None else sys.stdout
        self.bar = tqdm(total=total_steps, initial=initial_step, desc="Training Progress", unit="step",
                        file=file if file is not None else sys.stderr, dynamic_ncols=True)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        postfix = {}
        if STEP_TIME_METRIC in metrics:
            postfix["step_s"] = f"{metrics[STEP_TIME_METRIC]:.2f}"
            if TOKENS_METRIC in metrics and metrics[STEP_TIME_METRIC] > 0:
                postfix["tok/s"] = f"{metrics[TOKENS_METRIC] / metrics[STEP_TIME_METRIC]:.0f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(step - self.bar.n)
        if self.show_table:
            self.bar.write(format_step_table(metrics, step, self.total_steps), file=self.table_file)

    def close(self) -> None:
        self.bar.close()
