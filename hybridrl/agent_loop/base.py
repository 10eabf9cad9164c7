"""What an agent loop is: the base class, its output record and the registry of named loops.

Shaped like verl's `verl.experimental.agent_loop` so a verl agent loop ports by changing imports only:

    from hybridrl.agent_loop import AgentLoopBase, AgentLoopOutput, register

    @register("my_agent")
    class MyAgentLoop(AgentLoopBase):
        async def run(self, sampling_params, **kwargs) -> AgentLoopOutput:
            prompt_ids = await self.apply_chat_template(kwargs["raw_prompt"])
            output = await self.server_manager.generate(request_id=..., prompt_ids=prompt_ids,
                                                        sampling_params=sampling_params)
            ...  # output.token_ids, output.log_probs

One instance runs one sample: `run` gets the rollout's sampling parameters and every column of the
sample's dataset row as keyword arguments (raw_prompt, extra_info, tools_kwargs, interaction_kwargs,
reward_model, data_source, ...). It returns token lists, never padded tensors: padding happens once, when
the manager turns all outputs into the batch (data/batch_layout.py).

What a loop finds on self (verl's attributes): config (the run config as verl hands it: verl_config.py),
rollout_config (its actor_rollout_ref.rollout), server_manager, tokenizer, processor (None: models here are
text-only), dataset_cls and data_config (the run's dataset class and `data` config), apply_chat_template_kwargs
(data.apply_chat_template_kwargs), system_prompt (the ids the chat template puts before the first message:
a default system prompt, or nothing), turn_separator (the ids it puts after a turn's EOS), verl 0.9's Continuous
Token methods ct_* (continuous_token.py) and loop (the event loop). The worker's tools come to __init__ as the
keyword argument `tools` (a ToolListWrap), as verl hands them since 0.8.

A loop that can continue a conversation an abort interrupted (data_flow.partial_rollout) says so with the class
attribute `can_resume = True` and follows AgentLoopBase.can_resume's contract; loops that do not (verl's own, and
users' loops by default) have their aborted samples generated again, and partial rollout is refused for them.

Loops are found by name: `@register("name")` in code, or a YAML list named by
`actor_rollout_ref.rollout.agent.agent_loop_config_path`

    - name: my_agent
      _target_: my_package.my_module.MyAgentLoop     # any other keys go to __init__ as keyword arguments
"""
from __future__ import annotations

import asyncio
import functools
import importlib
import os
from abc import ABC, abstractmethod
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ConfigDict

from hybridrl.agent_loop.chat_render import render_ids, system_prompt_ids, turn_separator_ids
from hybridrl.agent_loop.continuous_token import ContinuousTokenBuilder, MergeResult
from hybridrl.agent_loop.verl_config import verl_config
from hybridrl.data.rl_dataset import get_dataset_class

# name -> {"_target_": "module.Class", **init kwargs}; filled by @register and by the YAML file.
_agent_loop_registry: dict[str, dict[str, Any]] = {}

BUILTIN_AGENT_LOOP_MODULES = ("hybridrl.agent_loop.single_turn", "hybridrl.agent_loop.tool_agent")


class DictConfigWrap:
    """How a config travels to an agent loop's __init__ (verl's wrapper): `.config` is the config as verl hands it,
    i.e. with verl's keys that hybridrl keeps elsewhere (verl_config.py)."""

    def __init__(self, config) -> None:
        self.config = verl_config(config)


class ToolListWrap:
    """How the worker's tools travel to an agent loop's __init__ (verl's wrapper, keyword `tools`): `.tools` is the
    list built once per worker from multi_turn.tool_config_path."""

    def __init__(self, tools: list) -> None:
        self.tools = tools


class TokenOutput(BaseModel):
    """What the server manager's `generate` returns (verl's TokenOutput): the generated ids, stop token included,
    and their log-probs under the sampling distribution (None unless sampling_params["logprobs"])."""
    token_ids: list[int]
    log_probs: Optional[list[float]] = None
    routed_experts: Optional[Any] = None
    stop_reason: Optional[str] = None  # "completed" (EOS), "length" (max_tokens) or "aborted"
    num_preempted: Optional[int] = None
    weight_version: Optional[int] = None  # the policy version that generated these tokens (async_server.py)
    extra_fields: dict[str, Any] = {}  # verl's engines report extras here; hybridrl's servers report none


class AgentLoopMetrics(BaseModel):
    """Seconds a loop spent waiting for the engine, its tools and its scoring, and the engine's preemptions of its
    requests (-1: unknown) under verl's names; the tool loop's counts (tool_agent.py; 0 for loops without tools).
    A loop may add numeric fields of its own (verl allows them): each becomes a metric agent_loop/<name>/mean."""
    model_config = ConfigDict(extra="allow")

    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    compute_score: float = 0.0
    num_preempted: int = -1
    num_tool_calls: int = 0           # calls the model made, malformed ones included
    num_tool_errors: int = 0          # calls answered with an error: malformed, unknown tool, raised, timed out
    tool_latency_s: float = 0.0       # summed over the sample's executed calls
    tokenization_mismatch: int = 0    # 1: incremental ids != the re-tokenised conversation
    response_cut: int = 0             # 1: the conversation stopped on rollout.response_length


class AgentLoopOutput(BaseModel):
    """One sample's trajectory as token lists.

    response_ids holds everything after the prompt: the model's tokens and whatever the loop inserted
    (tool output, observations); response_mask is 1 on the model's tokens (trained on) and 0 on the
    inserted ones. reward_score, when set, is the sample's score and replaces the reward manager's.
    routed_experts (an MoE engine's routing of every token) becomes the batch column of that name.
    multi_modal_data, mm_processor_kwargs and mm_processor_output must stay empty: the models here are text-only
    (manager.check_output refuses others).
    """
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: Optional[list[float]] = None
    routed_experts: Optional[Any] = None
    multi_modal_data: Optional[dict[str, Any]] = None
    reward_score: Optional[float] = None
    num_turns: int = 0
    metrics: AgentLoopMetrics = AgentLoopMetrics()
    extra_fields: dict[str, Any] = {}
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    mm_processor_output: Optional[list[dict[str, Any]]] = None
    resume_state: Optional[dict[str, Any]] = None  # a resumable loop's state when an abort interrupted it


class AgentLoopBase(ABC):
    """Runs one sample against the engine servers; one instance per sample (verl's AgentLoopBase)."""

    _class_initialized = False

    can_resume = False
    """Whether `run` can continue a conversation an abort interrupted (data_flow.partial_rollout=true). A loop that
    sets it True promises: when a generate call is answered with stop_reason "aborted" it returns at once, with the
    tokens it has and, in AgentLoopOutput.resume_state, what it needs to go on (plain Python values only: the sample
    is saved in checkpoints); the next time, `run` gets the same row plus `resume_from`, that AgentLoopOutput as it
    was returned, and returns the whole conversation, its response starting with resume_from's (those tokens keep the
    weight versions that generated them). False (the default, verl's loops): an aborted sample is generated again
    from its prompt, and partial rollout is refused for the loop."""

    def __init__(self, trainer_config: DictConfigWrap, server_manager, tokenizer, processor=None,
                 dataset_cls: Optional[type] = None, data_config: Optional[DictConfigWrap] = None, **kwargs):
        """trainer_config.config: the run config (self.config); server_manager: `generate` on the engines;
        dataset_cls / data_config: the run's dataset class and `data` config (default: the run config's);
        kwargs: the loop's YAML entry besides name/_target_, also handed to init_class once per class."""
        self.init_class(config=trainer_config.config, tokenizer=tokenizer, processor=processor, **kwargs)
        self.config = trainer_config.config
        self.rollout_config = self.config.actor_rollout_ref.rollout
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.data_config = self.config.data if data_config is None else data_config.config
        self.dataset_config = self.data_config  # the name verl's AgentLoopBase gave it before data_config
        self.dataset_cls = get_dataset_class(self.data_config) if dataset_cls is None else dataset_cls
        self.apply_chat_template_kwargs = dict(self.data_config.get("apply_chat_template_kwargs") or {})
        self.mm_processor_kwargs: dict[str, Any] = {}  # text-only models: no processor to hand arguments to
        # verl 0.9.0's switch between its two tokenizations (data.continuous_token.enable, off by default there):
        # off, the loops append template renderings (apply_chat_template + turn_separator); the ct_* methods below
        # are the other one, which verl 0.9.1's loops always use
        self.enable_continuous_token = False
        self.continuous_token_builder = ContinuousTokenBuilder(tokenizer, self.apply_chat_template_kwargs)
        self.loop = asyncio.get_running_loop()

    @functools.cached_property
    def system_prompt(self) -> list[int]:
        """The ids the chat template puts before the first message (computed on first use: a loop that never
        removes it never renders it, and a template that cannot render two user turns in a row fails only there)."""
        return system_prompt_ids(self.tokenizer, self.apply_chat_template_kwargs)

    @functools.cached_property
    def turn_separator(self) -> list[int]:
        """The ids the chat template puts after a turn's EOS (verl's name; e.g. a newline): a loop that appends a
        rendered message after the model's turn puts these first."""
        return turn_separator_ids(self.tokenizer, self.apply_chat_template_kwargs)

    @classmethod
    def init_class(cls, config, tokenizer, processor=None, **kwargs) -> None:
        """Heavy set-up shared by every instance of a class (tools, clients), run once per process."""
        if cls._class_initialized:
            return
        cls._class_initialized = True

    async def process_vision_info(self, messages: list[dict]) -> dict[str, Any]:
        """The images and videos of `messages` (verl's name before 0.8): see process_multi_modal_info."""
        return await self.process_multi_modal_info(messages)

    async def process_multi_modal_info(self, messages: list[dict]) -> dict[str, Any]:
        """The images, videos and audios of `messages` (verl's name): {} here, where models are text-only (no
        processor)."""
        return {}

    def _get_mm_processor_kwargs(self, audio_data: Optional[list[Any]] = None) -> dict[str, Any]:
        """The processor arguments for this sample (verl's): {} for text-only models; audio is refused."""
        _refuse_media("_get_mm_processor_kwargs", audio_data=audio_data)
        return {}

    def _assert_mm_supported(self, has_multi_modal: bool) -> None:
        """verl's guard before multi-modal inputs reach the tokenizer: refused, the models here are text-only."""
        if has_multi_modal:
            raise ValueError("multi-modal inputs given, but the model here is text-only (no processor); "
                             "multi-modal rollouts are not supported")

    @staticmethod
    def build_sglang_video_payload(videos, mm_inputs: dict[str, Any]) -> None:
        """verl's processed-video payload for SGLang: None, as verl gives it without videos (text-only models)."""
        _refuse_media("build_sglang_video_payload", videos=videos or None)
        return None

    async def apply_chat_template(self, messages: list[dict], tools: Optional[list[dict]] = None,
                                  images: Optional[list[Any]] = None, videos: Optional[list[Any]] = None,
                                  remove_system_prompt: bool = False, audios: Optional[list[Any]] = None,
                                  mm_processor_kwargs: Optional[dict[str, Any]] = None, **kwargs) -> list[int]:
        """Token ids of `messages` with the generation prompt appended (tokenized off the event loop), rendered
        with data.apply_chat_template_kwargs and `kwargs`. remove_system_prompt drops the leading
        self.system_prompt ids, so that a turn appended to a conversation does not repeat a template's default
        system prompt. images/videos/audios: only None or empty, mm_processor_kwargs only empty (text-only models)."""
        _refuse_media("apply_chat_template", images=images or None, videos=videos, audios=audios,
                      mm_processor_kwargs=mm_processor_kwargs or None)
        template_kwargs = {**self.apply_chat_template_kwargs, **kwargs}

        def tokenize() -> list[int]:
            return render_ids(self.tokenizer, list(messages), tools=tools, add_generation_prompt=True,
                              **template_kwargs)
        prompt_ids = await self.loop.run_in_executor(None, tokenize)
        return prompt_ids[len(self.system_prompt):] if remove_system_prompt else prompt_ids

    # ---- verl's Continuous Token tokenization (continuous_token.py), under verl's method names

    async def ct_build_initial_tokens(self, messages: list[dict], tools: Optional[list[dict]] = None,
                                      images=None, videos=None, audios=None,
                                      mm_inputs_out: Optional[dict] = None) -> list[int]:
        """The first prompt's ids (the template with the generation prompt); media refused (text-only models)."""
        _refuse_media("ct_build_initial_tokens", images=images or None, videos=videos or None, audios=audios or None)
        return await self.loop.run_in_executor(
            None, lambda: self.continuous_token_builder.build_initial_tokens(messages, tools=tools))

    async def ct_merge_assistant_token(self, runtime_token_ids: list[int], assistant_token_ids: list[int],
                                       response_mask: list[int], response_logprobs: Optional[list[float]] = None,
                                       assistant_logprobs: Optional[list[float]] = None
                                       ) -> tuple[MergeResult, list[int], Optional[list[float]]]:
        """The model's ids appended: (the merge, the response mask and log-probs extended with 1s and its log-probs)."""
        merge = self.continuous_token_builder.merge_assistant_tokens(runtime_token_ids, assistant_token_ids)
        return (merge, *self.continuous_token_builder.align_response_metadata(
            merge, response_mask, response_logprobs, assistant_logprobs=assistant_logprobs))

    async def ct_merge_context_msg(self, previous_messages: list[dict], updated_messages: list[dict],
                                   runtime_token_ids: list[int], response_mask: list[int],
                                   response_logprobs: Optional[list[float]] = None,
                                   tools: Optional[list[dict]] = None
                                   ) -> tuple[MergeResult, list[int], Optional[list[float]]]:
        """The appended tool / user messages' template ids appended: (the merge, the response mask and log-probs
        extended with 0s)."""
        merge = await self.loop.run_in_executor(None, lambda: self.continuous_token_builder.merge_context_tokens(
            previous_messages, updated_messages, runtime_token_ids, tools=tools))
        return (merge, *self.continuous_token_builder.align_response_metadata(merge, response_mask,
                                                                                response_logprobs))

    ct_merge_non_assistant_msg = ct_merge_context_msg  # verl 0.9.0's name for it

    @abstractmethod
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        """One sample's trajectory. kwargs: the sample's dataset columns (raw_prompt, extra_info, ...)."""


def _refuse_media(where: str, **given: Any) -> None:
    """Multi-modal arguments (any not None) are refused: the models here are text-only."""
    named = sorted(name for name, value in given.items() if value is not None)
    if named:
        raise ValueError(f"{where}: {', '.join(named)} given, but the model here is text-only (no processor); "
                         f"multi-modal rollouts are not supported")


def register(agent_name: str):
    """Class decorator: make the loop selectable by `agent_name` (dataset column) or `default_agent_loop`."""
    def decorator(subclass: type) -> type:
        _agent_loop_registry[agent_name] = {"_target_": f"{subclass.__module__}.{subclass.__qualname__}"}
        return subclass
    return decorator


def load_agent_loop_config(path: Optional[str]) -> dict[str, dict[str, Any]]:
    """The registry after importing the built-in loops and the YAML at `path` (None: built-ins only).

    Each YAML entry needs `name` and `_target_` (module.Class, importable, a subclass of AgentLoopBase);
    errors name the file and the entry."""
    for module in BUILTIN_AGENT_LOOP_MODULES:
        importlib.import_module(module)
    for position, entry in enumerate(read_agent_loop_entries(path)):
        resolve_target(entry["_target_"], f"{path} entry {position} ({entry['name']!r})")
        _agent_loop_registry[entry["name"]] = {key: value for key, value in entry.items() if key != "name"}
    return dict(_agent_loop_registry)


def yaml_agent_loop_names(path: Optional[str]) -> list[str]:
    """The names the agent-loop YAML at `path` registers, in file order ([] for None)."""
    return [entry["name"] for entry in read_agent_loop_entries(path)]


def read_agent_loop_entries(path: Optional[str]) -> list[dict[str, Any]]:
    """The entries of the agent-loop YAML, each checked to be a mapping with string name and _target_."""
    if path is None:
        return []
    where = "actor_rollout_ref.rollout.agent.agent_loop_config_path"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{where}={path!r}: no such file")
    with open(path) as f:
        entries = yaml.safe_load(f)
    if not isinstance(entries, list):
        raise ValueError(f"{where}={path!r}: expected a YAML list of {{name, _target_}} entries, got {entries!r}")
    for position, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or \
                not isinstance(entry.get("_target_"), str):
            raise ValueError(f"{path} entry {position}: expected a mapping with string keys name and _target_, "
                             f"got {entry!r}")
    return entries


def resolve_target(target: str, where: str) -> type:
    """The AgentLoopBase subclass `module.Class` names; `where` says in errors which entry named it."""
    module_name, _, class_name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ImportError(f"{where}: cannot import _target_ {target!r}: {err}") from err
    if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
        raise TypeError(f"{where}: _target_ {target!r} must be a subclass of hybridrl.agent_loop.AgentLoopBase, "
                        f"got {cls!r}")
    return cls


def loop_can_resume(name: str, registry: dict[str, dict[str, Any]]) -> bool:
    """Whether the loop registered as `name` declares can_resume (KeyError when no loop is registered so)."""
    if name not in registry:
        raise KeyError(f"agent loop {name!r} is not registered; known: {sorted(registry)}")
    return bool(getattr(resolve_target(registry[name]["_target_"], f"agent loop {name!r}"), "can_resume", False))


def instantiate_agent_loop(name: str, registry: dict[str, dict[str, Any]], **init_kwargs) -> AgentLoopBase:
    """A new loop instance for one sample (the registry entry's extra keys become keyword arguments)."""
    if name not in registry:
        raise KeyError(f"agent loop {name!r} is not registered; known: {sorted(registry)}")
    entry = dict(registry[name])
    cls = resolve_target(entry.pop("_target_"), f"agent loop {name!r}")
    return cls(**init_kwargs, **entry)
