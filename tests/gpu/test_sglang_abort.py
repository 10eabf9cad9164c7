"""GPU proof of partial rollout's abort on the SGLang engine server (workers/rollout/sglang_async.py).

    rollout_mode -> long requests (ignore_eos, 1024 tokens) -> POST /abort after 1 s -> every request answers with
    its tokens so far, stop_reason "aborted", as many log-probs as tokens -> a new request answers aborted at once
    -> trainer_mode / rollout_mode -> requests generate again; a continued request (prompt + tokens so far) runs

Run on the GPU machine from the repository root:

    python -m pytest tests/gpu/test_sglang_abort.py -q
"""
from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the hybrid engine needs CUDA", allow_module_level=True)
pytest.importorskip("sglang")

from benchmarks.hybrid_engine import (QWEN25_05B, hybrid_config, init_single_gpu_process_group,  # noqa: E402
                                      make_qwen05b_model, random_prompts)
from hybridrl.agent_loop.server_manager import AsyncLLMServerManager, abort_servers  # noqa: E402
from hybridrl.models.spec import policy_model_spec  # noqa: E402
from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker  # noqa: E402

PROMPT_LENGTH, RESPONSE_LENGTH = 64, 1024
EOS, PAD = 151643, 151643


def test_abort_returns_tokens_so_far_and_the_next_rollout_mode_generates_again(tmp_path_factory):
    model_dir = make_qwen05b_model(os.environ.get("HYBRIDRL_GPU_MODEL_DIR") or str(tmp_path_factory.mktemp("q05ab")))
    init_single_gpu_process_group()
    config = hybrid_config(model_dir, [
        f"data.max_prompt_length={PROMPT_LENGTH}", f"data.max_response_length={RESPONSE_LENGTH}",
        "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true",
        "actor_rollout_ref.rollout.ignore_eos=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"])
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, policy_model_spec(config),
                                   role="actor_rollout", seed=1, device="cuda")
    worker.init_model()
    address = worker.start_engine_server([EOS], PAD)
    prompts = random_prompts(8, PROMPT_LENGTH, QWEN25_05B["vocab_size"], seed=3, ragged=True)
    prompt_lists = [row[mask.bool()].tolist() for row, mask in
                    zip(prompts.batch["input_ids"], prompts.batch["attention_mask"])]
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}

    def ask(requests):
        async def run():
            manager = AsyncLLMServerManager([address])
            try:
                return await asyncio.gather(*(manager.generate(f"r{i}-{time.time()}", prompt_ids=ids,
                                                               sampling_params=extra)
                                              for i, (ids, extra) in enumerate(requests)))
            finally:
                await manager.close()
        return asyncio.new_event_loop().run_until_complete(run())

    worker.rollout_mode()
    timer = threading.Timer(1.0, abort_servers, args=([address],))
    timer.start()
    started = time.perf_counter()
    answers = ask([(ids, params) for ids in prompt_lists])
    took = time.perf_counter() - started
    late = ask([(prompt_lists[0], params)])[0]
    worker.trainer_mode()
    worker.rollout_mode()
    continued = ask([(prompt_lists[0] + answers[0].token_ids,
                      {**params, "max_tokens": RESPONSE_LENGTH - len(answers[0].token_ids)})])[0]
    worker.trainer_mode()

    assert took < 30
    for answer in answers:
        assert answer.stop_reason == "aborted" and 0 < len(answer.token_ids) < RESPONSE_LENGTH
        assert len(answer.log_probs) == len(answer.token_ids)
    assert late.stop_reason == "aborted" and late.token_ids == []
    assert continued.stop_reason == "length"
    assert len(continued.token_ids) == RESPONSE_LENGTH - len(answers[0].token_ids)
