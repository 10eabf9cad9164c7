"""Rollout mode for HF `generate` on the FSDP-held actor: gather the weights once per generation.

HF generation runs one forward per new token. Under FSDP every forward of a sharded layer would
all-gather that layer's parameters and free them again, i.e. one all-gather per layer per token;
and since each rank stops when its own sequences are finished, ranks would run different numbers
of forwards and the collectives would deadlock. Entering this context gathers every layer once
and keeps it gathered (no collective while generating), leaving frees the gathered copies.

FSDP2: unshard every FSDP module and set reshard_after_forward=False for the duration.
FSDP1: `summon_full_params(writeback=False)` (generation does not change weights). Under mixed
precision (GPU) FSDP1 layers still gather their bf16 copy at each step, so the hf rollout then
makes the ranks step together (HF's synced_gpus); FSDP2 is the efficient path.
Both: the module is put in eval mode (no dropout) and gets its previous mode back on exit.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

from hybridrl.workers.sharding_manager.base import BaseShardingManager


class FSDPHFShardingManager(BaseShardingManager):
    def __init__(self, module: nn.Module, reshard_after_forward: bool = True):
        """`reshard_after_forward` is the training setting of the decoder layers, restored on exit."""
        self.module = module
        self.reshard_after_forward = reshard_after_forward
        self._was_training = False
        self._fsdp1_context = None

    def __enter__(self) -> "FSDPHFShardingManager":
        self._was_training = self.module.training
        self.module.eval()
        if isinstance(self.module, FullyShardedDataParallel):
            self._fsdp1_context = FullyShardedDataParallel.summon_full_params(self.module, writeback=False)
            self._fsdp1_context.__enter__()
        elif isinstance(self.module, FSDPModule):
            self.module.set_reshard_after_forward(False, recurse=True)
            handles = [module.unshard(async_op=True) for module in self._fsdp2_modules()]
            for handle in handles:
                handle.wait()
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        if self._fsdp1_context is not None:
            context, self._fsdp1_context = self._fsdp1_context, None
            context.__exit__(exc_type, exc_value, traceback)
        elif isinstance(self.module, FSDPModule):
            for module in self._fsdp2_modules():
                if module is not self.module:  # the root keeps FSDP's rule: no reshard after forward
                    module.set_reshard_after_forward(self.reshard_after_forward, recurse=False)
                module.reshard()
        self.module.train(self._was_training)

    def _fsdp2_modules(self) -> list[FSDPModule]:
        return [module for module in self.module.modules() if isinstance(module, FSDPModule)]
