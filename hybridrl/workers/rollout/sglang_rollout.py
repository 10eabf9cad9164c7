"""The `sglang` rollout: an in-process `sglang.Engine` that takes token ids and returns token ids.

Hybrid engine: the engine shares the GPU (and the process) with the FSDP actor, and the two take
turns. The worker's mode switch (rollout/mode_switch.py) drives the turns through the lifecycle
contract of rollout/base.py, implemented here:

- resume(("weights",)): with `rollout.multi_stage_wake_up` only the weights' memory (the order that
  keeps peak memory lowest: the push comes next, then the trainer parks its state, then the KV
  cache); without it, everything at once. Before resuming, the device must have room for it, else
  EngineMemoryError names the numbers and the keys to change (a resume that does not fit would
  kill the engine's scheduler with a CUDA OOM).
- update_weights(named_tensors): the full parameters, `rollout.update_weights_bucket_megabytes` at
  a time, cast to `rollout.dtype` into one flat buffer per bucket, through
  `update_weights_from_tensor` (CUDA IPC: the engine copies straight from our GPU buffer).
- resume(("kv_cache",)): KV cache and CUDA graphs, then one radix-cache flush (its entries predate
  the weights just pushed).
- release(...): weights, KV cache and CUDA graphs all go (torch_memory_saver cannot release the
  KV cache and keep the graphs).
With `rollout.free_cache_engine=false` the engine keeps its memory: resume and release do nothing
but the flush, and the weights survive, so an unchanged weights version is not pushed again.
GPU memory (allocated/reserved by this process, held by the engine's processes, used on the device)
is logged at each transition and kept, with the sync's size and speed, in `self.last_switch`.

The engine is started with

- enable_memory_saver: weights, KV cache and CUDA graphs are released through torch_memory_saver
  and resumed at the same virtual addresses, so captured CUDA graphs stay valid. Weight contents
  are lost on release: the trainer's weights are pushed after every resume.
- load_format from `rollout.load_format` ("dummy": random weights at start, the checkpoint is never
  read, since the first wake-up pushes the trainer's weights anyway).
- skip_tokenizer_init: token ids in and out; the trainer owns the tokenizer.
- mem_fraction_static = `rollout.gpu_memory_utilization` (weights + KV cache, as a share of the GPU).
- attention_backend "triton" and sampling_backend "pytorch" unless `rollout.engine_kwargs.sglang`
  says otherwise: SGLang's Hopper default (fa3) needs kernels the offline GPU bundle does not carry,
  and flashinfer sampling compiles kernels on first use.

One response per prompt row, like every rollout (the trainer repeats prompts `rollout.n` times).
Sampling comes from the config (val_kwargs with meta_info["validate"]), every parameter sent
explicitly so that a model's generation_config cannot change the distribution the trainer scores.
A response ends at the first of meta_info["eos_token_id"] (sent as stop_token_ids) or of the
model's own EOS ids (SGLang always stops there), stop token included, unless `rollout.ignore_eos`.
response_mask marks exactly the generated tokens; rollout_log_probs are SGLang's log-probs of them
under logits / temperature (raw logits when greedy), the distribution the actor scores.

SGLang answers a dead child process (scheduler, detokenizer) by SIGKILLing the whole process,
i.e. this trainer worker, without a word to the controller. `EngineMonitor` replaces that: a dead
child turns the pending and every later engine call into `EngineDiedError` naming the process and
its exit code, within about a second.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from typing import Any

import torch

from hybridrl.protocol import DataProto
from hybridrl.workers.rollout.base import BaseRollout, register_rollout
from hybridrl.workers.rollout.engine_load import EngineLoad, cuda_graph_size
from hybridrl.workers.rollout.engine_io import (RESUME_HEADROOM, EngineDiedError, GiB,
                                                engine_output, generation_config_ids, prompt_token_lists,
                                                resume_memory_error, token_ids)
from hybridrl.workers.rollout.request_seeds import batch_row_seeds
from hybridrl.workers.rollout.sampling import max_new_tokens, sampling_source
from hybridrl.workers.rollout.tensor_parallel import visible_devices
from hybridrl.workers.rollout.sglang_weights import DTYPES, FlatBucket, bucket_capacity, gpu_memory

logger = logging.getLogger(__name__)

ALL_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang.srt.constants GPU_MEMORY_TYPE_*

# Engine arguments that come from rollout config keys; engine_kwargs.sglang may not set them.
CONFIG_OWNED_ENGINE_KWARGS = {
    "model_path": "actor_rollout_ref.model.path",
    "dtype": "rollout.dtype",
    "mem_fraction_static": "rollout.gpu_memory_utilization",
    "load_format": "rollout.load_format",
    "tp_size": "rollout.tensor_model_parallel_size",
    "context_length": "rollout.max_model_len (default prompt_length + response_length + 2)",
    "max_running_requests": "rollout.max_num_seqs",
    "chunked_prefill_size": "rollout.max_num_batched_tokens",
    "disable_cuda_graph": "rollout.enforce_eager",
    "enable_memory_saver": "(always on: the hybrid engine releases memory)",
    "skip_tokenizer_init": "(always on: token ids in and out)",
    "base_gpu_id": "(this process's CUDA device)",
    "random_seed": "(this process's torch seed; rollout.seed with rollout.full_determinism)",
    "enable_deterministic_inference": "rollout.full_determinism",
}
DEFAULT_ENGINE_KWARGS = {"attention_backend": "triton", "sampling_backend": "pytorch", "log_level": "error"}
# The decode CUDA graphs' largest batch (sglang 0.5.16's ServerArgs; benchmarks/hybrid_engine.py sets it), and every
# engine argument that sizes the graphs: one of them in engine_kwargs.sglang is the user's choice, which wins.
GRAPH_SIZE_KEY = "cuda_graph_max_bs_decode"
GRAPH_SIZE_KEYS = ("cuda_graph_max_bs", "cuda_graph_max_bs_decode", "cuda_graph_bs")


@register_rollout("sglang")
class SGLangRollout(BaseRollout):
    shares_trainer_weights = False  # the engine holds its own copy: the worker pushes the trainer's weights
    spans_gpus = True  # build_rollout gives it tensor_model_parallel_size GPUs (rollout/tensor_parallel.py)
    sized_for_load = True  # build_rollout gives it the schedule's engine_load: CUDA graphs up to that batch

    def __init__(self, config, model_config=None, module=None, engine_gpus: list[str] | None = None,
                 engine_load: EngineLoad | None = None):
        """Start the engine on this process's GPU, then release its memory: the worker rests in trainer mode.
        engine_gpus: with tensor_model_parallel_size k > 1, the k GPUs the engine spans (physical ids, TP-rank
        order; rollout/tensor_parallel.py builds it so, on the group's first rank). engine_load: the sequences the
        schedule decodes on this engine at once (rollout/engine_load.py; None: the engine's default graph sizes)."""
        super().__init__(config, model_config, module)
        if model_config is None:
            raise ValueError("the sglang rollout needs model_config=the policy's ModelSpec (models/spec.py) for the "
                             "model path")
        tp = config.tensor_model_parallel_size
        if tp != len(engine_gpus or [None]):
            raise ValueError(f"rollout.tensor_model_parallel_size={tp}: build the rollout with build_rollout (one "
                             f"engine per group of {tp} ranks, rollout/tensor_parallel.py), got "
                             f"engine_gpus={engine_gpus}")
        import sglang

        first_gpu = 0 if engine_gpus else torch.cuda.current_device()  # engine_gpus: the engine sees only those
        self.engine_kwargs = engine_kwargs(config, model_config.path, gpu_id=first_gpu,
                                           seed=torch.initial_seed() % (2**31), tp_size=tp,
                                           load=engine_load)
        started = time.perf_counter()
        with visible_devices(engine_gpus) if engine_gpus else contextlib.nullcontext():
            self.engine = sglang.Engine(**self.engine_kwargs)
        self.engine_start_s = time.perf_counter() - started
        self.monitor = EngineMonitor(self.engine)
        self.awake_tags = set(ALL_MEMORY_TAGS)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.last_switch: dict[str, float] = {}  # timings, sync size and memory of the last switch
        self._metrics: dict[str, float] = {}
        self.generation_config = generation_config_ids(model_config.path)
        self.bucket_bytes = bucket_capacity(config.update_weights_bucket_megabytes, DTYPES[config.dtype],
                                            model_config.path)
        logger.info("sglang engine started in %.1f s with %s", self.engine_start_s, self.engine_kwargs)
        self.resume_bytes: dict[str, int] = {}  # what resuming each tag takes from the device (measured below)
        if config.free_cache_engine:
            self.resume_bytes = self._measure_resume_bytes()

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        if self.awake_tags != set(ALL_MEMORY_TAGS):
            raise RuntimeError(f"generate_sequences: the engine's memory is released (awake: {sorted(self.awake_tags)}); "
                               f"generate in rollout mode (resume(('weights',)), update_weights, resume(('kv_cache',)))")
        eos_ids = token_ids(prompts.meta_info, "eos_token_id", self.generation_config)
        pad_id = token_ids(prompts.meta_info, "pad_token_id", self.generation_config)[0]
        params = sampling_params(self.config, prompts.meta_info, eos_ids)
        token_lists = prompt_token_lists(prompts)
        if self.config.full_determinism:  # each row with its own seed (rollout/request_seeds.py)
            params = [{**params, "sampling_seed": seed}
                      for seed in batch_row_seeds(self.config, prompts.meta_info, len(token_lists))]
        started = time.perf_counter()
        outputs = self.monitor.call("generate", self.engine.generate, input_ids=token_lists,
                                    sampling_params=params, return_logprob=self.config.calculate_log_probs)
        engine_seconds = time.perf_counter() - started
        response_length = self.config.response_length
        generated = [_generated_ids(output, row, response_length) for row, output in enumerate(outputs)]
        log_probs = None
        if self.config.calculate_log_probs:
            log_probs = [[entry[0] for entry in output["meta_info"]["output_token_logprobs"]] for output in outputs]
        return engine_output(prompts, token_lists, generated, log_probs, response_length=response_length,
                             pad_token_id=pad_id, engine_seconds=engine_seconds)

    def _measure_resume_bytes(self) -> dict[str, int]:
        """Release everything, then resume the weights and the rest once each, reading the device's free memory
        around each step: the bytes a later resume of each tag will need (the switch checks them first). Ends
        released, the state the worker rests in."""
        def free_bytes() -> int:
            torch.cuda.synchronize()
            return torch.cuda.mem_get_info()[0]

        self.release_memory()
        released = free_bytes()
        self.resume_memory(("weights",))
        with_weights = free_bytes()
        self.resume_memory(("kv_cache", "cuda_graph"))
        awake = free_bytes()
        self.release_memory()
        return {"weights": max(released - with_weights, 0), "kv_cache+cuda_graph": max(with_weights - awake, 0)}

    def bytes_to_resume(self, tags: tuple[str, ...]) -> int:
        """Device bytes that resume_memory(tags) will take (0 when the engine never releases)."""
        need = self.resume_bytes.get("weights", 0) if "weights" in tags else 0
        if {"kv_cache", "cuda_graph"} & set(tags):
            need += self.resume_bytes.get("kv_cache+cuda_graph", 0)
        return need

    def resume_need(self, tags: tuple[str, ...]) -> int:
        """Device bytes that resume(tags) (the lifecycle tags) will take; a tensor-parallel group checks every
        one of its GPUs against it (the engine takes the same share on each)."""
        return self.bytes_to_resume(self._engine_tags(tags))

    def _engine_tags(self, tags: tuple[str, ...]) -> tuple[str, ...]:
        """The engine's memory tags that resume(tags) resumes: all of them for "weights" without
        multi_stage_wake_up, KV cache and CUDA graphs for "kv_cache"; none already awake."""
        engine_tags: tuple[str, ...] = ()
        if "weights" in tags:
            engine_tags = ALL_MEMORY_TAGS if not self.config.multi_stage_wake_up else ("weights",)
        if "kv_cache" in tags:
            engine_tags += ("kv_cache", "cuda_graph")
        return tuple(tag for tag in ALL_MEMORY_TAGS if tag in engine_tags and tag not in self.awake_tags)

    # ------------------------------------------------------------------ lifecycle (rollout/base.py)
    @property
    def weights_survive_release(self) -> bool:
        return not self.config.free_cache_engine

    def resume(self, tags: tuple[str, ...]) -> None:
        """"weights": resume the weights' memory (everything, without multi_stage_wake_up). "kv_cache": resume the
        KV cache and CUDA graphs, then flush the radix cache. Nothing is resumed with free_cache_engine=false."""
        if "weights" in tags:
            self.last_switch = {}
            self._log_memory("trainer mode")
        engine_tags = self._engine_tags(tags)
        if engine_tags:
            stage = "resume_weights" if "weights" in tags else "resume_kv_cache"
            self._resume_if_room(stage, engine_tags)
            self._log_memory("engine weights resumed" if "weights" in tags else "engine kv cache resumed")
        if "kv_cache" in tags:
            self._timed("flush_cache", self.flush_cache)
            self._metrics["timing_s/flush_cache"] = self.last_switch["flush_cache_s"]
            self._log_memory("rollout mode")

    def _resume_if_room(self, stage: str, tags: tuple[str, ...]) -> None:
        """Resume the engine's `tags` once the device has room for them, else fail now with the numbers.

        The trainer's cached blocks go back to the device first (the engine allocates outside torch's
        allocator). A resume that does not fit would kill the engine's scheduler with a CUDA OOM
        (EngineDiedError, the run's real cause buried in its log); this names the cause and the keys instead.
        """
        torch.cuda.empty_cache()
        need = self.bytes_to_resume(tags)
        free, total = torch.cuda.mem_get_info(self.device)
        if free < need + RESUME_HEADROOM:
            raise resume_memory_error("sglang", tags, need, free, total, torch.cuda.memory_allocated(self.device),
                                      self.config)
        self._timed(stage, self.resume_memory, tags)

    def update_weights(self, named_tensors) -> None:
        """Push every (HF name, full tensor) into the engine, one flat bucket at a time.

        Each tensor is cast to `rollout.dtype` while it is copied into a flat buffer of
        `rollout.update_weights_bucket_megabytes` (at most the model's size, `bucket_capacity`); a full buffer goes
        to the engine as ONE CUDA IPC handle (SGLang's "flattened_bucket" format) instead of one handle per tensor,
        which is what costs time with ~300 tensors. With FSDP2 at most one unit and one bucket of full tensors exist
        at once. The radix cache is flushed by the following resume(("kv_cache",)).
        """
        started = time.perf_counter()
        bucket = FlatBucket(self.bucket_bytes, DTYPES[self.config.dtype], self.device)
        pushed = 0
        for name, tensor in named_tensors:
            if not bucket.fits(tensor):
                pushed += self._push(bucket)
            bucket.add(name, tensor)
        if bucket.metadata:
            pushed += self._push(bucket)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        self.last_switch.update(update_weights_s=seconds, sync_gib=pushed / GiB, sync_gbps=pushed / max(seconds, 1e-9) / 1e9)

    def _push(self, bucket: FlatBucket) -> int:
        flat, metadata = bucket.take()
        self.update_weights_flattened(flat, metadata)
        return sum(entry.numel for entry in metadata)

    def release(self, tags: tuple[str, ...]) -> None:
        """Give the GPU back (weights, KV cache and CUDA graphs, whichever tag is asked: the memory saver releases
        them together); nothing with free_cache_engine=false."""
        if self.config.free_cache_engine:
            self._timed("release_engine", self.release_memory)
        torch.cuda.empty_cache()
        self._log_memory("trainer mode restored")

    def take_metrics(self) -> dict[str, float]:
        metrics, self._metrics = self._metrics, {}
        return metrics

    def _timed(self, stage: str, fn, *args):
        torch.cuda.synchronize()
        started = time.perf_counter()
        result = fn(*args)
        torch.cuda.synchronize()
        self.last_switch[f"{stage}_s"] = time.perf_counter() - started
        return result

    def _log_memory(self, stage: str) -> None:
        memory = gpu_memory(self.engine_pids())
        for key, value in memory.items():
            self.last_switch[f"{stage}/{key}"] = value
        logger.debug("GPU memory, %s: %s", stage, ", ".join(f"{key} {value:.2f} GiB" for key, value in memory.items()))

    # ------------------------------------------------------------------ engine calls
    def release_memory(self) -> None:
        """Give the GPU back: whatever is awake of weights, KV cache and CUDA graphs (weight contents are lost)."""
        awake = [tag for tag in ALL_MEMORY_TAGS if tag in self.awake_tags]
        if awake:
            self.monitor.call(f"release_memory_occupation({awake})", self.engine.release_memory_occupation,
                              tags=awake)
        self.awake_tags = set()

    def resume_memory(self, tags: tuple[str, ...] = ALL_MEMORY_TAGS) -> None:
        unknown = set(tags) - set(ALL_MEMORY_TAGS)
        if unknown:
            raise ValueError(f"resume_memory: unknown tags {sorted(unknown)}; expected some of {list(ALL_MEMORY_TAGS)}")
        self.monitor.call(f"resume_memory_occupation({list(tags)})", self.engine.resume_memory_occupation,
                          tags=list(tags))
        self.awake_tags |= set(tags)

    def update_weights_flattened(self, flat: torch.Tensor, metadata: list) -> None:
        """Load one flat CUDA buffer of HF-named tensors (SGLang's FlattenedTensorMetadata says where each one
        lies) into the engine: one CUDA IPC handle for the whole bucket. The radix cache is not flushed here."""
        from sglang.srt.utils import MultiprocessingSerializer

        self.update_weights_payloads([MultiprocessingSerializer.serialize({"flattened_tensor": flat,
                                                                           "metadata": metadata})])

    def update_weights_payloads(self, payloads: list[bytes]) -> None:
        """One serialized flat bucket per TP rank of the engine (TP rank i reads payloads[i], a CUDA IPC handle
        of a buffer on its own GPU)."""
        success, message = self.monitor.call("update_weights_from_tensor", self.engine.update_weights_from_tensor,
                                             named_tensors=payloads, load_format="flattened_bucket",
                                             flush_cache=False)
        if not success:
            raise RuntimeError(f"sglang update_weights_from_tensor failed ({len(payloads)} TP payload(s)): {message}")

    # ------------------------------------------------------------------ disaggregated: weights over NCCL
    def init_weights_update_group(self, master_address: str, master_port: int, rank: int, world_size: int,
                                  group_name: str) -> None:
        """Join the trainer's weight-transfer group (rollout/weight_transfer.py): the engine's TP worker i as
        `rank` + i (one worker at tp=1; a tensor-parallel engine's k, tensor_parallel.py). Blocks until every member
        joined; the trainer's rank 0 joins through the same SGLang helper."""
        success, message = self.monitor.call("init_weights_update_group", self.engine.init_weights_update_group,
                                             master_address=master_address, master_port=master_port,
                                             rank_offset=rank, world_size=world_size, group_name=group_name,
                                             backend="nccl")
        if not success:
            raise RuntimeError(f"sglang init_weights_update_group failed (rank {rank} of {world_size} at "
                               f"{master_address}:{master_port}): {message}")

    def update_weights_from_distributed(self, bucket: list, group_name: str) -> None:
        """Receive one bucket (weight_transfer.TensorMeta list, in broadcast order) from the group's rank 0 straight
        into the engine; the radix cache is flushed after each bucket (its entries predate the new weights)."""
        success, message = self.monitor.call(
            "update_weights_from_distributed", self.engine.update_weights_from_distributed,
            names=[meta.name for meta in bucket], dtypes=[meta.dtype for meta in bucket],
            shapes=[list(meta.shape) for meta in bucket], group_name=group_name, flush_cache=True)
        if not success:
            raise RuntimeError(f"sglang update_weights_from_distributed failed for {bucket[0].name}... "
                               f"({len(bucket)} tensors): {message}")

    def flush_cache(self) -> None:
        """Drop the radix (prefix) cache: its KV entries were computed with the previous weights."""
        result = self.monitor.call("flush_cache", self.engine.flush_cache)
        if not result.success:
            raise RuntimeError(f"sglang flush_cache failed: {result.message}")

    def engine_pids(self) -> list[int]:
        return [process.pid for _, process in self.monitor.processes]

    def shutdown(self) -> None:
        """Stop the engine's processes (also after it died). Note: sglang kills every child of this process."""
        self.monitor.stop()
        self.engine.shutdown()


# ---------------------------------------------------------------------- configuration mapping

def engine_kwargs(config, model_path: str, gpu_id: int, seed: int, tp_size: int = 1,
                  load: EngineLoad | None = None) -> dict[str, Any]:
    """sglang.Engine keyword arguments from the rollout config; `engine_kwargs.sglang` adds or overrides the rest.

    gpu_id: the engine's first CUDA device as its processes see it (this process's, without TP); seed: the
    sampling seed (the process's torch seed); tp_size: GPUs the engine spans; load: the sequences the schedule
    decodes on this engine at once (rollout/engine_load.py): decode CUDA graphs are captured up to it
    (cuda_graph_max_bs_decode) unless engine_kwargs.sglang sizes them itself.
    """
    user = dict(config.engine_kwargs.sglang or {})
    owned = sorted(set(user) & set(CONFIG_OWNED_ENGINE_KWARGS))
    if owned:
        raise ValueError(f"rollout.engine_kwargs.sglang sets {owned}; set them through "
                         f"{[CONFIG_OWNED_ENGINE_KWARGS[key] for key in owned]} instead")
    graph_size = cuda_graph_size("sglang", GRAPH_SIZE_KEY, config, load,
                                 [key for key in GRAPH_SIZE_KEYS if key in user])
    graphs = {} if graph_size is None else {GRAPH_SIZE_KEY: graph_size}
    return {
        "model_path": model_path,
        "dtype": config.dtype,
        "mem_fraction_static": config.gpu_memory_utilization,
        "load_format": config.load_format,
        "tp_size": tp_size,
        # SGLang caps max_new_tokens at context_length - prompt - 2: keep two positions in reserve
        "context_length": config.max_model_len or config.prompt_length + config.response_length + 2,
        "max_running_requests": config.max_num_seqs,
        "chunked_prefill_size": config.max_num_batched_tokens,
        "disable_cuda_graph": config.enforce_eager,
        "enable_memory_saver": True,
        "skip_tokenizer_init": True,
        "base_gpu_id": gpu_id,
        "random_seed": config.seed if config.full_determinism else seed,
        # batch-invariant kernels and per-request sampling_seed (SGLang's deterministic inference)
        **({"enable_deterministic_inference": True} if config.full_determinism else {}),
        **graphs,
        **DEFAULT_ENGINE_KWARGS,
        **user,
    }


def sampling_params(config, meta_info: dict, eos_ids: list[int]) -> dict[str, Any]:
    """SGLang sampling parameters for one generate call (val_kwargs when meta_info["validate"]).

    Greedy when do_sample is false or the temperature is 0. top_k=-1 means off in both configs.
    """
    source = sampling_source(config, meta_info)  # an eval set's own settings over val_kwargs
    do_sample = meta_info.get("do_sample", source.do_sample)
    params = {"max_new_tokens": max_new_tokens(config, meta_info), "ignore_eos": config.ignore_eos,
              "stop_token_ids": eos_ids, "min_p": 0.0, "repetition_penalty": 1.0,
              "frequency_penalty": 0.0, "presence_penalty": 0.0}
    if not do_sample or source.temperature == 0:
        return {**params, "temperature": 0.0, "top_p": 1.0, "top_k": -1}
    return {**params, "temperature": float(source.temperature), "top_p": float(source.top_p),
            "top_k": int(source.top_k)}


def _generated_ids(output: dict, row: int, response_length: int) -> list[int]:
    """The row's generated ids (the stop token included); an aborted request is an error, not an empty answer."""
    finish = output["meta_info"].get("finish_reason") or {}
    if finish.get("type") == "abort":
        raise RuntimeError(f"sglang aborted the request of prompt row {row}: {finish.get('message', finish)}")
    generated = output["output_ids"]
    if len(generated) > response_length:
        raise RuntimeError(f"sglang returned {len(generated)} tokens for prompt row {row}, more than "
                           f"rollout.response_length={response_length}")
    return generated


# ---------------------------------------------------------------------- engine failure → exception

class EngineMonitor:
    """Turns the death of an engine subprocess into `EngineDiedError` in the caller, instead of a hang or a SIGKILL.

    A thread polls the engine's child processes every `poll_s`. When one has died it records the
    cause and cancels the tasks of the engine's event loop, so a `generate` (or any call) blocked
    waiting for the dead scheduler returns at once; `call` turns that into EngineDiedError.
    SGLang's own watchdog (which SIGQUITs this process) is stopped, and a SIGQUIT from a failing
    child no longer kills this process (only possible from the main thread, where Ray runs actor methods).
    """

    def __init__(self, engine, poll_s: float = 1.0):
        tokenizer_manager = engine.tokenizer_manager
        watchdog = tokenizer_manager._subprocess_watchdog  # sglang 0.5.16: holds the child mp.Process objects
        self.processes = list(zip(watchdog._names, watchdog._processes))
        watchdog.stop()
        self.loop = engine.loop
        self.cause: str | None = None
        self._stop = threading.Event()
        if threading.current_thread() is threading.main_thread():
            # sglang installs its SIGQUIT handler with its response loop; create that loop now, inside the
            # engine's event loop (outside a running loop sglang would make a new one and never see replies)
            self.loop.run_until_complete(_start_response_loop(tokenizer_manager))
            self.loop.add_signal_handler(signal.SIGQUIT, self._on_sigquit)
        else:
            logger.warning("sglang engine started outside the main thread: a failing engine child's SIGQUIT "
                           "will terminate this process")
        self._thread = threading.Thread(target=self._watch, args=(poll_s,), name="sglang-engine-monitor", daemon=True)
        self._thread.start()

    def call(self, what: str, fn, *args, **kwargs):
        """fn(*args, **kwargs), or EngineDiedError when the engine is (or goes) dead."""
        if self.cause is not None:
            raise EngineDiedError(f"sglang engine call {what}: {self.cause}")
        try:
            return fn(*args, **kwargs)
        except (asyncio.CancelledError, Exception) as error:
            if self.cause is not None:
                raise EngineDiedError(f"sglang engine call {what}: {self.cause}") from error
            raise

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            for name, process in self.processes:
                if not process.is_alive():
                    self.cause = f"engine process {name} (pid {process.pid}) died with exit code {process.exitcode}"
                    logger.error("%s", self.cause)
                    self.loop.call_soon_threadsafe(_cancel_all_tasks, self.loop)
                    return

    def _on_sigquit(self) -> None:
        logger.error("an sglang engine process sent SIGQUIT (it is failing); the monitor reports it when it exits")


async def _start_response_loop(tokenizer_manager) -> None:
    tokenizer_manager.auto_create_handle_loop()


def _cancel_all_tasks(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()
