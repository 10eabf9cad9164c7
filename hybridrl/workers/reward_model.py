"""RewardModelWorker: a learned reward model on one rank — an HF sequence-classification model
with one output (`AutoModelForSequenceClassification`, num_labels=1), sharded with FSDP.

`compute_rm_score(data)` adds `rm_scores` (batch, response_length), float32: the model's score of
prompt + response, on the last valid response token and 0 elsewhere. That is where the reward
managers put rule scores, and they add `rm_scores` to theirs when the batch has it (see
reward/managers/base.py), so rule and model rewards combine by a plain sum.

The score is the head's output at the last valid token of the reward model's input, read from
the `score` head's per-token output (HF's own pooling picks the last non-pad token, which is wrong
when EOS and pad are the same token).

Which tokens the reward model reads:
- `reward_model.model.input_tokenizer` is null, or the policy's tokenizer (the one the controller
  resolved and hands to this worker, utils/tokenizer.py) has the same vocabulary and chat template as
  the reward model's tokenizer: the policy's input_ids (prompt + response) as they are;
- they differ: each row is re-tokenised. The prompt's chat messages (`raw_prompt`, which
  `data.return_raw_chat=true` keeps) plus the response decoded with the policy tokenizer as the
  assistant turn go through the reward model's chat template and tokenizer.
`reward_model.max_length` (when set) bounds the reward model's input; a longer row is an error
naming the row, never a silent truncation.

Micro-batches, as verl's: `reward_model.micro_batch_size_per_gpu` rows each, or with
`reward_model.use_dynamic_bsz` groups of at most `reward_model.forward_max_token_len_per_gpu` attended tokens of
the reward model's input, balanced by length (data/seqlen_balancing.py, as the actor's and critic's forwards), the
scores then put back in row order. `reward_model.model.external_lib` is imported before the model loads (a module
that registers a custom architecture with transformers' Auto classes), as the actor's and critic's are.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification

from hybridrl.data.batch_layout import last_one
from hybridrl.protocol import DataProto
from hybridrl.single_controller import Dispatch, Worker, register
from hybridrl.utils.distributed import device_name, init_process_group_once
from hybridrl.models.fsdp_utils import hf_module, shard_model
from hybridrl.models.spec import ModelSpec
from hybridrl.utils.import_utils import load_extensions
from hybridrl.utils.tokenizer import load_tokenizer
from hybridrl.workers.ppo_update_loop import in_row_order, micro_batches_of


def load_reward_model(spec: ModelSpec, dtype: torch.dtype):
    """The sequence-classification model of `spec` with one label (after its external_lib); its score head must be
    in the checkpoint (a freshly initialised head would hand out random rewards)."""
    spec.import_external_lib()
    model, loading_info = AutoModelForSequenceClassification.from_pretrained(
        spec.path, num_labels=1, dtype=dtype, trust_remote_code=spec.trust_remote_code, output_loading_info=True)
    if loading_info["missing_keys"]:
        raise ValueError(f"{spec.key}.path={spec.path} is not a trained reward model: the checkpoint lacks "
                         f"{sorted(loading_info['missing_keys'])} (a {type(model).__name__} needs its score head)")
    if not isinstance(getattr(model, "score", None), torch.nn.Module):
        raise TypeError(f"{type(model).__name__} has no `score` head module; RewardModelWorker reads the per-token "
                        f"scores from it")
    return model


def same_tokenization(policy_tokenizer, rm_tokenizer) -> bool:
    """True when the reward model can read the policy's token ids as they are."""
    return (policy_tokenizer.get_vocab() == rm_tokenizer.get_vocab()
            and policy_tokenizer.chat_template == rm_tokenizer.chat_template)


class RewardModelWorker(Worker):
    def __init__(self, config, model_spec: ModelSpec, seed: int = 0, device: str | None = None,
                 extensions: list[str] = (), policy_tokenizer=None):
        """config: the `reward_model` section (which tokens to read, how to shard). model_spec: the reward model,
        resolved by the controller (models/spec.reward_model_spec). seed/device/extensions as for ActorRolloutRefWorker.
        policy_tokenizer: the run's policy tokenizer, resolved by the controller (utils/tokenizer.py): the one the
        policy's prompts were rendered with; needed unless reward_model.model.input_tokenizer is null."""
        super().__init__()
        self.config = config
        self.model_spec = model_spec
        self.policy_tokenizer = policy_tokenizer
        self.device = device or device_name()
        load_extensions(list(extensions))
        init_process_group_once("nccl" if self.device == "cuda" else "gloo")
        torch.manual_seed(seed + self.rank)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the reward model and its tokenizer (compared with the policy's), shard the model."""
        config, model, spec = self.config, self.config.model, self.model_spec
        spec.import_external_lib()
        self.rm_tokenizer = load_tokenizer(spec.path, trust_remote_code=spec.trust_remote_code)
        if model.input_tokenizer is not None and self.policy_tokenizer is None:
            raise ValueError("reward_model.model.input_tokenizer is set, so the reward model compares the policy's "
                             "tokenizer with its own: build RewardModelWorker with policy_tokenizer=the controller's "
                             "(or set reward_model.model.input_tokenizer=null)")
        # Whether rows are re-tokenised with the reward model's tokenizer and chat template.
        self.retokenizes = (model.input_tokenizer is not None
                            and not same_tokenization(self.policy_tokenizer, self.rm_tokenizer))
        if self.retokenizes and self.rm_tokenizer.chat_template is None:
            raise ValueError(f"the reward model's tokenizer ({spec.path}) differs from the policy's "
                             f"({model.input_tokenizer}) and has no chat template to re-tokenise the rows with")
        # Frozen: on a GPU it only ever computes in bf16, so it is kept in bf16; on the CPU in fp32.
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        module = load_reward_model(spec, dtype)
        module.requires_grad_(False)
        self.reward_module = shard_model(module, strategy=config.strategy, device=self.device,
                                         mixed_precision=self.device == "cuda",
                                         reshard_after_forward=model.fsdp_config.reshard_after_forward,
                                         cpu_offload=model.fsdp_config.param_offload,
                                         forward_prefetch=model.fsdp_config.forward_prefetch)
        self.reward_module.eval()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """Adds rm_scores: the reward model's score on each row's last valid response token."""
        response_length = data.batch["responses"].shape[-1]
        response_lengths = data.batch["attention_mask"][:, -response_length:].sum(-1)
        if bool((response_lengths == 0).any()):
            row = int((response_lengths == 0).nonzero()[0])
            raise ValueError(f"compute_rm_score: row {row} has an empty response (no token to put its score on)")
        input_ids, attention_mask, position_ids = (self._retokenized_inputs(data) if self.retokenizes
                                                   else self._policy_inputs(data))
        self._check_max_length(attention_mask)
        rows = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        config = self.config
        token_budget = config.forward_max_token_len_per_gpu if config.use_dynamic_bsz else None
        micro_batches, order = micro_batches_of(rows, config.micro_batch_size_per_gpu, token_budget)
        with torch.no_grad():
            scores = in_row_order(torch.cat([self._scores(**micro_batch) for micro_batch in micro_batches]), order)
        rm_scores = torch.zeros(len(scores), response_length, dtype=torch.float32)
        rm_scores[torch.arange(len(scores)), response_lengths - 1] = scores
        return DataProto.from_dict({"rm_scores": rm_scores})

    def _policy_inputs(self, data: DataProto) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return data.batch["input_ids"], data.batch["attention_mask"], data.batch["position_ids"]

    def _retokenized_inputs(self, data: DataProto) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Chat (raw_prompt + the decoded response) -> the reward model's template and ids, right-padded."""
        if "raw_prompt" not in data.non_tensor_batch:
            raise ValueError("the reward model's tokenizer or chat template differs from the policy's "
                             "(reward_model.model.input_tokenizer), so rows are re-tokenised from their chat "
                             "messages: set data.return_raw_chat=true to keep them in the batch as raw_prompt")
        responses = data.batch["responses"]
        response_mask = data.batch["attention_mask"][:, -responses.shape[-1]:].bool()
        rows = []
        for i, messages in enumerate(data.non_tensor_batch["raw_prompt"]):
            response = self.policy_tokenizer.decode(responses[i][response_mask[i]], skip_special_tokens=True)
            chat = list(messages) + [{"role": "assistant", "content": response}]
            text = self.rm_tokenizer.apply_chat_template(chat, tokenize=False)
            rows.append(self.rm_tokenizer(text, add_special_tokens=False)["input_ids"])
        width = max(len(ids) for ids in rows)
        pad = self.rm_tokenizer.pad_token_id if self.rm_tokenizer.pad_token_id is not None else 0
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in rows])
        attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in rows])
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return input_ids, attention_mask, position_ids

    def _check_max_length(self, attention_mask: torch.Tensor) -> None:
        max_length = self.config.max_length
        lengths = attention_mask.sum(-1)
        if max_length is not None and bool((lengths > max_length).any()):
            row = int((lengths > max_length).nonzero()[0])
            raise ValueError(f"compute_rm_score: row {row} is {int(lengths[row])} tokens for the reward model, longer "
                             f"than reward_model.max_length={max_length}")

    def _scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        """One forward; the score head's output at each row's last attended token, as float32 on the CPU."""
        per_token = []
        hook = hf_module(self.reward_module).score.register_forward_hook(
            lambda module, inputs, output: per_token.append(output))
        try:
            self.reward_module(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                               position_ids=position_ids.to(self.device), use_cache=False)
        finally:
            hook.remove()
        last = last_one(attention_mask)
        return per_token[0].squeeze(-1).float().cpu()[torch.arange(len(last)), last]
