"""Token-budget micro-batches across two real gloo ranks: every rank runs the same number of micro-batches.

Kept apart from tests/test_seqlen_balancing.py so the spawned ranks import only torch and the balancing code.
"""
import json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridrl.protocol import DataProto
from hybridrl.data.seqlen_balancing import rearrange_micro_batches


def batch_of_lengths(seqlens: list[int]) -> DataProto:
    attention_mask = torch.zeros(len(seqlens), max(seqlens), dtype=torch.long)
    for row, length in enumerate(seqlens):
        attention_mask[row, :length] = 1
    return DataProto.from_dict({"attention_mask": attention_mask})


def _two_rank_micro_batch_counts(rank: int, work_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{work_dir}/pg_init", rank=rank, world_size=2)
    try:
        # rank 0 fits one micro-batch of 8 tokens; rank 1 needs 4 (two sixes never share a budget of 8)
        data = batch_of_lengths([2, 2, 2, 2] if rank == 0 else [6, 6, 6, 6])
        synced = len(rearrange_micro_batches(data, max_token_len=8)[0])
        local = len(rearrange_micro_batches(data, max_token_len=8, same_micro_num_in_dp=False)[0])
        with open(f"{work_dir}/rank{rank}.json", "w") as file:
            json.dump({"synced": synced, "local": local}, file)
    finally:
        dist.destroy_process_group()


def test_data_parallel_ranks_agree_on_the_micro_batch_count(tmp_path):
    mp.spawn(_two_rank_micro_batch_counts, args=(str(tmp_path),), nprocs=2, join=True)
    counts = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert counts == [{"synced": 4, "local": 1}, {"synced": 4, "local": 4}]
