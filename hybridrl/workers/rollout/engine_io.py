"""What every GPU engine behind the lifecycle contract (sglang_rollout.py, vllm_rollout.py) shares: the trainer's
padded prompts in as token lists, the engine's answers out in the batch layout with the engine's own timing (hf's
too), the eos/pad ids, and the two failures the switch turns into clear errors (a dead engine, a resume that cannot
fit).
The engine servers of rollout.mode=async (hf's too) check each request's length budget here."""
from __future__ import annotations

from hybridrl.data.batch_layout import to_batch_layout
from hybridrl.protocol import DataProto

GiB = 1 << 30
RESUME_HEADROOM = 256 << 20  # CUDA contexts and allocation granularity: never resume into the last bytes


class EngineDiedError(RuntimeError):
    """An engine process died (or failed for good); the message names it and its cause."""


class EngineMemoryError(RuntimeError):
    """The engine cannot resume: the device has less free memory than the resume takes. Raised before trying,
    since a resume that runs out of memory kills the engine (SGLang's scheduler: cudaError 2; vLLM: a bare CUDA
    error inside its allocator)."""


def prompt_token_lists(prompts: DataProto) -> list[list[int]]:
    """Each row's real prompt tokens: left padding is the trainer's layout, not the model's input."""
    return [row[mask.bool()].tolist() for row, mask in zip(prompts.batch["input_ids"], prompts.batch["attention_mask"])]


def token_ids(meta_info: dict, key: str, generation_config: dict) -> list[int]:
    """meta_info[key] (the trainer sends the tokenizer's ids), else the model directory's generation_config."""
    value = meta_info.get(key, generation_config.get(key))
    if value is None:
        raise ValueError(f"generate_sequences needs meta_info[{key!r}] (the model's generation_config has none)")
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def requested_max_tokens(params: dict, response_length: int, engine: str) -> int:
    """An engine server request's length budget (max_tokens, or max_new_tokens, default rollout.response_length),
    checked; a repetition_penalty other than 1 is refused (the policy the trainer scores has none)."""
    max_tokens = int(params.get("max_tokens", params.get("max_new_tokens", response_length)))
    if not 0 < max_tokens <= response_length:
        raise ValueError(f"generate: max_tokens={max_tokens}, expected 1..rollout.response_length={response_length}")
    if float(params.get("repetition_penalty", 1.0)) != 1.0:
        raise ValueError(f"the {engine} engine server pins repetition_penalty to 1 (the policy the trainer scores)")
    return max_tokens


def aborted_answer(logprobs: bool) -> dict:
    """An engine server's answer to a request aborted before it generated anything (partial rollout)."""
    return {"token_ids": [], "stop_reason": "aborted", "log_probs": [] if logprobs else None}


def generation_config_ids(model_path: str) -> dict:
    """eos/pad ids of the model directory's generation_config (empty when it has none)."""
    from transformers import GenerationConfig

    try:
        generation_config = GenerationConfig.from_pretrained(model_path)
    except OSError:
        return {}
    return {"eos_token_id": generation_config.eos_token_id, "pad_token_id": generation_config.pad_token_id}


def engine_output(prompts: DataProto, token_lists: list[list[int]], generated: list[list[int]],
                  log_probs: list[list[float]] | None, *, response_length: int, pad_token_id: int,
                  engine_seconds: float) -> DataProto:
    """The batch layout of one generate call, with the engine's own share of timing_s/gen (the rest is dispatch
    and packing) and its decode rate as metrics."""
    output = to_batch_layout(token_lists, generated, prompt_length=prompts.batch["input_ids"].shape[1],
                             response_length=response_length, pad_token_id=pad_token_id, response_logprobs=log_probs)
    tokens = sum(len(ids) for ids in generated)
    output.meta_info["metrics"] = {"timing_s/engine_generate": engine_seconds,
                                   "rollout/engine_tokens_per_s": tokens / max(engine_seconds, 1e-9)}
    return output


def resume_memory_error(engine: str, tags, need: int, free: int, total: int, allocated: int,
                        config, on: str | None = None) -> EngineMemoryError:
    """The error for a resume of `engine`'s `tags` that needs `need` bytes with only `free` of `total` free (the
    trainer holding `allocated`) on this process's GPU, or the one `on` names: the numbers and the keys that make
    room."""
    return EngineMemoryError(
        f"rollout mode: resuming the {engine} engine's {list(tags)} needs {need / GiB:.2f} GiB"
        f"{f' on {on}' if on else ''}, but only "
        f"{free / GiB:.2f} GiB of {total / GiB:.2f} GiB are free after the trainer returned its cached memory (the "
        f"trainer holds {allocated / GiB:.2f} GiB allocated). Make room: lower "
        f"actor_rollout_ref.rollout.gpu_memory_utilization (now {config.gpu_memory_utilization}), lower "
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu / ppo_micro_batch_size_per_gpu (activation peaks the "
        f"allocator keeps), or set actor_rollout_ref.actor.fsdp_config.param_offload=true and optimizer_offload=true "
        f"(the trainer's state waits in CPU memory during the rollout)")
