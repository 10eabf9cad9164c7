"""The `hf` rollout: HF `generate` on the actor's own FSDP-held weights.

No copy of the model is made: generation runs on the training module itself
(`shares_trainer_weights = True`, so the worker never pushes weights into it). Slow next to an
inference engine, but exact, dependency-free and identical on CPU and GPU, which makes it the
reference the other engines are tested against.

Lifecycle (rollout/base.py): `resume(("weights",))` gathers every FSDP layer once and keeps it
gathered; `release(("weights", ...))` frees the gathered copies again. Why: HF generation runs
one forward per new token, and under FSDP every forward of a sharded layer would all-gather that
layer and free it again, i.e. one all-gather per layer per token; and since each rank stops when
its own rows are finished, ranks would run different numbers of forwards and the collectives
would deadlock. FSDP2: every FSDP module is unsharded with reshard_after_forward=False until the
release, which restores each layer's setting. FSDP1: `summon_full_params(writeback=False)`
(generation does not change weights); under mixed precision (GPU) FSDP1 layers still gather their
bf16 copy at each step, so the ranks then step together (HF's synced_gpus). The module is in eval
mode (no dropout) while resumed and gets its previous mode back on release. The KV cache is HF's
own per call: the "kv_cache" tag has nothing to free.

Sampling comes from the config only: `temperature`, `top_p`, `top_k` (-1 = off), `do_sample`;
with meta_info["validate"] the `val_kwargs` block is used instead (greedy by default). Greedy
decoding happens when do_sample is false or the temperature is 0. The repetition penalty is pinned
to 1: a model directory's generation_config (Qwen's sets 1.05) must not bend the sampling
distribution away from the policy that the trainer scores. With rollout.full_determinism the call samples from a
generator seeded for the rank's rows (rollout/request_seeds.py), not from the process's.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

from hybridrl.protocol import DataProto
from hybridrl.models.fsdp_utils import hf_module
from hybridrl.algorithms.torch_functional import logprobs_from_logits
from hybridrl.workers.rollout.base import BaseRollout, register_rollout
from hybridrl.workers.rollout.request_seeds import first_row_seed, seeded_generator
from hybridrl.workers.rollout.engine_io import engine_output
from hybridrl.workers.rollout.sampling import max_new_tokens, sampling_source


@register_rollout("hf")
class HFRollout(BaseRollout):
    shares_trainer_weights = True  # generates from the FSDP actor itself: resume("weights") gathers it
    weights_survive_release = True

    def __init__(self, config, model_config=None, module=None):
        super().__init__(config, model_config, module)
        if module is None:
            raise ValueError("the hf rollout generates with the actor's own weights: it needs module=<the FSDP model>")
        if config.ignore_eos:
            raise NotImplementedError("rollout.ignore_eos=true is not supported by the hf rollout "
                                      "(HF generate always stops at EOS); use rollout.name=sglang or vllm")
        self._gathered = False
        self._was_training = False
        self._fsdp1_context = None
        self._reshard_settings: list[tuple[FSDPModule, bool]] = []

    # ------------------------------------------------------------------ lifecycle
    def resume(self, tags: tuple[str, ...]) -> None:
        """"weights": gather every FSDP layer once and keep it gathered until the release."""
        if "weights" not in tags or self._gathered:
            return
        self._was_training = self.module.training
        self.module.eval()
        if isinstance(self.module, FullyShardedDataParallel):
            self._fsdp1_context = FullyShardedDataParallel.summon_full_params(self.module, writeback=False)
            self._fsdp1_context.__enter__()
        elif isinstance(self.module, FSDPModule):
            units = [unit for unit in self.module.modules() if isinstance(unit, FSDPModule)]
            # the root keeps FSDP's root rule (no reshard after forward: backward needs it at once)
            self._reshard_settings = [(unit, _reshards_after_forward(unit) if unit is not self.module else False)
                                      for unit in units]
            self.module.set_reshard_after_forward(False, recurse=True)
            for handle in [unit.unshard(async_op=True) for unit in units]:
                handle.wait()
        self._gathered = True

    def release(self, tags: tuple[str, ...]) -> None:
        """"weights": free the gathered copies; each layer gets its reshard setting and the module its mode back."""
        if "weights" not in tags or not self._gathered:
            return
        self._gathered = False
        if self._fsdp1_context is not None:
            context, self._fsdp1_context = self._fsdp1_context, None
            context.__exit__(None, None, None)
        for unit, reshards in self._reshard_settings:
            unit.set_reshard_after_forward(reshards, recurse=False)
            unit.reshard()
        self._reshard_settings = []
        self.module.train(self._was_training)

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        model = hf_module(self.module)
        device = next(model.parameters()).device
        prompt_ids = prompts.batch["input_ids"]
        prompt_mask = prompts.batch["attention_mask"]
        eos_ids = _token_ids(prompts.meta_info, "eos_token_id", model)
        pad_id = _token_ids(prompts.meta_info, "pad_token_id", model)[0]
        sampling = self._sampling(prompts.meta_info)
        response_length = self.config.response_length

        started = time.perf_counter()
        with seeded_generator(first_row_seed(self.config, prompts.meta_info), device):  # full_determinism only
            output = model.generate(
                input_ids=prompt_ids.to(device), attention_mask=prompt_mask.to(device),
                max_new_tokens=max_new_tokens(self.config, prompts.meta_info), eos_token_id=eos_ids,
                pad_token_id=pad_id, repetition_penalty=1.0, use_cache=True, synced_gpus=self._ranks_step_together(),
                return_dict_in_generate=True, output_logits=self.config.calculate_log_probs, **sampling)
        engine_seconds = time.perf_counter() - started

        generated = output.sequences[:, prompt_ids.shape[1]:].cpu()
        response_mask = mask_through_first_eos(generated, eos_ids)  # HF pads finished rows: cut at the EOS
        lengths = response_mask.sum(dim=1).tolist()
        log_probs = None
        if self.config.calculate_log_probs:
            temperature = sampling["temperature"] if sampling["do_sample"] else 1.0  # greedy: the raw logits
            step_log_probs = _sampled_log_probs(output.logits, generated, temperature)
            log_probs = [row[:length].tolist() for row, length in zip(step_log_probs, lengths)]
        return engine_output(prompts, [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask)],
                             [row[:length].tolist() for row, length in zip(generated, lengths)], log_probs,
                             response_length=response_length, pad_token_id=pad_id, engine_seconds=engine_seconds)

    def _ranks_step_together(self) -> bool:
        """Whether every rank must run as many decoding steps as the slowest one (HF's synced_gpus).

        FSDP2 in rollout mode holds every layer gathered: a step runs no collective, each rank stops
        when its own rows are done. FSDP1 layers may gather again at every step (under mixed
        precision they gather their bf16 copy; summon_full_params holds the fp32 one), so with
        FSDP1 the ranks step together.
        """
        return isinstance(self.module, FullyShardedDataParallel) and dist.is_initialized() and dist.get_world_size() > 1

    def _sampling(self, meta_info: dict) -> dict:
        """HF generate's sampling kwargs from the config (val_kwargs when validating; an eval set's overrides)."""
        source = sampling_source(self.config, meta_info)
        do_sample = meta_info.get("do_sample", source.do_sample)
        if not do_sample or source.temperature == 0:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": float(source.temperature), "top_p": float(source.top_p),
                "top_k": 0 if source.top_k == -1 else int(source.top_k)}


def _reshards_after_forward(unit: FSDPModule) -> bool:
    """The unit's current reshard_after_forward (FSDP2 has a setter only; its param groups hold the value).
    torch <= 2.11 keeps one optional `_fsdp_param_group` per state, later releases a list `_fsdp_param_groups`."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return any(group.post_forward_mesh_info is not None for group in groups)


def mask_through_first_eos(responses: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """1 on every token up to and including the first EOS of each row (all ones when a row has none), as int64."""
    is_eos = torch.isin(responses, torch.tensor(eos_ids, dtype=responses.dtype))
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # EOS tokens strictly before each position
    return (eos_before == 0).long()


def _token_ids(meta_info: dict, key: str, model) -> list[int]:
    """meta_info[key] (the trainer sends the tokenizer's ids), else the model's generation_config; as a list."""
    value = meta_info.get(key, getattr(model.generation_config, key, None))
    if value is None:
        raise ValueError(f"generate_sequences needs meta_info[{key!r}] (the model's generation_config has none)")
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _sampled_log_probs(step_logits: tuple[torch.Tensor, ...], generated: torch.Tensor,
                       temperature: float) -> torch.Tensor:
    """log p(token) of each generated token under logits / temperature (the distribution the actor's
    compute_log_prob scores); shaped like `generated`, float32."""
    logits = torch.stack(step_logits, dim=1).cpu().float() / temperature
    return logprobs_from_logits(logits, generated).float()
