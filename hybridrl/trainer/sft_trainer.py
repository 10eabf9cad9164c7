"""Data-parallel SFT with FSDP: cross-entropy on the assistant tokens only, the same code on CPU (gloo) and GPU (nccl).

One optimizer step = `data.train_batch_size` conversations over all ranks, each rank taking its
share in micro-batches of `data.micro_batch_size_per_gpu` (gradient accumulation). The loss is the
mean over every assistant token of the global batch: each rank divides its token-loss sum by the
global token count (one all-reduce), times the world size because FSDP averages gradients over
ranks. So 1 rank and N ranks compute the same update for the same batch.

The result is an ordinary HF model directory, `trainer.default_local_dir/global_step_<N>` (verl's
layout), written atomically (trainer/checkpoint_dir.py) with the tokenizer next to it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.utils import logging as transformers_logging

from hybridrl.trainer.checkpoint_dir import atomic_checkpoint_dir, step_dir_name
from hybridrl.utils.distributed import device_name, init_process_group_once
from hybridrl.models.fsdp_utils import (build_lr_scheduler, build_optimizer, clip_grad_norm, iter_full_state_dict,
                                       load_hf_model, shard_model)
from hybridrl.trainer.progress import ProgressReporter
from hybridrl.data.sft_dataset import IGNORE_INDEX, SFTDataset, collate_right_padded
from hybridrl.trainer.tracking import Tracking


def run_sft_rank(config, tokenizer) -> str:
    """One rank's whole job (the elastic launcher's entry point): join the group, train, save, leave. tokenizer: the
    one run_sft resolved (utils/tokenizer.py), for the data and the saved model alike."""
    transformers_logging.disable_progress_bar()  # one "Loading weights" bar per rank says nothing
    device = device_name() if config.trainer.device == "auto" else config.trainer.device
    init_process_group_once("nccl" if device == "cuda" else "gloo")
    if device == "cpu":  # ranks share the cores; torch would otherwise give each rank all of them
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    torch.manual_seed(config.trainer.seed)

    def load(files):
        return SFTDataset(files, tokenizer, config.data.multiturn.messages_key, config.data.max_length,
                          config.data.truncation)

    trainer = FSDPSFTTrainer(config, tokenizer, load(config.data.train_files),
                             load(config.data.val_files) if config.data.val_files else None, device)
    try:
        return trainer.fit()
    finally:
        dist.destroy_process_group()


class FSDPSFTTrainer:
    """Holds the sharded model, optimizer, schedule and data of one rank; `fit()` runs the whole training.

    Every epoch reshuffles the rows (seeded by trainer.seed and the epoch) and skips the rows that do not
    fill a last whole batch, as verl's SFT does: each step sees exactly data.train_batch_size conversations.
    """

    def __init__(self, config, tokenizer, train_dataset: SFTDataset, val_dataset: SFTDataset | None, device: str):
        self.config = config
        self.tokenizer = tokenizer
        self.device = device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.val_dataset = val_dataset
        self.micro_batch_size = config.data.micro_batch_size_per_gpu
        self.collate = functools.partial(collate_right_padded, pad_token_id=tokenizer.pad_token_id)
        self.train_sampler = DistributedSampler(train_dataset, num_replicas=self.world_size, rank=self.rank,
                                                shuffle=True, seed=config.trainer.seed, drop_last=True)
        self.train_loader = DataLoader(train_dataset, batch_size=config.data.train_batch_size // self.world_size,
                                       sampler=self.train_sampler, collate_fn=self.collate, drop_last=True)
        self.total_steps = self._total_steps(len(train_dataset))
        model = load_hf_model(config.model.partial_pretrain, trust_remote_code=config.model.trust_remote_code,
                              gradient_checkpointing=config.model.enable_gradient_checkpointing)
        self.hf_config = model.config
        self.model = shard_model(model.to(device), strategy=config.model.strategy, device=device,
                                 mixed_precision=device == "cuda")
        self.optimizer = build_optimizer(self.model, config.optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, SimpleNamespace(
            lr_warmup_steps=-1, lr_warmup_steps_ratio=config.optim.warmup_steps_ratio,
            warmup_style=config.optim.lr_scheduler, num_cycles=0.5, min_lr_ratio=0.0),
            total_training_steps=self.total_steps)

    def _total_steps(self, num_rows: int) -> int:
        steps_per_epoch = len(self.train_loader)
        if steps_per_epoch == 0:
            raise ValueError(f"data.train_batch_size={self.config.data.train_batch_size} is more than the "
                             f"{num_rows} training conversations: not one full batch per epoch")
        epoch_steps = steps_per_epoch * self.config.trainer.total_epochs
        requested = self.config.trainer.total_training_steps
        if requested is not None and requested > epoch_steps:
            raise ValueError(f"trainer.total_training_steps={requested} is more than trainer.total_epochs="
                             f"{self.config.trainer.total_epochs} x {steps_per_epoch} steps per epoch = {epoch_steps}; "
                             f"raise trainer.total_epochs")
        return requested if requested is not None else epoch_steps

    def fit(self) -> str:
        """Train for `total_steps`, log `train/loss`, `train/lr`, `train/grad_norm` and `val/loss`; save; return the HF dir."""
        trainer_config = self.config.trainer
        tracking = progress = None
        if self.rank == 0:
            print(f"[hybridrl] SFT: {len(self.train_loader.dataset)} conversations, {self.total_steps} steps of "
                  f"{self.config.data.train_batch_size}, {self.world_size} ranks on {self.device}", flush=True)
            tracking = Tracking(trainer_config.project_name, trainer_config.experiment_name, trainer_config.logger,
                                config=dataclasses.asdict(self.config), local_dir=trainer_config.default_local_dir)
            # The console logger prints a line per step already; a bar would garble those lines.
            if "console" not in trainer_config.logger:
                progress = ProgressReporter(self.total_steps, show_table=False)
        step = 0
        for epoch in range(math.ceil(self.total_steps / len(self.train_loader))):
            self.train_sampler.set_epoch(epoch)
            for batch in self.train_loader:
                step += 1
                started = time.perf_counter()
                metrics = self.training_step(batch)
                metrics["timing_s/step"] = time.perf_counter() - started
                if step == self.total_steps or (trainer_config.test_freq > 0 and step % trainer_config.test_freq == 0):
                    if self.val_dataset is not None:
                        metrics["val/loss"] = self.validation_loss()
                if self.rank == 0:
                    tracking.log(metrics, step)
                    if progress is not None:
                        progress.update(step, metrics)
                if step == self.total_steps:
                    break
        if progress is not None:
            progress.close()
        if tracking is not None:
            tracking.finish()
        return self.save_hf_model(step)

    def training_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step over this rank's share of a global batch; returns global metrics."""
        self.model.train()
        global_tokens = self._all_reduce_sum(float((batch["labels"][:, 1:] != IGNORE_INDEX).sum()))
        loss_sum = 0.0
        for start in range(0, len(batch["input_ids"]), self.micro_batch_size):
            micro = {key: value[start:start + self.micro_batch_size].to(self.device) for key, value in batch.items()}
            token_loss_sum = self._token_loss_sum(micro)
            (token_loss_sum * self.world_size / global_tokens).backward()
            loss_sum += float(token_loss_sum.detach())
        grad_norm = clip_grad_norm(self.model, self.config.optim.clip_grad)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        elif self.rank == 0:
            print(f"[hybridrl] SFT: gradient norm is {grad_norm}; optimizer step skipped", flush=True)
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.lr_scheduler.get_last_lr()[0]
        self.lr_scheduler.step()
        return {"train/loss": self._all_reduce_sum(loss_sum) / global_tokens, "train/lr": lr,
                "train/grad_norm": grad_norm}

    def _token_loss_sum(self, micro: dict[str, torch.Tensor]) -> torch.Tensor:
        """Summed cross-entropy of every labelled token (label at t is predicted from position t-1)."""
        logits = self.model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                            position_ids=micro["position_ids"], use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                               micro["labels"][:, 1:].reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")

    @torch.no_grad()
    def validation_loss(self) -> float:
        """Token-mean loss over the whole validation set, every row counted once.

        Rows are dealt to ranks round robin; the list is padded with "no row" slots so every rank
        runs the same number of forward passes (FSDP's gathers are collectives), and a slot without
        a row contributes no token.
        """
        self.model.eval()
        chunk = self.world_size * self.micro_batch_size
        slots = list(range(len(self.val_dataset)))
        slots += [None] * (-len(slots) % chunk)
        mine = slots[self.rank::self.world_size]
        loss_sum = tokens = 0.0
        for start in range(0, len(mine), self.micro_batch_size):
            items = [self._val_item(index) for index in mine[start:start + self.micro_batch_size]]
            micro = {key: value.to(self.device) for key, value in self.collate(items).items()}
            loss_sum += float(self._token_loss_sum(micro))
            tokens += float((micro["labels"][:, 1:] != IGNORE_INDEX).sum())
        return self._all_reduce_sum(loss_sum) / self._all_reduce_sum(tokens)

    def _val_item(self, index: int | None) -> dict[str, torch.Tensor]:
        if index is not None:
            return self.val_dataset[index]
        filler = self.val_dataset[0]
        return {"input_ids": filler["input_ids"], "labels": torch.full_like(filler["labels"], IGNORE_INDEX)}

    def _all_reduce_sum(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return float(tensor.item())

    def save_hf_model(self, step: int) -> str:
        """Gather the full weights (every rank) and write an HF model dir with the tokenizer (rank 0)."""
        root = self.config.trainer.default_local_dir
        with atomic_checkpoint_dir(root, step) as tmp_dir:
            full_state = {name: tensor.cpu() for name, tensor in iter_full_state_dict(self.model)}
            if self.rank == 0:
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(self.hf_config)
                model.load_state_dict(full_state, assign=True)
                model.tie_weights()
                model.generation_config = _generation_config(self.config.model.partial_pretrain, self.tokenizer)
                model.save_pretrained(tmp_dir, safe_serialization=True)
                self.tokenizer.save_pretrained(tmp_dir)
        return os.path.join(root, step_dir_name(step))


def _generation_config(model_dir: str, tokenizer) -> GenerationConfig:
    """The starting model's generation config when it has one, else one that stops at the tokenizer's EOS."""
    if os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        return GenerationConfig.from_pretrained(model_dir)
    return GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)

