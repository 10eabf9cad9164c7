"""What benchmarks/vs_verl.py gives each trainer, and why (issue 59 items 1 and 2): one table, key -> value -> reason.

Kernels: the same for both, and which
-------------------------------------
flash-attn is not used by either trainer. PyPI has no wheel of it at all (`pip download --only-binary=:all:
flash-attn` for CPython 3.12 manylinux finds none, 2026-12-06); its one distribution is the 8.5 MB sdist of
2.8.3.post2, which compiles CUDA extensions against the installed torch at install time, on a host with no network
for its build. So, as issue 59 says for that case, both trainers take their own fused log-prob path:
`actor_rollout_ref.model.use_fused_kernels=true` for both.

- hybridrl: models/fused_logprob.py, `linear_log_probs`: the output layer folded into the log-prob, chunks of
  2**26 logits (441 tokens at 151,936 embeddings), float32 log-softmax; the backward recomputes each chunk.
- verl 0.9.1 with use_fused_kernels=true, use_remove_padding=true and its default trainer (trainer.use_v1=true: the
  engine workers, not dp_actor): workers/engine_workers.py:115 copies model.use_fused_kernels into the engine config;
  workers/engine/fsdp/transformer_impl.py:323-330 calls apply_monkey_patch with it and
  model.fused_kernel_options.impl_backend (default "torch"); models/transformers/monkey_patch.py
  (patch_forward_with_backends) replaces Qwen2ForCausalLM.forward with models/transformers/dense_common.py
  forward_with_torch_backend, which computes the log-probs and entropy with utils/experimental/torch_functional.py
  FusedLinearForPPO -> FusedLinearForPPOFunction: chunks of 512 tokens, float32 log-softmax, the backward
  recomputing each chunk. transformer_impl.py prepare_model_outputs then takes `output.log_probs` (the fused branch,
  ~line 1362): `verl.utils.torch_functional.logprobs_from_logits` and its per-row Python loop
  `logprobs_from_logits_v2` are never called. The entropy comes out of the same function, so verl's
  torch.compile'd `entropy_from_logits` (transformer_impl.py:183-187, `use_torch_compile`, default true) is never
  called either: verl keeps that default, and `actor.use_torch_compile=false` (given to verl before) is dropped.
  KERNELS["verl_log_probs"] below is this path, written into the record; benchmarks/vs_verl_kernels.py shows it by
  running verl's patch on a tiny Qwen2 (calls counted: the fused function once, neither logprobs_from_logits nor its
  row loop).

Attention: verl asks for flash_attention_2, which cannot load without flash-attn. With remove padding both get the
kernel hybridrl uses, PyTorch's own varlen flash attention (`hybridrl_varlen`, models/attention.py): verl through its
own extension hook, `actor_rollout_ref.model.external_lib` (imported by HFModelConfig.__post_init__ in every process
that builds the model config, before the model loads), naming benchmarks/vs_verl_attention.py, which registers the
kernel with transformers; and `override_config.attn_implementation=hybridrl_varlen`. It finds each layer's sequence
boundaries from the packed position_ids, as transformers' flash_attention_2 does for verl with flash-attn. Before
issue 59 verl ran `sdpa` with a dense tokens x tokens block mask here. `--padded`: plain sdpa on padded rows for both.

Engine: the same SGLang 0.5.16 build for both, with the same explicit CUDA-graph size (decode graphs up to one step's
sequences per engine: 64 x 8 = 512 on one GPU; verl passes none, so SGLang would capture up to 256 on an H100/H200),
memory fraction, running-request cap, prefill chunk, context length, attention and sampling backends, and sampling
parameters. Each trainer gets them through its own keys; `Setting.verl_key` and the verl-only rows say where verl's
differ.

The layout, kernel and engine rows (`shared`) follow from a `Workload` alone (a step's prompts x samples on its GPUs,
the lengths, the engine's memory share), so the recipe's comparison with verl
(recipes/qwen25_coder_gsm_symbolic/verl_compare.py) takes the same rows from its own workload: one table for both.

Every row carries a one-line reason; `override_table` writes, per trainer, each key's value beside that trainer's
default (hybridrl's composed config; verl's generated ppo_trainer.yaml) and whether it departs from it.
"""
from __future__ import annotations

import dataclasses
import math
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARD_FILE = os.path.join(REPO, "benchmarks", "vs_verl_reward.py")
VERL_ATTENTION_LIB = "benchmarks.vs_verl_attention"
VARLEN = "hybridrl_varlen"  # hybridrl.models.attention.VARLEN (not imported: this module stays light)
TRAINERS = ("hybridrl", "verl")

KERNELS = {
    "choice": "use_fused_kernels=true for both (no flash-attn)",
    "why": "flash-attn has no wheel on PyPI (only the 8.5 MB sdist of 2.8.3.post2, which compiles CUDA extensions at "
           "install time, on a host without network); so each trainer's fused log-prob path, as issue 59 asks",
    "hybridrl_log_probs": "hybridrl/models/fused_logprob.py linear_log_probs (chunks of 2**26 logits, float32)",
    "verl_log_probs": "verl/workers/engine_workers.py:115 (model.use_fused_kernels -> engine config) -> "
                      "verl/workers/engine/fsdp/transformer_impl.py:323-330 apply_monkey_patch(use_fused_kernels=True, "
                      "fused_kernels_backend='torch') -> verl/models/transformers/monkey_patch.py "
                      "patch_forward_with_backends -> verl/models/transformers/dense_common.py "
                      "forward_with_torch_backend -> verl/utils/experimental/torch_functional.py FusedLinearForPPO "
                      "(impl_backend='torch') -> FusedLinearForPPOFunction (chunks of 512 tokens, float32); "
                      "transformer_impl.py prepare_model_outputs reads output.log_probs: logprobs_from_logits and "
                      "its row loop logprobs_from_logits_v2 are not called",
    "attention_remove_padding": f"{VARLEN} (torch.nn.attention.varlen) for both; verl through "
                                f"model.external_lib={VERL_ATTENTION_LIB}",
    "attention_padded": "sdpa for both",
    "verl_use_torch_compile": "verl's default (true) kept: it compiles only entropy_from_logits "
                              "(transformer_impl.py:183-187), which the fused path does not call",
}


@dataclasses.dataclass(frozen=True)
class Setting:
    key: str                     # hybridrl's key (verl's names), or the only trainer's key
    value: object
    reason: str                  # why this value (one line)
    verl_key: str | None = None  # verl's key where it differs from hybridrl's
    only: str | None = None      # "verl" or "hybridrl" when only one trainer gets the row

    def applies_to(self, trainer: str) -> bool:
        return self.only in (None, trainer)

    def key_for(self, trainer: str) -> str:
        return self.verl_key or self.key if trainer == "verl" else self.key

    def override(self, trainer: str) -> str:
        return f"{self.key_for(trainer)}={self.value}"


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the shared rows (layout, kernels, engine) follow from: this benchmark's arguments, or a recipe's own
    values (recipes/qwen25_coder_gsm_symbolic/verl_compare.py), so both comparisons with verl give the same rows."""
    prompts: int                   # prompts a step
    n: int                         # samples a prompt
    gpus: int
    prompt_length: int
    response_length: int
    max_token_len: int             # tokens per update and log-prob micro-batch (packed rows)
    gpu_memory_utilization: float  # SGLang's mem_fraction_static
    padded: bool = False           # padded rows and sdpa for both, instead of packed rows and the varlen kernel
    offload: bool = False          # AdamW state in CPU memory and activation checkpointing (7B on 80 GB)


def workload_of(args) -> Workload:
    """This benchmark's arguments as the shared rows' workload."""
    return Workload(prompts=args.prompts, n=args.n, gpus=args.gpus, prompt_length=args.prompt_length,
                    response_length=args.response_length, max_token_len=args.max_token_len,
                    gpu_memory_utilization=args.gpu_memory_utilization, padded=args.padded,
                    offload=args.shape == "7b")


def cuda_graph_size(load: Workload) -> int:
    """The decode CUDA-graph size both engines get: one step's sequences per engine, rounded up to a size SGLang
    captures (hybridrl's own rule, rollout/engine_load.py; it would pick the same number by itself)."""
    from hybridrl.workers.rollout.engine_load import captured_size

    return captured_size(math.ceil(load.prompts * load.n / load.gpus))


def settings(args, model_dir: str, run_dir: str) -> list[Setting]:
    """Every row given to a run of either trainer (run_dir: this run's directory)."""
    return [
        # the workload
        Setting("data.train_files", f"[{args.data_dir}/train.parquet]", "the workload: the built-in task, verl's "
                "parquet layout"),
        Setting("data.val_files", f"[{args.data_dir}/test.parquet]", "required by both; never read (no validation)"),
        Setting("data.train_batch_size", args.prompts, "the workload: prompts per step"),
        Setting("data.max_prompt_length", args.prompt_length, "the workload"),
        Setting("data.max_response_length", args.response_length, "the workload"),
        Setting("actor_rollout_ref.model.path", model_dir, "the workload: one directory, weights + tokenizer"),
        Setting("actor_rollout_ref.rollout.n", args.n, "the workload: GRPO group size"),
        Setting("actor_rollout_ref.actor.optim.lr", args.lr, "the workload"),
        Setting("algorithm.adv_estimator", "grpo", "the workload: GRPO"),
        Setting("algorithm.norm_adv_by_std_in_grpo", "true", "GRPO as published"),
        Setting("algorithm.use_kl_in_reward", "false", "no reference model"),
        Setting("actor_rollout_ref.actor.use_kl_loss", "false", "no reference model"),
        Setting("actor_rollout_ref.actor.entropy_coeff", 0, "no entropy bonus"),
        Setting("actor_rollout_ref.actor.loss_agg_mode", "token-mean", "the same loss in both"),
        Setting("actor_rollout_ref.actor.clip_ratio", 0.2, "the same loss in both"),
        Setting("actor_rollout_ref.actor.grad_clip", 1.0, "the same update in both"),
        Setting("actor_rollout_ref.actor.ppo_epochs", 1, "the same update in both"),
        Setting("actor_rollout_ref.actor.ppo_mini_batch_size", args.prompts // 2, "2 optimizer steps per step"),
        Setting("custom_reward_function.path", REWARD_FILE, "one scorer for both (vs_verl_reward.py)",
                verl_key="reward.custom_reward_function.path"),
        Setting("custom_reward_function.name", "compute_score", "one scorer for both",
                verl_key="reward.custom_reward_function.name"),
        *shared(workload_of(args)),
        # one timed run, no validation or checkpoints
        Setting("trainer.total_training_steps", args.steps, "warm-up step(s) + the steady steps timed"),
        Setting("trainer.val_before_train", "false", "no validation"),
        Setting("trainer.test_freq", -1, "no validation"),
        Setting("trainer.save_freq", -1, "no checkpoints"),
        Setting("trainer.default_local_dir", run_dir, "this run's directory"),
        *verl_run_log(run_dir),
        Setting("trainer.logger", "[console,jsonl]", "per-step JSON lines into trainer.default_local_dir/"
                "metrics.jsonl", only="hybridrl"),
    ]


def shared(load: Workload) -> list[Setting]:
    """The layout, kernel and engine rows: what both trainers get in every comparison with verl (this benchmark and
    the recipe's, recipes/qwen25_coder_gsm_symbolic/verl_compare.py), each value following from `load`."""
    return [*layout(load), *kernels(load), *engine(load)]


def layout(load: Workload) -> list[Setting]:
    """FSDP2 on the given GPUs, packed rows with token-budget micro-batches."""
    rmpad = str(not load.padded).lower()
    return [
        Setting("trainer.nnodes", 1, "one host"),
        Setting("trainer.n_gpus_per_node", load.gpus, "the GPUs of the lease"),
        Setting("trainer.device", "cuda", "a GPU run"),
        Setting("actor_rollout_ref.actor.strategy", "fsdp2", "FSDP2 for both (verl's default is FSDP1)"),
        Setting("actor_rollout_ref.model.use_remove_padding", rmpad, "packed rows (--padded: padded rows for both)"),
        Setting("actor_rollout_ref.actor.use_dynamic_bsz", rmpad, "token-budget micro-batches with packed rows"),
        Setting("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", load.max_token_len,
                "tokens per update micro-batch"),
        Setting("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 8, "rows per micro-batch when padded"),
        Setting("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", rmpad, "as the update"),
        Setting("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", load.max_token_len, "as the update"),
        Setting("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", 32, "rows per log-prob micro-batch "
                "when padded"),
        Setting("actor_rollout_ref.model.enable_gradient_checkpointing", str(load.offload).lower(),
                "off where memory suffices (0.5B), on at 7B; verl's default is on"),
        Setting("actor_rollout_ref.actor.fsdp_config.param_offload", "false", "parameters stay on the GPU"),
        Setting("actor_rollout_ref.actor.fsdp_config.optimizer_offload", str(load.offload).lower(),
                "7B on 80 GB: AdamW state in CPU memory while the engine generates"),
        Setting("trainer.balance_batch", "true", "rows balanced over ranks in both"),
    ]


def kernels(load: Workload) -> list[Setting]:
    """The log-prob and attention kernels (module docstring, KERNELS): the same for both."""
    attention = ([Setting("actor_rollout_ref.model.external_lib", VERL_ATTENTION_LIB, "registers hybridrl's "
                          f"varlen kernel ({VARLEN}) with transformers in verl's processes (KERNELS)", only="verl"),
                  Setting("+actor_rollout_ref.model.override_config.attn_implementation", VARLEN,
                          "verl's default flash_attention_2 needs flash-attn (no wheel); the kernel hybridrl uses "
                          "instead of sdpa's dense block mask", only="verl")]
                 if not load.padded else
                 [Setting("+actor_rollout_ref.model.override_config.attn_implementation", "sdpa",
                          "padded rows: sdpa, as hybridrl (flash_attention_2 needs flash-attn)", only="verl")])
    return [
        Setting("actor_rollout_ref.model.use_fused_kernels", "true", "the same kind of log-prob kernel in both: "
                "fused with the output layer, since flash-attn has no wheel (KERNELS)"),
        *attention,
    ]


def engine(load: Workload) -> list[Setting]:
    """The same SGLang settings for both, explicitly; where verl's SGLang server passes a value hybridrl derives,
    verl gets it as an engine argument (the verl-only rows)."""
    graphs = cuda_graph_size(load)
    sglang = "+actor_rollout_ref.rollout.engine_kwargs.sglang"
    return [
        Setting("actor_rollout_ref.rollout.name", "sglang", "SGLang 0.5.16 (.stage/slim) for both"),
        Setting("actor_rollout_ref.rollout.mode", "async", "server mode + agent loops: verl 0.9.1 has no other"),
        Setting("data.return_raw_chat", "true", "both trainers' agent loops read the raw chat"),
        Setting("actor_rollout_ref.rollout.tensor_model_parallel_size", 1, "one engine per GPU (verl's default: 2)"),
        Setting("actor_rollout_ref.rollout.gpu_memory_utilization", load.gpu_memory_utilization,
                "SGLang mem_fraction_static, the same for both"),
        Setting("actor_rollout_ref.rollout.max_num_seqs", 1024, "SGLang max_running_requests above one step's "
                f"{load.prompts * load.n} sequences (verl's default, 256, is below them)"),
        Setting("actor_rollout_ref.rollout.max_num_batched_tokens", 8192, "hybridrl's SGLang chunked_prefill_size; "
                "verl's SGLang server does not read this key (its verl-only row gives the same)"),
        Setting(f"{sglang}.chunked_prefill_size", 8192, "what hybridrl passes from max_num_batched_tokens; verl's "
                "SGLang server passes none (SGLang's H100/H200 default is the same 8192)", only="verl"),
        Setting(f"{sglang}.context_length", load.prompt_length + load.response_length + 2, "what hybridrl passes "
                "(prompt + response + 2); verl passes none, so SGLang would size requests for the model's 32k",
                only="verl"),
        Setting(f"{sglang}.cuda_graph_max_bs_decode", graphs, f"decode CUDA graphs up to one step's sequences per "
                f"engine, {graphs}, for both; verl passes none, so SGLang would capture up to 256"),
        Setting(f"{sglang}.attention_backend", "triton", "one decode attention backend for both (hybridrl's "
                "default; verl's is flashinfer, JIT-compiled on first use on the offline host)"),
        Setting(f"{sglang}.sampling_backend", "pytorch", "one sampler for both (hybridrl's default; SGLang's is "
                "flashinfer, JIT-compiled)"),
        Setting("actor_rollout_ref.rollout.enforce_eager", "false", "CUDA graphs on"),
        Setting("actor_rollout_ref.rollout.free_cache_engine", "true", "the engine's memory released while training"),
        Setting("actor_rollout_ref.rollout.load_format", "dummy", "weights come from the trainer"),
        Setting("actor_rollout_ref.rollout.calculate_log_probs", "false", "old log-probs from the actor in both"),
        Setting("actor_rollout_ref.rollout.temperature", 1.0, "sampling: the same for both"),
        Setting("actor_rollout_ref.rollout.top_p", 1.0, "sampling: the same for both"),
        Setting("actor_rollout_ref.rollout.top_k", -1, "sampling: the same for both"),
        Setting("actor_rollout_ref.rollout.update_weights_bucket_megabytes", 2048, "verl's default, given to both",
                verl_key="actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes"),
    ]


def verl_run_log(run_dir: str) -> list[Setting]:
    """verl's logger for this benchmark's runs: per-step JSON lines into the run's directory, and the run's name."""
    return [
        Setting("trainer.logger", "[console,file]", "per-step JSON lines into VERL_FILE_LOGGER_PATH", only="verl"),
        Setting("+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH", verl_metrics_path(run_dir),
                "the file logger runs in the TaskRunner actor: the path through Ray as well as the environment",
                only="verl"),
        Setting("trainer.project_name", "vs_verl", "names the run", only="verl"),
        Setting("trainer.experiment_name", os.path.basename(run_dir), "names the run", only="verl"),
    ]


def verl_metrics_path(run_dir: str) -> str:
    return os.path.join(run_dir, "verl_metrics.jsonl")


def overrides(rows: list[Setting], trainer: str) -> list[str]:
    return [row.override(trainer) for row in rows if row.applies_to(trainer)]


def default_config(trainer: str, verl_site: str):
    """The trainer's config with no overrides: hybridrl's composed config; verl's generated ppo_trainer.yaml (the
    defaults its Hydra config composes to), None where verl is not installed."""
    from omegaconf import OmegaConf

    if trainer == "hybridrl":
        from hybridrl.config import compose_config

        return compose_config([])
    path = os.path.join(verl_site, "verl", "trainer", "config", "_generated_ppo_trainer.yaml")
    return OmegaConf.load(path) if os.path.isfile(path) else None


def override_table(rows: list[Setting], trainer: str, defaults) -> list[dict]:
    """One entry a row the trainer gets: key, value, the trainer's default (None: not in its config, or unknown when
    `defaults` is None), whether the value departs from it, and the reason."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    parser = OverridesParser.create()
    table = []
    for row in rows:
        if not row.applies_to(trainer):
            continue
        key = row.key_for(trainer).lstrip("+")
        value = parser.parse_override(f"{key}={row.value}").value()
        default = None if defaults is None else OmegaConf.select(defaults, key, default=None)
        if default is not None and OmegaConf.is_config(default):
            default = OmegaConf.to_container(default, resolve=True)
        table.append({"key": row.key_for(trainer), "value": value, "default": default,
                      "departs": None if defaults is None else value != default, "reason": row.reason})
    return table
