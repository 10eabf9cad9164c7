"""Hybrid-engine benchmark on one GPU: FSDP2 actor + colocated SGLang engine, against a standalone engine.

    PYTHONPATH=. python benchmarks/hybrid_engine.py --model-dir /tmp/q05 --make-model --out bench.json
    PYTHONPATH=. python benchmarks/hybrid_engine.py --model-dir /tmp/q05tok --tokenizer DIR --out bench.json
    PYTHONPATH=.:/tmp/site-vllm:/tmp/site python benchmarks/hybrid_engine.py --engine vllm \
        --override +actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=8589934592 ...
        (the same for vLLM: the standalone vllm.LLM runs in a spawned process of its own, up beside the hybrid engine,
        and the two take turns generating, A B B A: see StandaloneBeside; both must fit, hence the sized KV cache)

Model: the Qwen2.5-0.5B architecture (hidden 896, 24 layers, 14 heads, 2 KV heads, real vocabulary
of 151,936, tied embeddings) with random weights, saved in bf16. With --tokenizer DIR the model (made in
--model-dir unless one of that vocabulary is there) has DIR's tokenizer and embedding count (benchmarks/vocab.py:
151,936 for Qwen2.5's tokenizer) and its eos/pad ids; without, Qwen2.5's count and no tokenizer. Either way the
prompts are random token ids kept 1,000 (ID_MARGIN) from both ends of the embedding range, so they are ordinary text
tokens (Qwen2.5's special and padding entries are its top 293): what generation costs depends on how many tokens
there are and how wide the logits are, not on which tokens they are, and random ids keep every prompt exactly
--prompt-length tokens, as in the runs recorded before, which real text would not. Prints one table (its `vocab`
row, like the JSON's `vocab`, names the vocabulary):
engine start, weight sync (s, GB/s), release, resume, the full rollout→train→rollout switch (with
and without offloading the FSDP state), the engine's memory awake and released (the device's used memory less
the trainer's), the engine's log-probs of its sampled tokens against the FSDP actor's right after a sync of the
trained weights (mean |Δ|, the k3 KL), and generation tokens/s for 64 prompts × n=8 × 512 new
tokens, then the same generation on a standalone `sglang.Engine` started after the hybrid one is shut
down, with the same engine arguments (memory saver included) except that it reads its weights from
disk, and the ratio. `--standalone-without-memory-saver` adds a second standalone engine without
torch_memory_saver, to show what the saver itself costs.

The builders below (model, process group, config, actor, hybrid engine) are also what
tests/gpu uses, so the tests and the numbers come from the same wiring.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import statistics
import sys
import time

import torch

from benchmarks.vocab import Vocabulary, load_vocabulary
from hybridrl.models.offload import FSDPOffload
from hybridrl.workers.rollout.mode_switch import RolloutModeSwitch
from hybridrl.workers.rollout.sglang_rollout import sampling_params

logger = logging.getLogger(__name__)

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                  tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0)
EOS_ID, PAD_ID = 151643, 151643  # Qwen2.5's <|endoftext|>
ID_MARGIN = 1000  # random token ids keep this far from both ends of the vocabulary: ordinary text, no special tokens


# ---------------------------------------------------------------------- builders (shared with tests/gpu)

def make_qwen05b_model(model_dir: str, seed: int = 0) -> str:
    """Save a random-weight Qwen2.5-0.5B-shaped model (bf16 safetensors + generation_config) to `model_dir`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if os.path.exists(os.path.join(model_dir, "config.json")):
        return model_dir
    config = Qwen2Config(**QWEN25_05B, bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                         use_sliding_window=False)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    model.save_pretrained(model_dir, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return model_dir


def init_single_gpu_process_group(backend: str = "nccl") -> None:
    """World size 1 over NCCL (gloo for a CPU check), as a RayWorkerGroup would set it up for one worker."""
    from hybridrl.utils.distributed import init_process_group_once

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(key, value)
    init_process_group_once(backend)


def hybrid_config(model_dir: str, overrides: list[str] = (), engine: str = "sglang", device: str = "cuda"):
    """The validated PPOConfig for one GPU (or the CPU) with rollout.name=`engine` (plus `overrides`)."""
    import hybridrl.checks  # noqa: F401  registers the subsystems' config checks
    from hybridrl.config import compose_config, validate_config

    return validate_config(compose_config([
        f"actor_rollout_ref.model.path={model_dir}", f"actor_rollout_ref.rollout.name={engine}",
        f"trainer.device={device}", "trainer.n_gpus_per_node=1", *overrides]))


def build_actor(config):
    """FSDP2 actor (fp32 master weights, bf16 compute), its AdamW, and the DataParallelPPOActor around them."""
    from hybridrl.models.fsdp_utils import build_optimizer, shard_model
    from hybridrl.models.spec import policy_model_spec
    from hybridrl.workers.actor.dp_actor import DataParallelPPOActor

    section = config.actor_rollout_ref
    model = policy_model_spec(config).load(dtype=torch.float32, device="cuda", init_seed=0)
    module = shard_model(model, strategy="fsdp2", device="cuda", mixed_precision=True)
    optimizer = build_optimizer(module, section.actor.optim)
    actor = DataParallelPPOActor(section.actor, module, optimizer, rollout_n=section.rollout.n,
                                 log_prob_micro_batch_size=16, device="cuda")
    return module, optimizer, actor


def build_hybrid(config, module):
    """The configured rollout engine (sglang or vllm) and the trainer<->rollout mode switch for `module` (what the
    worker wires)."""
    from hybridrl.models.spec import policy_model_spec
    from hybridrl.workers.rollout.base import get_rollout_class

    section = config.actor_rollout_ref
    rollout = get_rollout_class(section.rollout.name)(config=section.rollout, model_config=policy_model_spec(config),
                                                      module=module)
    return rollout, RolloutModeSwitch(module, rollout)


def offloading_switch(module, optimizer, rollout):
    """A mode switch that parks the FSDP parameters and Adam state in CPU memory for the rollout and brings
    them back in trainer mode."""
    state = FSDPOffload(module, optimizer, param_offload=True, optimizer_offload=True, device="cuda")
    return RolloutModeSwitch(module, rollout, trainer_state=state, reload_trainer_state=True)


WEIGHT_VERSIONS = itertools.count(1)  # every window here pushes: the weights may have changed in between


@contextlib.contextmanager
def rollout_window(switch: RolloutModeSwitch):
    """rollout_mode on entry (with a new weights version, so the weights are always pushed), trainer_mode on
    exit. When the body raises, a failing trainer_mode (e.g. a dead engine) is logged and the body's error wins."""
    switch.rollout_mode(next(WEIGHT_VERSIONS))
    try:
        yield switch
    except BaseException:
        try:
            switch.trainer_mode()
        except Exception:
            logger.exception("trainer_mode failed while handling the rollout's error")
        raise
    switch.trainer_mode()


def random_prompts(num_prompts: int, prompt_length: int, vocab_size: int, seed: int = 0, ragged: bool = False):
    """A left-padded prompt DataProto of random token ids (lengths prompt_length/2..prompt_length when ragged)."""
    from hybridrl.protocol import DataProto

    generator = torch.Generator().manual_seed(seed)
    margin = min(ID_MARGIN, vocab_size // 4)  # a CPU check's tiny vocabulary keeps a quarter at each end clear
    input_ids = torch.randint(margin, vocab_size - margin, (num_prompts, prompt_length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if ragged:
        lengths = torch.randint(prompt_length // 2, prompt_length + 1, (num_prompts,), generator=generator)
        for row, length in enumerate(lengths.tolist()):
            attention_mask[row, :prompt_length - length] = 0
            input_ids[row, :prompt_length - length] = PAD_ID
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": attention_mask,
                                "position_ids": position_ids},
                               meta_info={"eos_token_id": EOS_ID, "pad_token_id": PAD_ID})


# ---------------------------------------------------------------------- benchmark

def train_step(module, optimizer) -> None:
    """One real optimizer step (so the Adam state exists and the switch moves a trained model's state)."""
    input_ids = torch.randint(ID_MARGIN, min(100000, module.config.vocab_size - ID_MARGIN), (4, 256), device="cuda")
    loss = module(input_ids=input_ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def time_switches(switch: RolloutModeSwitch, repeats: int) -> dict[str, float]:
    """Median stage timings over `repeats` rollout→train→rollout switches (trainer_mode, then rollout_mode).

    The engine's own stage timings and memory gauges (`rollout.last_switch`) win over the switch's
    (which also count the free-memory check and the gauges themselves); offload/reload come from the switch."""
    rollout = switch.rollout
    records = []
    switch.rollout_mode(next(WEIGHT_VERSIONS))
    for _ in range(repeats):
        started = time.perf_counter()
        to_trainer = switch.trainer_mode()
        released = dict(rollout.last_switch)
        to_rollout = switch.rollout_mode(next(WEIGHT_VERSIONS))
        full_switch_s = time.perf_counter() - started
        awake = dict(rollout.last_switch)
        switch_parts = {f"{key.removeprefix('timing_s/')}_s": value for key, value in {**to_trainer, **to_rollout}.items()}
        # SGLang gauges its engine processes' memory; vLLM runs in this process: the device's used memory instead
        gauge = "engine" if "rollout mode/engine" in awake else "device_used"
        records.append({**switch_parts, "release_engine_s": released["release_engine_s"],
                        **{key: value for key, value in awake.items() if "/" not in key},
                        "full_switch_s": full_switch_s,
                        "engine_released_gib": released[f"trainer mode restored/{gauge}"],
                        "engine_awake_gib": awake[f"rollout mode/{gauge}"],
                        "device_used_released_gib": released["trainer mode restored/device_used"],
                        "device_used_awake_gib": awake["rollout mode/device_used"]})
    switch.trainer_mode()
    return {key: statistics.median(record[key] for record in records) for key in records[0]}


def actor_log_probs(actor, output, temperature: float = 1.0) -> torch.Tensor:
    """The FSDP actor's recomputed log-probs of the rollout's response tokens (trainer mode)."""
    data = output.select(["input_ids", "attention_mask", "position_ids", "responses"])
    data.meta_info["temperature"] = temperature
    log_probs, _ = actor.compute_log_prob(data)
    return log_probs


def disagreement(rollout_log_probs, fsdp_log_probs, response_mask) -> tuple[float, float]:
    """mean |Δ log p| and the k3 estimate of KL(rollout || fsdp) over the response tokens."""
    delta = (fsdp_log_probs - rollout_log_probs)[response_mask.bool()]
    return float(delta.abs().mean()), float((delta.exp() - delta - 1).mean())


@contextlib.contextmanager
def log_probs_on(rollout):
    """Inside, the rollout returns the sampled tokens' log-probs (rollout.calculate_log_probs, read at each call);
    the timed generation outside runs without them, as before."""
    saved = rollout.config.calculate_log_probs
    rollout.config.calculate_log_probs = True
    try:
        yield
    finally:
        rollout.config.calculate_log_probs = saved


def log_prob_agreement(switch: RolloutModeSwitch, actor, prompts, temperature: float) -> dict[str, float]:
    """Push the trainer's weights (a new version), sample `prompts` with the engine's log-probs, and score the same
    tokens with the FSDP actor: how far the engine's policy is from the trainer's right after a sync."""
    with rollout_window(switch), log_probs_on(switch.rollout):
        output = switch.rollout.generate_sequences(prompts)
    mean_abs, kl = disagreement(output.batch["rollout_log_probs"], actor_log_probs(actor, output, temperature),
                                output.batch["response_mask"])
    return {"mean_abs": mean_abs, "kl_k3": kl, "tokens": int(output.batch["response_mask"].sum())}


def device_used_gib() -> float:
    """GiB in use on the whole device (engines allocate outside torch's statistics), this process's cache returned."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return (total - free) / (1 << 30)


def time_generation(generate, prompts) -> tuple[float, int]:
    """The seconds of one generate(prompts), from a synchronized device, and the number of tokens it generated."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    tokens = generate(prompts)
    return time.perf_counter() - started, tokens


def time_runs(generate, prompts, repeats: int) -> dict:
    """`repeats` timed runs of generate(prompts), summarized by summarize_runs."""
    return summarize_runs([time_generation(generate, prompts) for _ in range(repeats)])


def summarize_runs(runs: list[tuple[float, int]]) -> dict:
    """(seconds, tokens) runs: the mean tokens/s, each run's, and the tokens of one run. The mean, not the best: vLLM's
    loop at this shape is bound by the host and one batch takes 5.5 to 11.4 s run after run (H200, 2026-12-02,
    benchmarks/vllm_generation_gap.py), so a best-of-2 on each side compares two draws of that spread."""
    rates = [tokens / seconds for seconds, tokens in runs]
    return {"seconds": statistics.mean(seconds for seconds, _ in runs), "tokens": runs[-1][1],
            "tok_per_s": statistics.mean(rates), "tok_per_s_runs": rates}


def time_standalone(engine_kwargs: dict, token_lists: list[list[int]], params: dict, repeats: int) -> dict:
    """Start a standalone sglang.Engine with `engine_kwargs`, time generating `token_lists`, shut it down."""
    import sglang

    started = time.perf_counter()
    engine = sglang.Engine(**engine_kwargs)
    start_s = time.perf_counter() - started

    def generate(_):
        outputs = engine.generate(input_ids=token_lists, sampling_params=params)
        return sum(len(output["output_ids"]) for output in outputs)

    runs = time_runs(generate, None, repeats)
    engine.shutdown()
    return {"engine_start_s": start_s, **runs}


def in_own_process(function, *args):
    """function(*args) in a freshly spawned process. vLLM keeps per-process state that a second engine in the hybrid
    one's process trips over: on the H200 its CuMem allocator refused a second sleep-mode engine ("can only be used
    for one instance per process"), and without sleep mode the second engine died in a compiled kernel ("CUDA driver
    error: invalid argument"). A ProcessPoolExecutor's worker, unlike a Pool's, is not a daemon: it may start vLLM's
    engine-core process of its own."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_without_rendezvous, function, *args).result()


def _without_rendezvous(function, *args):
    """Run function(*args) without this benchmark's torch.distributed variables (the parent's group holds them)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    return function(*args)


def llm_generate(llm, sampling, token_lists: list[list[int]]):
    """A generate(_) for time_generation: a vllm.LLM's own call on `token_lists`, returning the tokens it made."""
    prompts = [{"prompt_token_ids": ids} for ids in token_lists]

    def generate(_):
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        return sum(len(output.outputs[0].token_ids) for output in outputs)
    return generate


def serve_standalone_vllm(connection, engine_kwargs: dict, token_lists: list[list[int]], params: dict) -> None:
    """The standalone vllm.LLM's process (StandaloneBeside): start the engine, send its start seconds, then generate
    `token_lists` once per True received, sending back the tokens made, until False."""
    import vllm

    started = time.perf_counter()
    llm = vllm.LLM(**engine_kwargs)
    connection.send(time.perf_counter() - started)
    generate = llm_generate(llm, vllm.SamplingParams(**params), token_lists)
    while connection.recv():
        connection.send(generate(None))


def _serve_beside(serve, connection, *args) -> None:
    """StandaloneBeside's process: serve(connection, *args) without the parent's rendezvous; an error is sent to the
    parent, then raised."""
    try:
        _without_rendezvous(serve, connection, *args)
    except BaseException as error:
        connection.send(RuntimeError(f"the standalone engine's process: {error!r}"))
        raise


class StandaloneBeside:
    """A standalone engine in a spawned process of its own (see in_own_process), up beside the hybrid one, generating
    one batch when asked, so that time_interleaved can alternate the two. vLLM's loop at the 0.5B shape is bound by the
    host, and one batch of identical work took 5.5 to 11.4 s (H200, 2026-12-02): engines timed one after the other
    meet different stretches of that, engines taking turns meet the same ones."""

    def __init__(self, serve, *args, poll_s: float = 5.0):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.connection, child_end = context.Pipe()
        self.process = context.Process(target=_serve_beside, args=(serve, child_end, *args), name="standalone")
        self.process.start()
        child_end.close()  # the child's end lives in the child alone, so its death reads as EOF here
        self.poll_s = poll_s
        self.engine_start_s = self._receive()

    def _receive(self):
        """The process's next reply; its error raised here, or its death (no reply) named with its exit code."""
        while not self.connection.poll(self.poll_s):
            if not self.process.is_alive():
                break
        try:
            reply = self.connection.recv()
        except EOFError:
            self.process.join(self.poll_s)
            raise RuntimeError(f"the standalone engine's process died (exit code {self.process.exitcode})") from None
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def generate(self, _) -> int:
        self.connection.send(True)
        return self._receive()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a dead process's pipe is broken
            self.connection.send(False)
        self.process.join(60)
        if self.process.is_alive():
            self.process.kill()


def with_threads(generate, threads: int):
    """generate(batch) run with `threads` torch CPU threads, the process's count restored afterwards. Set around every
    call rather than once at start, so that nothing the engine sets up in between (vLLM runs in this process) can
    change what a timed run gets."""
    def run(batch):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return generate(batch)
        finally:
            torch.set_num_threads(previous)
    return run


def time_interleaved(generators: dict, prompts, repeats: int, time_run=time_generation) -> dict[str, dict]:
    """time_runs' numbers for each of two or more generate(prompts) callables taking turns, in the order A B B A A B
    ... (with three: A B C C B A ...), so that no side gets all the earlier or all the later runs. Every side but the
    last also holds pair_ratios: its tokens/s over the last side's (the reference), turn by turn. time_run(generate,
    prompts) -> (seconds, tokens) times one run (time_generation: the whole call; agent_loop_gap.py times only the
    generation inside a rollout window). Each run is printed as it ends, so a run cut off at a time limit still
    leaves the turns it made in its output."""
    order = list(generators.items())
    runs: dict[str, list] = {name: [] for name, _ in order}
    for index in range(repeats):
        for name, generate in order if index % 2 == 0 else order[::-1]:
            seconds, tokens = time_run(generate, prompts)
            runs[name].append((seconds, tokens))
            print(f"turn {index + 1}/{repeats} {name}: {seconds:.3f} s, {tokens} tokens, {tokens / seconds:,.0f} tok/s",
                  flush=True)
    summaries = {name: summarize_runs(name_runs) for name, name_runs in runs.items()}
    reference = summaries[order[-1][0]]["tok_per_s_runs"]
    for name, _ in order[:-1]:
        summaries[name]["pair_ratios"] = [a / b for a, b in zip(summaries[name]["tok_per_s_runs"], reference)]
    return summaries


def prepare_model(args) -> Vocabulary:
    """Make the model where asked, and say which vocabulary the run uses: --tokenizer's (the model, of ppo_step.py's
    0.5B shape, the same layers, made in --model-dir unless there), else Qwen2.5's count without a tokenizer."""
    if args.tokenizer:
        from benchmarks.ppo_step import make_model

        vocabulary = load_vocabulary(args.tokenizer)
        if vocabulary.embeddings <= 2 * ID_MARGIN:
            raise SystemExit(f"--tokenizer: {vocabulary.describe()} leaves no ids {ID_MARGIN} clear of both ends")
        make_model("0.5b", vocabulary, args.model_dir)
        return vocabulary
    if args.make_model:
        make_qwen05b_model(args.model_dir)
    return Vocabulary(None, QWEN25_05B["vocab_size"], "Qwen2.5-0.5B's embedding count, no tokenizer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--tokenizer", help="tokenizer directory: the model gets its vocabulary (made in --model-dir "
                                            "if absent, as with --make-model)")
    parser.add_argument("--engine", choices=["sglang", "vllm"], default="sglang")
    parser.add_argument("--make-model", action="store_true", help="create the random model if the dir is empty")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--switch-repeats", type=int, default=5)
    parser.add_argument("--gen-repeats", type=int, default=4, help="timed generations on each side (their mean counts)")
    parser.add_argument("--standalone-without-memory-saver", action="store_true",
                        help="also time a standalone engine without torch_memory_saver")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads while the hybrid engine generates: 1 (default), as in the trainer, "
                             "whose workers are Ray actors with OMP_NUM_THREADS at their CPU share of 1; 0: torch's "
                             "default, one a core. The standalone engine keeps torch's default, as a user runs it")
    parser.add_argument("--compare-default-threads", action="store_true",
                        help="vllm: a third side taking turns, the hybrid engine at torch's default thread count")
    parser.add_argument("--override", action="append", default=[], help="extra config override (repeatable)")
    parser.add_argument("--out", help="write all numbers here as JSON")
    args = parser.parse_args()
    if args.compare_default_threads and args.engine != "vllm":
        parser.error("--compare-default-threads: only with --engine vllm (its engine loop runs in this process)")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(0)  # the engine's sampling seed is the process's torch seed
    vocabulary = prepare_model(args)
    tokenizer = vocabulary.tokenizer
    eos_id, pad_id = (tokenizer.eos_token_id, tokenizer.pad_token_id) if tokenizer else (EOS_ID, PAD_ID)
    init_single_gpu_process_group()
    engine_overrides = [  # 64 x 8 sequences decode together: capture decode CUDA graphs up to that batch
        f"+actor_rollout_ref.rollout.engine_kwargs.sglang.cuda_graph_max_bs_decode={args.prompts * args.n}",
    ] if args.engine == "sglang" else []
    config = hybrid_config(args.model_dir, [
        f"data.max_prompt_length={args.prompt_length}", f"data.max_response_length={args.new_tokens}",
        "actor_rollout_ref.rollout.ignore_eos=true", "actor_rollout_ref.rollout.multi_stage_wake_up=true",
        *engine_overrides, *args.override], engine=args.engine)
    if args.engine == "vllm":
        check_two_engines_fit(config.actor_rollout_ref.rollout)
    module, optimizer, actor = build_actor(config)
    train_step(module, optimizer)
    used_without_engine = device_used_gib()  # the trainer's state (Adam included), before the engine starts
    rollout, switch = build_hybrid(config, module)
    offload_switch = offloading_switch(module, optimizer, rollout)
    default_threads = torch.get_num_threads()
    threads = args.threads or default_threads
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "engine": args.engine,
               "threads": {"hybrid": threads, "torch_default": default_threads},
               "engine_kwargs": {k: v for k, v in rollout.engine_kwargs.items() if k not in ("model_path", "model")},
               "engine_start_s": rollout.engine_start_s, "vocab": vocabulary.record()}
    results["switch"] = time_switches(switch, args.switch_repeats)
    results["switch_offload"] = time_switches(offload_switch, args.switch_repeats)
    results["memory"] = engine_memory(results["switch"], used_without_engine)
    sampled = random_prompts(32, args.prompt_length, vocabulary.embeddings, seed=1, ragged=True)
    sampled.meta_info.update(eos_token_id=eos_id, pad_token_id=pad_id)
    results["log_prob_agreement"] = log_prob_agreement(  # the weights pushed are the trained ones, not the checkpoint's
        switch, actor, sampled, config.actor_rollout_ref.rollout.temperature)

    prompts = random_prompts(args.prompts, args.prompt_length, vocabulary.embeddings).repeat(args.n, interleave=True)
    prompts.meta_info.update(eos_token_id=eos_id, pad_token_id=pad_id)

    engine_seconds: dict[str, list[float]] = {}  # each hybrid side's timing_s/engine_generate, run by run

    def counting_tokens(side: str):
        """A generate(batch) for the hybrid side `side`: the tokens it made; the engine's own seconds of each call
        (its generate alone, not the reading of its outputs into the batch) go to engine_seconds[side]."""
        seconds = engine_seconds.setdefault(side, [])

        def generate_tokens(batch):
            output = rollout.generate_sequences(batch)
            seconds.append(output.meta_info["metrics"]["timing_s/engine_generate"])
            return int(output.batch["response_mask"].sum())
        return generate_tokens

    hybrid_generate = with_threads(counting_tokens("hybrid_generate"), threads)

    token_lists = [row.tolist() for row in prompts.batch["input_ids"]]
    if args.engine == "vllm":  # the standalone engine takes turns with the hybrid one (StandaloneBeside)
        from hybridrl.workers.rollout.vllm_rollout import sampling_params as vllm_sampling_params

        standalone_kwargs = dict(rollout.engine_kwargs, load_format="auto")
        params = vllm_sampling_params(config.actor_rollout_ref.rollout, {}, [eos_id])
        write_results(results, args.out)  # kept if the standalone engine fails
        beside = StandaloneBeside(serve_standalone_vllm, standalone_kwargs, token_lists, params)
        try:
            with rollout_window(switch):
                sides = {"hybrid_generate": hybrid_generate}
                if args.compare_default_threads:
                    sides["hybrid_default_threads"] = with_threads(counting_tokens("hybrid_default_threads"),
                                                                   default_threads)
                runs = time_interleaved({**sides, "standalone": beside.generate}, prompts, args.gen_repeats)
        finally:
            beside.close()
        results.update(runs)
        results["standalone"]["engine_start_s"] = beside.engine_start_s
        rollout.shutdown()
    else:
        with rollout_window(switch):  # generation alone is timed; the switch is timed above
            results["hybrid_generate"] = time_runs(hybrid_generate, prompts, args.gen_repeats)
        rollout.shutdown()
        write_results(results, args.out)  # kept if the standalone engine below fails
        params = sampling_params(config.actor_rollout_ref.rollout, {}, [eos_id])
        standalone = {"standalone": dict(rollout.engine_kwargs, load_format="auto")}
        if args.standalone_without_memory_saver:
            standalone["standalone_no_saver"] = dict(standalone["standalone"], enable_memory_saver=False)
        for name, engine_kwargs in standalone.items():
            results[name] = time_standalone(engine_kwargs, token_lists, params, args.gen_repeats)
    for side, seconds in engine_seconds.items():
        results[side]["engine_generate_s_runs"] = seconds
        results[side]["engine_generate_s"] = statistics.mean(seconds)
    results["generation_ratio"] = results["hybrid_generate"]["tok_per_s"] / results["standalone"]["tok_per_s"]
    print_table(results, args, vocabulary)
    write_results(results, args.out)


def check_two_engines_fit(rollout_config) -> None:
    """Refuse, before any GPU work, a vLLM setting under which the standalone engine and the hybrid one cannot both be
    awake (StandaloneBeside): without kv_cache_memory_bytes each takes gpu_memory_utilization of the device."""
    fraction = rollout_config.gpu_memory_utilization
    if "kv_cache_memory_bytes" not in (rollout_config.get("engine_kwargs", {}).get("vllm") or {}) and fraction > 0.45:
        raise SystemExit(f"--engine vllm runs the standalone engine beside the hybrid one, and two engines of "
                         f"actor_rollout_ref.rollout.gpu_memory_utilization={fraction} do not fit one device: size "
                         f"the KV cache with --override +actor_rollout_ref.rollout.engine_kwargs.vllm."
                         f"kv_cache_memory_bytes=N (benchmarks/README.md: 8589934592 for the default load) or set "
                         f"that fraction to 0.45 or less")


def engine_memory(switch: dict, used_without_engine: float) -> dict[str, float]:
    """What the engine holds awake and released (GiB): the device's used memory at each, less the trainer's (measured
    before the engine started), and the share it keeps released."""
    awake = switch["device_used_awake_gib"] - used_without_engine
    released = switch["device_used_released_gib"] - used_without_engine
    return {"trainer_gib": used_without_engine, "engine_awake_gib": awake, "engine_released_gib": released,
            "released_share": released / awake}


def write_results(results: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as handle:
            json.dump(results, handle, indent=2, default=str)


def runs_cell(runs: dict) -> str:
    """'mean (n runs: slowest-fastest, mean seconds)' for time_runs' numbers."""
    rates = runs["tok_per_s_runs"]
    return (f"{runs['tok_per_s']:,.0f} (mean of {len(rates)}: {min(rates):,.0f}-{max(rates):,.0f}, "
            f"{runs['seconds']:.2f} s)")


def pair_ratios_cell(results: dict) -> str:
    """' (turn by turn: lowest-highest)' where the two engines took turns (time_interleaved), else ''."""
    ratios = results["hybrid_generate"].get("pair_ratios")
    return f" (turn by turn: {min(ratios):.3f}-{max(ratios):.3f})" if ratios else ""


def print_table(results: dict, args, vocabulary: Vocabulary) -> None:
    switch, offload = results["switch"], results["switch_offload"]
    memory, agreement = results["memory"], results["log_prob_agreement"]
    rows = [
        ("device", results["device"]),
        ("vocab", vocabulary.describe()),
        ("hybrid engine start (s)", f"{results['engine_start_s']:.1f}"),
        ("standalone engine start (s)", f"{results['standalone']['engine_start_s']:.1f}"),
        ("resume weights (s)", f"{switch['resume_weights_s']:.4f}"),
        ("weight sync (s)", f"{switch['update_weights_s']:.4f}"),
        ("weight sync (GB/s)", f"{switch['sync_gbps']:.1f} ({switch['sync_gib']:.3f} GiB)"),
        ("resume KV cache + CUDA graphs (s)", f"{switch['resume_kv_cache_s']:.4f}"),
        ("flush radix / prefix cache (s)", f"{switch.get('flush_cache_s', switch.get('reset_prefix_cache_s', 0)):.4f}"),
        ("release (s)", f"{switch['release_engine_s']:.4f}"),
        ("full switch rollout→train→rollout (s)", f"{switch['full_switch_s']:.4f}"),
        ("  same, FSDP params+Adam offloaded (s)", f"{offload['full_switch_s']:.4f} "
                                                    f"(offload {offload['offload_trainer_s']:.3f}, "
                                                    f"reload {offload['reload_trainer_s']:.3f})"),
        ("engine memory awake / released (GiB, device used less the trainer's "
         f"{memory['trainer_gib']:.2f})", f"{memory['engine_awake_gib']:.2f} / {memory['engine_released_gib']:.2f} "
                                          f"({memory['released_share']:.1%} left released)"),
        ("engine log-probs vs FSDP after a sync, mean |Δ| (KL k3)", f"{agreement['mean_abs']:.4f} "
                                                                    f"({agreement['kl_k3']:.1e}, "
                                                                    f"{agreement['tokens']} tokens)"),
        (f"hybrid generate {args.prompts}x{args.n}x{args.new_tokens}, {results['threads']['hybrid']} torch threads "
         f"(tok/s)", runs_cell(results["hybrid_generate"])),
        ("  of which the engine's own generate (s, mean)", f"{results['hybrid_generate']['engine_generate_s']:.3f} "
                                                          f"of {results['hybrid_generate']['seconds']:.3f}"),
        (f"standalone {results['engine']} engine, same settings (tok/s)", runs_cell(results["standalone"])),
        ("hybrid / standalone (means)", f"{results['generation_ratio']:.3f}" + pair_ratios_cell(results)),
    ]
    if "hybrid_default_threads" in results:
        side = results["hybrid_default_threads"]
        rows.append((f"hybrid at torch's default {results['threads']['torch_default']} threads, taking turns (tok/s)",
                     runs_cell(side) + f"; / standalone {side['tok_per_s'] / results['standalone']['tok_per_s']:.3f}"))
    if "standalone_no_saver" in results:
        rows.append(("standalone without memory saver (tok/s)", runs_cell(results["standalone_no_saver"])))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
