"""The `hf` rollout: HF `generate` on the actor's own FSDP-held weights.

No copy of the model is made: generation runs on the training module itself, inside the
FSDP↔HF sharding manager that gathers the weights once for the whole call (see
sharding_manager/fsdp_hf.py). Slow next to an inference engine, but exact, dependency-free and
identical on CPU and GPU, which makes it the reference the other engines are tested against.

Sampling comes from the config only: `temperature`, `top_p`, `top_k` (-1 = off), `do_sample`;
with meta_info["validate"] the `val_kwargs` block is used instead (greedy by default). Greedy
decoding happens when do_sample is false or the temperature is 0. The repetition penalty is pinned
to 1: a model directory's generation_config (Qwen's sets 1.05) must not bend the sampling
distribution away from the policy that the trainer scores.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel

from hybridrl.protocol import DataProto
from hybridrl.utils.fsdp_utils import hf_module
from hybridrl.utils.torch_functional import logprobs_from_logits
from hybridrl.workers.rollout.base import BaseRollout, register_rollout


@register_rollout("hf")
class HFRollout(BaseRollout):
    def __init__(self, config, model_config=None, module=None):
        super().__init__(config, model_config, module)
        if module is None:
            raise ValueError("the hf rollout generates with the actor's own weights: it needs module=<the FSDP model>")
        if config.ignore_eos:
            raise NotImplementedError("rollout.ignore_eos=true is not supported by the hf rollout "
                                      "(HF generate always stops at EOS); use rollout.name=sglang or vllm")

    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        model = hf_module(self.module)
        device = next(model.parameters()).device
        prompt_ids = prompts.batch["input_ids"]
        prompt_mask = prompts.batch["attention_mask"]
        prompt_positions = prompts.batch["position_ids"]
        eos_ids = _token_ids(prompts.meta_info, "eos_token_id", model)
        pad_id = _token_ids(prompts.meta_info, "pad_token_id", model)[0]
        sampling = self._sampling(prompts.meta_info)
        response_length = self.config.response_length

        output = model.generate(
            input_ids=prompt_ids.to(device), attention_mask=prompt_mask.to(device),
            max_new_tokens=response_length, eos_token_id=eos_ids, pad_token_id=pad_id,
            repetition_penalty=1.0, use_cache=True, synced_gpus=self._ranks_step_together(),
            return_dict_in_generate=True,
            output_logits=self.config.calculate_log_probs, **sampling)

        generated = output.sequences[:, prompt_ids.shape[1]:].cpu()
        responses = torch.full((len(prompt_ids), response_length), pad_id, dtype=prompt_ids.dtype)
        responses[:, :generated.shape[1]] = generated
        response_mask = mask_through_first_eos(responses, eos_ids)
        responses = responses.masked_fill(response_mask == 0, pad_id)
        steps = torch.arange(1, response_length + 1, dtype=prompt_positions.dtype)
        tensors = {
            "prompts": prompt_ids,
            "responses": responses,
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], dim=1),
            "position_ids": torch.cat([prompt_positions, prompt_positions[:, -1:] + steps], dim=1),
            "response_mask": response_mask,
        }
        if self.config.calculate_log_probs:
            temperature = sampling["temperature"] if sampling["do_sample"] else 1.0  # greedy: the raw logits
            tensors["rollout_log_probs"] = _sampled_log_probs(output.logits, responses, response_mask, temperature)
        return DataProto.from_dict(tensors)

    def _ranks_step_together(self) -> bool:
        """Whether every rank must run as many decoding steps as the slowest one (HF's synced_gpus).

        FSDP2 in rollout mode holds every layer gathered: a step runs no collective, each rank stops
        when its own rows are done. FSDP1 layers may gather again at every step (under mixed
        precision they gather their bf16 copy; summon_full_params holds the fp32 one), so with
        FSDP1 the ranks step together.
        """
        return isinstance(self.module, FullyShardedDataParallel) and dist.is_initialized() and dist.get_world_size() > 1

    def _sampling(self, meta_info: dict) -> dict:
        """HF generate's sampling kwargs from the config (val_kwargs when validating)."""
        source = self.config.val_kwargs if meta_info.get("validate", False) else self.config
        do_sample = meta_info.get("do_sample", source.do_sample)
        if not do_sample or source.temperature == 0:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": float(source.temperature), "top_p": float(source.top_p),
                "top_k": 0 if source.top_k == -1 else int(source.top_k)}


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


def _sampled_log_probs(step_logits: tuple[torch.Tensor, ...], responses: torch.Tensor,
                       response_mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) of each generated token under logits / temperature (the distribution the actor's
    compute_log_prob scores), 0 after the response; shaped like `responses`, float32."""
    logits = torch.stack(step_logits, dim=1).cpu() / temperature
    log_probs = torch.zeros(responses.shape, dtype=torch.float32)
    log_probs[:, :logits.shape[1]] = logprobs_from_logits(logits, responses[:, :logits.shape[1]])
    return log_probs * response_mask
