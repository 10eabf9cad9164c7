"""What the one-process GPU worker tests share: a tiny Qwen2 built here, its prompts, and a world of size 1.

Imported by tests/gpu/test_workers_gpu.py and tests/gpu/test_scale_features_gpu.py (pytest puts this
folder on sys.path for them).
"""
from __future__ import annotations

import os
import socket

import torch.distributed as dist

from hybridrl.protocol import DataProto
from hybridrl.utils.tiny_model import build_tiny_model, build_tokenizer

PROMPT_LENGTH, RESPONSE_LENGTH = 8, 16
TEXTS = ["what is 12 plus 7 ? the answer is 19", "count to five : 1 2 3 4 5", "the cat sat on the mat",
         "seven times six is 42"]


def single_gpu_tiny_model(model_dir: str):
    """Yields (model dir, tokenizer) with RANK/WORLD_SIZE/MASTER_* set for a world of size 1 on a free port (the
    workers' init_process_group reads them); destroys the process group afterwards. Use as a fixture body."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tokenizer = build_tokenizer(TEXTS * 20, vocab_size=128)
    yield build_tiny_model(model_dir, tokenizer, hidden_size=64), tokenizer
    if dist.is_initialized():
        dist.destroy_process_group()


def prompts(tokenizer, validate: bool = False) -> DataProto:
    """TEXTS as left-padded prompts of PROMPT_LENGTH tokens, with the meta_info generate_sequences needs."""
    encoded = tokenizer(TEXTS, padding="max_length", max_length=PROMPT_LENGTH, truncation=True, return_tensors="pt")
    mask = encoded["attention_mask"]
    return DataProto.from_dict({"input_ids": encoded["input_ids"], "attention_mask": mask,
                                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
                               meta_info={"eos_token_id": tokenizer.eos_token_id,
                                          "pad_token_id": tokenizer.pad_token_id, "validate": validate})


def generate(worker, batch: DataProto) -> DataProto:
    """One generation inside a rollout-mode window (rollout_mode, generate_sequences, trainer_mode), as the
    trainer runs it."""
    worker.rollout_mode()
    output = worker.generate_sequences(batch)
    worker.trainer_mode()
    return output
