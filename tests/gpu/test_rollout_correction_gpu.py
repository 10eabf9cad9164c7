"""GPU check of the rollout correction on a real mismatch: SGLang (bf16) log-probs against the FSDP actor's.

Run on the GPU machine from the repository root (sglang importable):  python -m pytest tests/gpu -q -k correction

With synced weights the only mismatch is numerical (bf16 kernels): IS weights ~1, almost nothing rejected.
After the FSDP weights change under the engine's feet (a stale engine, as in asynchronous training) the same
responses must show a clear mismatch: rejections, kl and chi2 well above the synced case. Then one actor update
with the weights runs and gives a finite loss.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("sglang")

from benchmarks.hybrid_engine import random_prompts, rollout_window  # noqa: E402
from hybridrl.algorithms.core_algos import compute_advantage  # noqa: E402
from hybridrl.algorithms.rollout_correction import compute_rollout_correction_and_rejection_mask  # noqa: E402
from tests.gpu.test_engine_hybrid import (PROMPT_LENGTH, VOCAB, fsdp_log_probs, hybrid, perturb,  # noqa: E402,F401
                                          undo)

SETTINGS = dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token", rollout_rs_threshold=2.0)


@pytest.fixture(scope="module")
def engine() -> str:
    """test_engine_hybrid's `hybrid` fixture here has SGLang only (its config: 8 groups of n=4 rows per mini-batch)."""
    return "sglang"


def correction(hybrid, output):
    return compute_rollout_correction_and_rejection_mask(fsdp_log_probs(hybrid, output),
                                                         output.batch["rollout_log_probs"],
                                                         output.batch["response_mask"], **SETTINGS)


def test_correction_is_near_identity_when_synced_and_reacts_to_a_stale_engine(hybrid):
    prompts = random_prompts(32, PROMPT_LENGTH, VOCAB, seed=11, ragged=True)
    with rollout_window(hybrid.switch):
        output = hybrid.rollout.generate_sequences(prompts)
    synced = correction(hybrid, output)
    m = synced.metrics
    print(f"\nsynced: {m}")
    assert all(math.isfinite(value) for value in m.values())
    assert abs(m["rollout_corr/kl"]) < 1e-3 and abs(m["rollout_corr/rollout_is_mean"] - 1) < 0.05
    assert m["rollout_corr/rollout_rs_masked_fraction"] < 0.01
    padding = ~output.batch["response_mask"].bool()
    assert synced.rollout_is_weights[padding].abs().sum() == 0

    originals = perturb(hybrid.module, scale=0.02, seed=12)  # the trainer moved on; the responses are stale
    try:
        stale = correction(hybrid, output).metrics
    finally:
        undo(hybrid.module, originals)
    print(f"stale: {stale}")
    assert stale["rollout_corr/rollout_rs_masked_fraction"] > 10 * max(m["rollout_corr/rollout_rs_masked_fraction"],
                                                                        1e-3)
    assert stale["rollout_corr/k3_kl"] > 10 * max(m["rollout_corr/k3_kl"], 1e-4)


def test_an_actor_update_with_is_weights_gives_a_finite_loss(hybrid):
    prompts = random_prompts(32, PROMPT_LENGTH, VOCAB, seed=13, ragged=True)
    with rollout_window(hybrid.switch):
        output = hybrid.rollout.generate_sequences(prompts)
    result = correction(hybrid, output)
    batch = output  # 8 groups of n=4 rows: one mini-batch of the fixture's actor
    batch.batch["old_log_probs"] = fsdp_log_probs(hybrid, output)
    batch.batch["response_mask"] = result.response_mask
    batch.batch["rollout_is_weights"] = result.rollout_is_weights
    batch.batch["token_level_rewards"] = torch.zeros_like(batch.batch["old_log_probs"])
    batch.batch["token_level_rewards"][:, 0] = torch.randn(len(batch))
    batch.non_tensor_batch["uid"] = np.array([str(i // 4) for i in range(len(batch))], dtype=object)
    batch = compute_advantage(batch, adv_estimator="grpo", norm_adv_by_std_in_grpo=True)
    batch.meta_info["temperature"] = 1.0
    metrics = hybrid.actor.update_policy(batch)
    assert all(math.isfinite(v) for v in metrics["actor/pg_loss"]), metrics
