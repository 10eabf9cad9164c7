"""The `vllm` rollout: a vLLM engine inside the worker process that takes token ids and returns token ids.

Hybrid engine, like the sglang rollout: the engine shares the GPU (and the process) with the FSDP
actor, and the two take turns through the lifecycle contract of rollout/base.py:

- release(tags): `llm.sleep(level=2)` when "weights" is among the tags (weights and KV cache are
  discarded; the worker pushes the trainer's weights after every resume), `level=1` when only the
  KV cache goes (the weights wait in CPU memory and come back unchanged).
- resume(("weights",)): `llm.wake_up(tags=["weights"])`, and the KV cache with it unless
  `rollout.multi_stage_wake_up`. Before waking, the device must have room, else EngineMemoryError
  names the numbers and the keys to change (the same check as SGLang's).
- update_weights(named_tensors): the full parameters, `rollout.update_weights_bucket_megabytes` at a
  time, cast to `rollout.dtype` and loaded in place with the model's own `load_weights` (vLLM's
  `apply_model`: it maps HF names onto vLLM's fused parameters, e.g. q/k/v -> qkv_proj).
- resume(("kv_cache",)): `llm.wake_up(tags=["kv_cache"])`, then `flush_cache()` resets the prefix
  cache (its entries were computed with the previous weights; SGLang's rollout has the same method).
After a level-2 sleep the weights' memory holds garbage until the next push: generating before it is
refused. With `rollout.free_cache_engine=false` the engine never sleeps and its weights survive.

Tensor parallelism (rollout.tensor_model_parallel_size k > 1, the synchronous colocated trainer): every rank holds
its own TP shard in its own process, verl's design, through vLLM's external launcher. vLLM then builds its TP groups
on the trainer's torch.distributed world, k consecutive ranks each (the outer data-parallel dimension is the rest of
the world), which is the group rollout/tensor_parallel.py gives SGLang. A TP group's engines must see the same
requests in the same order: each rank's prompts are gathered within the group (gloo), every rank generates all of
them with the same seed, and keeps its own rows. Each rank takes the full weights and its model's load_weights keeps
its shard, so a push moves no tensor between GPUs. Each rank sleeps and wakes its own memory.

The engine core runs in THIS process (VLLM_ENABLE_V1_MULTIPROCESSING=0): `apply_model` then calls
`load_weights` on the very model the engine runs, with the trainer's CUDA tensors, no IPC. For the
same reason a failing engine raises in the caller at once; `EngineDiedError` wraps it (and every
later call) with the engine's error, so the step fails with it.

Sampling comes from the config like sglang_rollout.sampling_params (every parameter explicit, greedy
at temperature 0, stop at the trainer's EOS ids). Log-probs of the sampled tokens come from
`SamplingParams(logprobs=0)` with `logprobs_mode="processed_logprobs"` (log-softmax of logits /
temperature, what the actor scores; vLLM's default would ignore the temperature).

Everything vLLM-specific goes through `load_vllm()` (the `LLM` and `SamplingParams` classes) and
`DeviceMemory` (torch.cuda), so the bookkeeping here runs on CPU against a fake at that boundary.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from hybridrl.protocol import DataProto
from hybridrl.utils.distributed import environment_variable
from hybridrl.workers.rollout.base import BaseRollout, register_rollout
from hybridrl.workers.rollout.request_seeds import batch_row_seeds
from hybridrl.workers.rollout.sampling import max_new_tokens, sampling_source
from hybridrl.workers.rollout.engine_load import EngineLoad, cuda_graph_size
from hybridrl.workers.rollout.tensor_parallel import TensorParallelGroup
from hybridrl.workers.rollout.engine_io import (RESUME_HEADROOM, EngineDiedError, GiB,
                                                engine_output, generation_config_ids, prompt_token_lists,
                                                resume_memory_error, token_ids)

logger = logging.getLogger(__name__)

ALL_MEMORY_TAGS = ("weights", "kv_cache")  # vLLM's CuMemAllocator tags (wake_up also knows "scheduling": level 0)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Engine arguments that come from rollout config keys; engine_kwargs.vllm may not set them.
CONFIG_OWNED_ENGINE_KWARGS = {
    "model": "actor_rollout_ref.model.path",
    "dtype": "rollout.dtype",
    "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "load_format": "rollout.load_format",
    "tensor_parallel_size": "rollout.tensor_model_parallel_size",
    "max_model_len": "rollout.max_model_len (default prompt_length + response_length)",
    "max_num_seqs": "rollout.max_num_seqs",
    "max_num_batched_tokens": "rollout.max_num_batched_tokens",
    "enforce_eager": "rollout.enforce_eager",
    "distributed_executor_backend": "(external_launcher with tensor_model_parallel_size > 1: each rank holds its "
                                    "shard in process; vLLM's default with one GPU)",
    "enable_sleep_mode": "(always on: the hybrid engine releases memory)",
    "skip_tokenizer_init": "(always on: token ids in and out)",
    "logprobs_mode": "(always processed_logprobs: log-probs under logits / temperature, as the actor scores)",
    "seed": "(this process's torch seed; rollout.seed with rollout.full_determinism)",
    "disable_log_stats": "rollout.disable_log_stats",
}
# compilation_config's largest CUDA-graph batch (vLLM's CompilationConfig), and every key of it that sizes the
# graphs: one of them in engine_kwargs.vllm.compilation_config is the user's choice, which wins.
GRAPH_SIZE_KEY = "max_cudagraph_capture_size"
GRAPH_SIZE_KEYS = ("max_cudagraph_capture_size", "cudagraph_capture_sizes")


# With tensor_model_parallel_size > 1: every rank's own shard, in process (the external launcher), and NCCL's
# all-reduce: vLLM's custom all-reduce maps its peers' buffers by device id, and a Ray worker sees only its own GPU
# (whether it works that way is for the first 2-GPU run to show). engine_kwargs.vllm may turn it back on; the
# launcher is the design.
TENSOR_PARALLEL_KWARGS = {"distributed_executor_backend": "external_launcher", "disable_custom_all_reduce": True}


def load_vllm():
    """The vllm module (imported on first use: selecting another engine never imports vllm)."""
    import vllm

    return vllm


class DeviceMemory:
    """torch.cuda's view of this process's GPU, the only device calls the bookkeeping makes."""

    def __init__(self):
        self.device = torch.device("cuda", torch.cuda.current_device())

    def free_and_total(self) -> tuple[int, int]:
        torch.cuda.synchronize(self.device)
        return torch.cuda.mem_get_info(self.device)

    def allocated(self) -> int:
        """torch's allocated bytes on this device: the engine's own tensors too (CuMem pool), asleep or awake."""
        return torch.cuda.memory_allocated(self.device)

    def return_cached(self) -> None:
        """Give the trainer's cached blocks back to the device (the engine allocates outside torch's cache)."""
        torch.cuda.empty_cache()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def used(self) -> int:
        """Bytes in use on the whole device (the engine's allocations are outside torch's allocator statistics)."""
        free, total = self.free_and_total()
        return total - free


def sleep_level(tags: tuple[str, ...]) -> int:
    """vLLM's sleep level for releasing `tags`: 2 (discard weights and KV cache) when the weights go, else 1
    (discard the KV cache; the weights wait in CPU memory)."""
    unknown = set(tags) - set(ALL_MEMORY_TAGS)
    if unknown:
        raise ValueError(f"release: unknown memory tags {sorted(unknown)}; expected some of {list(ALL_MEMORY_TAGS)}")
    return 2 if "weights" in tags else 1


@register_rollout("vllm")
class VLLMRollout(BaseRollout):
    shares_trainer_weights = False  # the engine holds its own copy: the worker pushes the trainer's weights
    sized_for_load = True  # build_rollout gives it the schedule's engine_load: CUDA graphs up to that batch

    def __init__(self, config, model_config=None, module=None, device_memory: DeviceMemory | None = None,
                 engine_load: EngineLoad | None = None):
        """Start the engine on this process's GPU, measure what waking each tag takes, and fall asleep: the worker
        rests in trainer mode. engine_load: the sequences the schedule decodes on this engine at once
        (rollout/engine_load.py; None: the engine's default graph sizes)."""
        super().__init__(config, model_config, module)
        if model_config is None:
            raise ValueError("the vllm rollout needs model_config=the policy's ModelSpec (models/spec.py) for the "
                             "model path")
        self.memory = device_memory or DeviceMemory()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process (see the module docstring)
        if config.full_determinism:  # vLLM's batch-invariant kernels, read when the engine builds its model
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        self.vllm = load_vllm()
        self.tp = TensorParallelGroup(config.tensor_model_parallel_size) if config.tensor_model_parallel_size > 1 \
            else None
        seed = torch.initial_seed() % (2**31)
        if self.tp is not None:  # the group's engines sample alike: the leader's seed on every rank
            seed = self.tp.broadcast(seed)
        self.engine_kwargs = engine_kwargs(config, model_config.path, seed=seed, load=engine_load)
        allocated_before = self.memory.allocated()
        started = time.perf_counter()
        with local_rank_of(self.memory.device):
            self.llm = self.vllm.LLM(**self.engine_kwargs)
        self.engine_start_s = time.perf_counter() - started
        self.allocator_bytes = self.memory.allocated() - allocated_before  # kept allocated while it sleeps
        self.dead_cause: str | None = None
        self.awake_tags = set(ALL_MEMORY_TAGS)
        self.weights_stale = False  # True from a level-2 sleep until the next push: the weights' memory is garbage
        self.last_switch: dict[str, float] = {}  # timings and sync size of the last switch
        self._metrics: dict[str, float] = {}
        self.generation_config = generation_config_ids(model_config.path)
        logger.info("vllm engine started in %.1f s with %s", self.engine_start_s, self.engine_kwargs)
        self.resume_bytes: dict[str, int] = {}  # what waking each tag takes from the device (measured below)
        if config.free_cache_engine:
            self.resume_bytes = self._measure_resume_bytes()

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        if self.awake_tags != set(ALL_MEMORY_TAGS):
            raise RuntimeError(f"generate_sequences: the vllm engine is asleep (awake: {sorted(self.awake_tags)}); "
                               f"generate in rollout mode (resume(('weights',)), update_weights, "
                               f"resume(('kv_cache',)))")
        if self.weights_stale:
            raise RuntimeError("generate_sequences: the vllm engine's weights were discarded (sleep level 2) and not "
                               "pushed since; call update_weights after resume(('weights',))")
        eos_ids = token_ids(prompts.meta_info, "eos_token_id", self.generation_config)
        pad_id = token_ids(prompts.meta_info, "pad_token_id", self.generation_config)[0]
        kwargs = sampling_params(self.config, prompts.meta_info, eos_ids)
        params = self.vllm.SamplingParams(**kwargs)
        if self.config.full_determinism:  # each row with its own seed (rollout/request_seeds.py); no TP (config_checks)
            params = [self.vllm.SamplingParams(**kwargs, seed=seed)
                      for seed in batch_row_seeds(self.config, prompts.meta_info, len(prompts))]
        if self.tp is not None:
            return self._generate_in_group(prompts, params, pad_id)
        return self._generate(prompts, params, pad_id)

    def _generate_in_group(self, prompts: DataProto, params, pad_id: int) -> DataProto:
        """Every rank of the TP group generates the group's prompts (its engines run one model between them and
        must see the same requests); each keeps its own rows."""
        parts = self.tp.all_gather(prompts)
        output = self._generate(DataProto.concat(parts), params, pad_id)
        start = sum(len(part) for part in parts[:self.tp.rank])
        return output[start:start + len(prompts)]

    def _generate(self, prompts: DataProto, params, pad_id: int) -> DataProto:
        token_lists = prompt_token_lists(prompts)
        started = time.perf_counter()
        outputs = self._call("generate", self.llm.generate, [{"prompt_token_ids": ids} for ids in token_lists],
                             params, use_tqdm=False)
        engine_seconds = time.perf_counter() - started
        completions = [_completion(output, row, self.config.response_length) for row, output in enumerate(outputs)]
        generated = [list(completion.token_ids) for completion in completions]
        log_probs = None
        if self.config.calculate_log_probs:
            log_probs = [sampled_log_probs(completion, row) for row, completion in enumerate(completions)]
        return engine_output(prompts, token_lists, generated, log_probs, response_length=self.config.response_length,
                             pad_token_id=pad_id, engine_seconds=engine_seconds)

    # ------------------------------------------------------------------ lifecycle (rollout/base.py)
    @property
    def weights_survive_release(self) -> bool:
        return not self.config.free_cache_engine

    def resume(self, tags: tuple[str, ...]) -> None:
        """"weights": wake the weights' memory (with the KV cache, without multi_stage_wake_up). "kv_cache": wake the
        KV cache, then reset the prefix cache. Nothing wakes with free_cache_engine=false (the engine never slept)."""
        if "weights" in tags:
            self.last_switch = {}
            self._gauge("trainer mode")
        engine_tags: tuple[str, ...] = ()
        if "weights" in tags:
            engine_tags = ALL_MEMORY_TAGS if not self.config.multi_stage_wake_up else ("weights",)
        if "kv_cache" in tags:
            engine_tags += ("kv_cache",)
        engine_tags = tuple(tag for tag in ALL_MEMORY_TAGS if tag in engine_tags and tag not in self.awake_tags)
        if engine_tags:
            self._resume_if_room("resume_weights" if "weights" in tags else "resume_kv_cache", engine_tags)
        if "kv_cache" in tags:
            self._timed("reset_prefix_cache", self.flush_cache)
            self._metrics["timing_s/reset_prefix_cache"] = self.last_switch["reset_prefix_cache_s"]
            self._gauge("rollout mode")

    def _resume_if_room(self, stage: str, tags: tuple[str, ...]) -> None:
        """Wake the engine's `tags` once the device has room for them, else fail now with the numbers and the keys
        to change (a wake-up that runs out of memory would fail inside vLLM's allocator with a bare CUDA error)."""
        self.memory.return_cached()
        need = self.bytes_to_resume(tags)
        free, total = self.memory.free_and_total()
        if free < need + RESUME_HEADROOM:
            raise resume_memory_error("vllm", tags, need, free, total, self.memory.allocated() - self.allocator_bytes,
                                      self.config)
        self._timed(stage, self.wake_up, tags)

    def update_weights(self, named_tensors) -> None:
        """Load every (HF name, full tensor) into the engine's model, one bucket at a time.

        Each tensor is copied at once (it is valid only until the iterator advances), cast to `rollout.dtype`,
        into a list of at most `rollout.update_weights_bucket_megabytes`; a full list goes to the model's
        `load_weights` in one call, which splits fused parameters itself. The prefix cache is reset by the
        following resume(("kv_cache",)).
        """
        started = time.perf_counter()
        capacity = self.config.update_weights_bucket_megabytes << 20
        dtype = DTYPES[self.config.dtype]
        bucket: list[tuple[str, torch.Tensor]] = []
        bucket_bytes = pushed = 0
        for name, tensor in named_tensors:
            copy = tensor.detach().to(device=self.memory.device, dtype=dtype, copy=True)
            if bucket and bucket_bytes + copy.nbytes > capacity:
                self._load(bucket)
                bucket, bucket_bytes = [], 0
            bucket.append((name, copy))
            bucket_bytes += copy.nbytes
            pushed += copy.nbytes
        if bucket:
            self._load(bucket)
        self.memory.synchronize()
        self.weights_stale = False
        seconds = time.perf_counter() - started
        self.last_switch.update(update_weights_s=seconds, sync_gib=pushed / GiB,
                                sync_gbps=pushed / max(seconds, 1e-9) / 1e9)

    def _load(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self._call("load_weights", self.llm.apply_model, partial(_load_weights, bucket))

    def release(self, tags: tuple[str, ...]) -> None:
        """Put the engine to sleep: level 2 when the weights go (they are pushed again after the wake-up), level 1
        when only the KV cache does; nothing with free_cache_engine=false.

        A partly awake engine (a multi-stage wake-up stopped after the weights, e.g. on EngineMemoryError) cannot
        sleep: vLLM ignores the call while any of its memory is asleep. Its woken part then stays resident and
        counted as awake, so the next resume wakes only the rest (vLLM's wake_up would ignore a tag that is awake)."""
        sleep_level(tags)  # unknown tags fail here, whatever the state
        if self.config.free_cache_engine and self.awake_tags == set(ALL_MEMORY_TAGS):
            self._timed("release_engine", self.sleep, sleep_level(tags))
        elif self.config.free_cache_engine and self.awake_tags:
            logger.warning("vllm engine partly awake (%s): it cannot sleep until fully awake; that memory stays in use",
                           sorted(self.awake_tags))
        self.memory.return_cached()
        self._gauge("trainer mode restored")

    def _gauge(self, stage: str) -> None:
        """The device's used memory at a transition, in `last_switch` (GiB) and the log."""
        used = self.memory.used() / GiB
        self.last_switch[f"{stage}/device_used"] = used
        logger.debug("GPU memory, %s: device_used %.2f GiB", stage, used)

    def take_metrics(self) -> dict[str, float]:
        metrics, self._metrics = self._metrics, {}
        return metrics

    # ------------------------------------------------------------------ engine calls
    def sleep(self, level: int) -> None:
        self._call(f"sleep(level={level})", self.llm.sleep, level=level)
        self.awake_tags = set()
        self.weights_stale = self.weights_stale or level == 2

    def wake_up(self, tags: tuple[str, ...]) -> None:
        self._call(f"wake_up({list(tags)})", self.llm.wake_up, tags=list(tags))
        self.awake_tags |= set(tags)

    def flush_cache(self) -> None:
        """Drop the prefix cache (SGLang's rollout: its radix cache): after a push its KV blocks hold the previous
        weights' keys and values. vLLM's reset returns False, and resets nothing, while a request still holds
        blocks; none does between generate calls, so a refusal is an error here, not a stale cache."""
        if not self._call("reset_prefix_cache", self.llm.reset_prefix_cache):
            raise RuntimeError("vllm reset_prefix_cache refused: some KV blocks are still in use by a request, so the "
                               "prefix cache keeps entries computed before")

    def bytes_to_resume(self, tags: tuple[str, ...]) -> int:
        """Device bytes that waking `tags` takes (0 when the engine never sleeps)."""
        return sum(self.resume_bytes.get(tag, 0) for tag in tags)

    def _measure_resume_bytes(self) -> dict[str, int]:
        """Sleep (level 2), then wake the weights and the KV cache once each, reading the device's free memory around
        each step: the bytes a later wake-up of each tag needs. Ends asleep, the state the worker rests in."""
        self.sleep(2)
        asleep = self.memory.free_and_total()[0]
        self.wake_up(("weights",))
        with_weights = self.memory.free_and_total()[0]
        self.wake_up(("kv_cache",))
        awake = self.memory.free_and_total()[0]
        self.sleep(2)
        return {"weights": max(asleep - with_weights, 0), "kv_cache": max(with_weights - awake, 0)}

    def _call(self, what: str, fn, *args, **kwargs):
        """fn(*args, **kwargs); an engine failure (anything but a bad argument) becomes EngineDiedError, and so does
        every later call: an in-process engine that failed mid-step is not reused."""
        if self.dead_cause is not None:
            raise EngineDiedError(f"vllm engine call {what}: the engine failed earlier: {self.dead_cause}")
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError):
            raise
        except Exception as error:
            self.dead_cause = f"{type(error).__name__}: {error}"
            raise EngineDiedError(f"vllm engine call {what} failed: {self.dead_cause}") from error

    def _timed(self, stage: str, fn, *args):
        self.memory.synchronize()
        started = time.perf_counter()
        result = fn(*args)
        self.memory.synchronize()
        self.last_switch[f"{stage}_s"] = time.perf_counter() - started
        return result

    def shutdown(self) -> None:
        """Drop the engine (its memory goes with it: the engine core lives in this process)."""
        self.llm = None
        self.memory.return_cached()


def _load_weights(bucket: list[tuple[str, torch.Tensor]], model) -> None:
    """Runs on vLLM's worker (apply_model, in this process): the model's own loader, which takes HF names."""
    model.load_weights(weights=bucket)


def local_rank_of(device: torch.device):
    """LOCAL_RANK = this process's device index while the engine starts. vLLM's external launcher picks its GPU as
    cuda:LOCAL_RANK, but a Ray worker sees only its own GPU (cuda:0) while LOCAL_RANK counts the node's ranks."""
    return environment_variable("LOCAL_RANK", str(device.index or 0))


# ---------------------------------------------------------------------- configuration mapping

def engine_kwargs(config, model_path: str, seed: int, load: EngineLoad | None = None) -> dict[str, Any]:
    """vllm.LLM keyword arguments from the rollout config; `engine_kwargs.vllm` adds or overrides the rest.

    load: the sequences the schedule decodes on this engine at once (rollout/engine_load.py): CUDA graphs are
    captured up to it (compilation_config's max_cudagraph_capture_size, added to the user's compilation_config)
    unless engine_kwargs.vllm.compilation_config sizes them itself."""
    user = dict(config.engine_kwargs.vllm or {})
    owned = sorted(set(user) & set(CONFIG_OWNED_ENGINE_KWARGS))
    if owned:
        raise ValueError(f"rollout.engine_kwargs.vllm sets {owned}; set them through "
                         f"{[CONFIG_OWNED_ENGINE_KWARGS[key] for key in owned]} instead")
    compilation = user.get("compilation_config") or {}
    sized = ([f"compilation_config.{key}" for key in GRAPH_SIZE_KEYS if key in compilation]
             if isinstance(compilation, Mapping) else ["compilation_config"])  # vLLM also takes a bare mode (int)
    graph_size = cuda_graph_size("vllm", f"compilation_config.{GRAPH_SIZE_KEY}", config, load, sized)
    if graph_size is not None:
        user["compilation_config"] = compilation = {**compilation, GRAPH_SIZE_KEY: graph_size}
    if config.full_determinism and isinstance(compilation, Mapping):
        user["compilation_config"] = deterministic_compilation(compilation)
    return {
        "model": model_path,
        "dtype": config.dtype,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "load_format": config.load_format,
        "tensor_parallel_size": config.tensor_model_parallel_size,
        **(TENSOR_PARALLEL_KWARGS if config.tensor_model_parallel_size > 1 else {}),
        "max_model_len": config.max_model_len or config.prompt_length + config.response_length,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enforce_eager": config.enforce_eager,
        "enable_sleep_mode": True,
        "skip_tokenizer_init": True,
        "logprobs_mode": "processed_logprobs",
        "seed": config.seed if config.full_determinism else seed,
        "disable_log_stats": config.disable_log_stats,
        **user,
    }


def deterministic_compilation(compilation: Mapping) -> dict[str, Any]:
    """`compilation` with Inductor told not to time its combo kernels. torch.use_deterministic_algorithms (which
    full_determinism turns on in this process) puts Inductor in its deterministic mode, which refuses any kernel
    timing that could pick a different kernel from one run to the next; vLLM asks for that timing by default
    (benchmark_combo_kernel), so its compile failed there. Combo kernels stay; the user's own choice is kept."""
    inductor = dict(compilation.get("inductor_compile_config") or {})
    inductor.setdefault("benchmark_combo_kernel", False)
    return {**compilation, "inductor_compile_config": inductor}


def stop_token_ids(config, eos_ids: list[int]) -> list[int]:
    """The stop tokens to send: the trainer's EOS ids, none with rollout.ignore_eos. vLLM stops at stop_token_ids
    whatever ignore_eos says (its check_stop tests them apart; ignore_eos covers the model's own EOS only), so sending
    them would end responses that ignore_eos asks to run to their length."""
    return [] if config.ignore_eos else list(eos_ids)


def sampling_params(config, meta_info: dict, eos_ids: list[int]) -> dict[str, Any]:
    """vllm.SamplingParams keyword arguments for one generate call (val_kwargs when meta_info["validate"]): greedy
    when do_sample is false."""
    source = sampling_source(config, meta_info)
    do_sample = meta_info.get("do_sample", source.do_sample)
    return vllm_sampling(config, max_tokens=max_new_tokens(config, meta_info), eos_ids=eos_ids,
                         log_probs=config.calculate_log_probs, temperature=source.temperature if do_sample else 0.0,
                         top_p=source.top_p, top_k=source.top_k)


def vllm_sampling(config, *, max_tokens: int, eos_ids: list[int], log_probs: bool, temperature: float, top_p: float,
                  top_k: int) -> dict[str, Any]:
    """vllm.SamplingParams keyword arguments with every parameter explicit, for the batch path (sampling_params) and
    the engine server (vllm_async.py) alike. Greedy at temperature 0; vLLM's "top_k off" is 0 (the config's is -1).
    log_probs: the sampled token's log-prob only (logprobs=0), kept by vLLM as flat lists (see sampled_log_probs)."""
    params = {"n": 1, "max_tokens": max_tokens, "ignore_eos": config.ignore_eos,
              "stop_token_ids": stop_token_ids(config, eos_ids), "min_p": 0.0, "repetition_penalty": 1.0,
              "frequency_penalty": 0.0, "presence_penalty": 0.0, "detokenize": False,
              "logprobs": 0 if log_probs else None, "flat_logprobs": True}
    if temperature == 0:
        return {**params, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
    return {**params, "temperature": float(temperature), "top_p": float(top_p),
            "top_k": 0 if int(top_k) < 0 else int(top_k)}


def _completion(output, row: int, response_length: int):
    """The row's one completion (vLLM's CompletionOutput); an aborted request is an error, not an empty answer."""
    completion = output.outputs[0]
    if completion.finish_reason == "abort":
        raise RuntimeError(f"vllm aborted the request of prompt row {row}")
    if len(completion.token_ids) > response_length:
        raise RuntimeError(f"vllm returned {len(completion.token_ids)} tokens for prompt row {row}, more than "
                           f"rollout.response_length={response_length}")
    return completion


def sampled_log_probs(completion, row: int) -> list[float]:
    """The log-prob of each sampled token. SamplingParams(flat_logprobs=True) has vLLM keep them as flat lists
    (FlatLogprobs: with logprobs=0, one entry a position, the sampled token's) instead of one {token_id: Logprob}
    dict a position: 262,144 such objects a batch of 512 x 512 are made in vLLM's step loop and read back here, on
    the host core that loop is bound by (benchmarks/README.md, 2026-12-06). The dict layout is still read, for an
    engine or a caller that returns it."""
    logprobs = completion.logprobs
    if logprobs is None or len(logprobs) != len(completion.token_ids):
        got = None if logprobs is None else len(logprobs)
        raise RuntimeError(f"vllm returned {len(completion.token_ids)} tokens but {got} log-prob entries for prompt "
                           f"row {row} (SamplingParams(logprobs=0) asks for one per token)")
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs
        if list(logprobs.token_ids) != list(completion.token_ids):
            raise RuntimeError(f"vllm's flat log-probs of prompt row {row} are not of its sampled tokens, one a "
                               f"position (SamplingParams(logprobs=0) asks for exactly that)")
        return list(logprobs.logprobs)
    return [float(position[token].logprob) for token, position in zip(completion.token_ids, logprobs)]
