"""A real CUDA out-of-memory in the actor's update fails with the micro-batch, the allocator's numbers and the keys
to change (workers/out_of_memory.py), through the worker the trainer runs (FSDP2, world size 1).

The CPU test (tests/test_out_of_memory.py) raises torch's error from a hook; here the allocator itself runs out.
Most of the device is taken by a ballast tensor first, so that the first micro-batch's logits cannot fit on any
card: 2 rows x 2,048 tokens x 151,936 vocabulary entries are 1.16 GiB in bf16, against the 0.5 GiB left free.

Run on the GPU machine from the repository root:  python -m pytest tests/gpu/test_out_of_memory_gpu.py -q
"""
from __future__ import annotations

import re

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from hybridrl.config.compose import compose_config  # noqa: E402
from hybridrl.config.validation import validate_config  # noqa: E402
from hybridrl.defaults.tiny_model import build_tiny_model  # noqa: E402
from hybridrl.models.spec import policy_model_spec  # noqa: E402
from hybridrl.protocol import DataProto  # noqa: E402
from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker  # noqa: E402
from hybridrl.workers.out_of_memory import GiB, TrainingMemoryError  # noqa: E402
from tiny_gpu import single_gpu_tiny_model  # noqa: E402

PROMPT, RESPONSE, ROWS, TOKEN_BUDGET, VOCAB = 1024, 1024, 4, 4096, 151936
LEFT_FREE = 512 * 1024 ** 2  # bytes the ballast leaves free


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A tiny Qwen2 with Qwen2.5's vocabulary width (the logits are what runs out), in a world of size 1."""
    for _, tokenizer in single_gpu_tiny_model(str(tmp_path_factory.mktemp("tiny"))):  # its tokenizer and world
        yield build_tiny_model(str(tmp_path_factory.mktemp("wide")), tokenizer, max_position_embeddings=4096,
                               vocab_size=VOCAB)


def full_batch() -> DataProto:
    """ROWS rows of PROMPT + RESPONSE attended tokens each: the token budget holds two rows a micro-batch."""
    width = PROMPT + RESPONSE
    input_ids = torch.randint(4, 100, (ROWS, width), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(ROWS, width, dtype=torch.long)
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": mask, "position_ids": torch.arange(width).expand(ROWS, width),
        "responses": input_ids[:, PROMPT:], "response_mask": mask[:, PROMPT:],
        "advantages": torch.ones(ROWS, RESPONSE), "old_log_probs": torch.zeros(ROWS, RESPONSE)})


def test_an_update_out_of_cuda_memory_names_the_micro_batch_the_allocator_and_the_keys(wide_model):
    cfg = validate_config(compose_config([
        f"actor_rollout_ref.model.path={wide_model}", "data.train_files=x.parquet", "data.val_files=x.parquet",
        f"data.max_prompt_length={PROMPT}", f"data.max_response_length={RESPONSE}", f"data.train_batch_size={ROWS}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={ROWS}", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={TOKEN_BUDGET}", "actor_rollout_ref.actor.shuffle=false",
        "actor_rollout_ref.rollout.n=1", "trainer.n_gpus_per_node=1"]))
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, policy_model_spec(cfg), role="actor_rollout_ref", seed=1,
                                   device="cuda")
    worker.init_model()
    # NCCL takes device memory outside torch's allocator when its first collective makes the communicator (the
    # update's first all-reduce would, and fail with a bare CUDA error in the ballast's shadow): make it now
    torch.distributed.all_reduce(torch.zeros(1, device="cuda"))
    free, _ = torch.cuda.mem_get_info()
    ballast = torch.empty(free - LEFT_FREE, dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(TrainingMemoryError) as error:
            worker.update_actor(full_batch())
    finally:
        del ballast
        torch.cuda.empty_cache()
    message = str(error.value)
    print(message)
    assert message.startswith(f"actor update ran out of GPU memory in a micro-batch of 2 sequences and "
                              f"{2 * (PROMPT + RESPONSE)} tokens, with ")
    allocated, unallocated, free_then, total = map(float, re.search(
        r"with ([\d.]+) GiB allocated by this process, ([\d.]+) GiB reserved but unallocated, ([\d.]+) of ([\d.]+) "
        r"GiB free", message).groups())
    assert allocated >= (free - LEFT_FREE) / GiB      # the ballast is counted as this process's
    assert free_then < LEFT_FREE / GiB + 0.05         # and the device had no room left
    assert total == pytest.approx(torch.cuda.get_device_properties(0).total_memory / GiB, abs=0.01)
    assert (f"lower actor_rollout_ref.actor.ppo_max_token_len_per_gpu (now {TOKEN_BUDGET}); or set "
            "actor_rollout_ref.model.enable_gradient_checkpointing=true") in message
    assert "set actor_rollout_ref.model.use_fused_kernels=true" in message
    cause = error.value.__cause__
    assert type(cause) is torch.OutOfMemoryError and "CUDA out of memory" in str(cause)
