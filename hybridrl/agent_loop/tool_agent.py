"""`tool_agent`: multi-turn rollouts where the model calls tools (verl's ToolAgentLoop behaviour).

One sample, one conversation:

    prompt = chat template(raw_prompt, tools=<schemas of multi_turn.tool_config_path>)
    loop:  generate (max_tokens = what is left of rollout.response_length)        -> response_mask 1
           stop if the turn hit the budget, or a turn cap is reached
           tool calls: run the first multi_turn.max_parallel_calls concurrently (run_tool_call never raises),
                       append the tool messages' tokens (template delta)         -> response_mask 0, log-prob 0
           no tool call, with an interaction (multi_turn.interaction_config_path): stop when it says the
                       conversation is over, else append its reply as a user message (template delta)
                                                                                  -> response_mask 0, log-prob 0
           no tool call, no interaction: stop
           stop (without appending) if the inserted message does not fit the budget

Termination (verl's order): the model's turn stopped on the token budget ("length"); max_assistant_turns assistant
turns were generated; max_user_turns tool or interaction turns were appended; the turn holds no tool call and
there is no interaction (or it ended the conversation); the inserted message would not fit in
rollout.response_length. The response therefore always ends with the model's tokens.

Tokens are appended incrementally: a tool message's tokens are the template's rendering of
[dummy assistant turn + tool messages] with the dummy's part (up to and including its end-of-turn token)
stripped, as verl does. At the end, the whole conversation is rendered again and tokenized; a difference is
counted in metrics.tokenization_mismatch, and multi_turn.tokenization_sanity_check_mode decides what it does:
strict — the sample is kept out of training (response_mask all 0, reward_score 0, as a failed loop);
ignore_strippable — accepted when the two texts differ in whitespace only (else as strict); disable — not
checked (never counted).

Tool calls the parser cannot read (malformed JSON, no name) and calls of unknown tools are answered with a
tool message "Error: ..." (the model sees why) and counted in metrics.num_tool_errors, like a tool that raises
or times out. Tools are created once per sample on first use (create_kwargs from extra_info.tools_kwargs),
then calc_reward and release at the end (of each run: see "Partial rollout"). Their arguments come from the row's
`tools_kwargs` column, which the dataset lifts from extra_info.tools_kwargs as verl's does.

Partial rollout (data_flow.partial_rollout, `can_resume`): an abort reaches only the engine's generate requests,
never a tool call: a call under way when the data flow aborts the engines runs to its end, its tokens are appended,
and the next turn's request is answered aborted at once, with no tokens. When a generate request is answered
aborted, the loop returns at once with the response so far (the tokens the engine generated before the abort
included; nothing is parsed from an unfinished turn) and, in resume_state, the messages up to that turn, where the
turn starts, the request id and the counts and rewards so far. Continued (`resume_from`), it generates the rest of
that turn from prompt + response with what is left of rollout.response_length (a turn cut before its first token
is simply started), parses the tool calls of the whole turn (before and after the abort), runs them and goes on
as if never interrupted: the turn counts once toward the turn caps, the budget is the conversation's.

Tool and interaction state across a resume: every run releases the tool instances it created and finalizes its
interaction when it returns, interrupted or not, so nothing outlives a run (the code interpreter keeps nothing
between calls anyway); a tool's calc_reward is read just before its instance is released (its value in
`reward_scores` is the last one read). The continuation creates the instances it needs again and starts the
interaction again with the same request id and interaction_kwargs: a stateful tool or interaction loses its state
across a resume (the sample's tool_rewards, turn_scores and counts are kept).

Interactions (verl's): the row's `interaction_kwargs` name the interaction ("name"; optional when only one is
configured) and are the arguments of its start_interaction and generate_response; each reply's score is kept in
order in the extra field `turn_scores` (extra_info["turn_scores"] for the scorer).

Rewards (verl's behaviour): the reward manager's score stays the sample's score (reward_score is None); the
tools' rewards travel as extra fields, i.e. non-tensor batch columns: `tool_rewards` (each call's step reward,
in order) and `reward_scores` ({tool name: calc_reward}). The reward manager hands them to the scorer in
extra_info as verl does (`tool_rewards`, `rollout_reward_scores`, `turn_scores`, with `num_turns`): a custom reward
function adds them to the score.
"""
from __future__ import annotations

import asyncio
import copy
import time
from typing import Any, Optional
from uuid import uuid4

from hybridrl.agent_loop.base import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
from hybridrl.agent_loop.chat_render import template_delta_ids
from hybridrl.agent_loop.tool_parser import ParsedToolCall, get_tool_parser
from hybridrl.interactions import BaseInteraction, initialize_interactions_from_config
from hybridrl.tools import (BaseTool, check_tools_kwargs, initialize_tools_from_config, run_tool_call,
                            tool_phase_kwargs, truncate_text)

DEFAULT_TOOL_TIMEOUT_S = 60.0  # a tool's YAML config may set timeout_s


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):

    @classmethod
    def init_class(cls, config, tokenizer, processor=None, **kwargs) -> None:
        if cls._class_initialized:
            return
        rollout = config.actor_rollout_ref.rollout
        multi_turn = rollout.multi_turn
        if not multi_turn.enable:
            raise ValueError("agent loop 'tool_agent' needs actor_rollout_ref.rollout.multi_turn.enable=true")
        cls.multi_turn = multi_turn
        cls.response_length = rollout.response_length
        cls.parse_tool_calls = staticmethod(get_tool_parser(multi_turn.format))
        tools = initialize_tools_from_config(multi_turn.tool_config_path) if multi_turn.tool_config_path else []
        cls.tools: dict[str, BaseTool] = {tool.name: tool for tool in tools}
        cls.tool_schemas = [tool.get_openai_tool_schema().model_dump(exclude_unset=True, exclude_none=True)
                            for tool in tools]
        cls.interactions: dict[str, BaseInteraction] = initialize_interactions_from_config(
            multi_turn.interaction_config_path) if multi_turn.interaction_config_path else {}
        cls._class_initialized = True

    can_resume = True  # an aborted conversation continues where it stopped (module docstring, "Partial rollout")

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        tools_kwargs = kwargs.get("tools_kwargs")
        check_tools_kwargs(tools_kwargs, self.tools)
        resume_from: Optional[AgentLoopOutput] = kwargs.get("resume_from")
        if resume_from is None:
            messages = [dict(message) for message in kwargs["raw_prompt"]]
            conversation = _Conversation(await self.apply_chat_template(messages, tools=self.tool_schemas or None))
            stats, request_id, turn_start = _Stats(), uuid4().hex, 0
        else:
            messages, conversation, stats, request_id, turn_start = _resumed(resume_from)
        instances: dict[str, str] = {}  # tool name -> this sample's instance id (this run's: see the docstring)
        user = await self._start_interaction(kwargs.get("interaction_kwargs") or {}, request_id)
        try:
            interrupted_turn = await self._converse(messages, conversation, instances, tools_kwargs, sampling_params,
                                                    request_id, stats, user, turn_start)
            for name, instance_id in instances.items():
                stats.reward_scores[name] = await self.tools[name].calc_reward(
                    instance_id, **tool_phase_kwargs(tools_kwargs, name, "calc_reward"))
        finally:
            for name, instance_id in instances.items():
                await self.tools[name].release(instance_id, **tool_phase_kwargs(tools_kwargs, name, "release"))
            if user is not None:
                await user.interaction.finalize_interaction(request_id)
        if interrupted_turn is not None:
            return self._interrupted_output(messages, conversation, stats, request_id, interrupted_turn)
        return await self._output(messages, conversation, stats)

    async def _start_interaction(self, interaction_kwargs: dict, request_id: str) -> Optional["_User"]:
        """The sample's interaction, started (None when none is configured)."""
        if not self.interactions:
            return None
        name = interaction_kwargs.get("name")
        if name is None and len(self.interactions) == 1:
            name = next(iter(self.interactions))
        if name not in self.interactions:
            raise ValueError(f"interaction_kwargs (extra_info.interaction_kwargs) name {name!r}: expected one of the "
                             f"configured interactions {sorted(self.interactions)}")
        interaction = self.interactions[name]
        await interaction.start_interaction(request_id, **interaction_kwargs)
        return _User(interaction, interaction_kwargs)

    async def _converse(self, messages, conversation, instances, tools_kwargs, sampling_params, request_id,
                        stats, user: Optional["_User"], turn_start: int) -> Optional[int]:
        """The conversation from the assistant turn that starts at response position `turn_start` (its tokens
        before an abort, if any, already in `conversation`) to its end. Returns None when it ended, or where the
        assistant turn an abort interrupted starts (a turn the abort cut before its first token starts at the end)."""
        while True:
            turn = await self._assistant_turn(conversation, sampling_params, request_id, stats, turn_start)
            if turn is None:
                return turn_start
            turn_ids, stop_reason = turn
            stats.assistant_turns += 1
            text = self._model_text(turn_ids)
            _, calls = self.parse_tool_calls(text)
            messages.append({"role": "assistant", "content": text})
            ended_turn = bool(turn_ids) and turn_ids[-1] in self._eos_ids()
            out_of_budget = len(conversation.response_ids) >= self.response_length
            if stop_reason == "length" or (out_of_budget and not ended_turn):
                stats.response_cut = 1  # the model was cut mid-turn
                return None
            if out_of_budget:
                return None  # the turn ended exactly at the budget: no room for a tool answer
            if not calls and user is None:
                return None
            if self.multi_turn.max_assistant_turns and stats.assistant_turns >= self.multi_turn.max_assistant_turns:
                return None
            if self.multi_turn.max_user_turns and stats.user_turns >= self.multi_turn.max_user_turns:
                return None
            if calls:
                inserted = await self._run_calls(calls[:self.multi_turn.max_parallel_calls], instances, tools_kwargs,
                                                 stats)
            else:
                inserted, conversation_over = await user.reply(request_id, messages, stats)
                if conversation_over:  # its last reply is not appended: the response ends on the model's turn
                    return None
            inserted_ids = await self._inserted_message_ids(inserted)
            if len(conversation.response_ids) + len(inserted_ids) >= self.response_length:
                stats.response_cut = 1
                return None
            messages.extend(inserted)
            conversation.add_inserted_tokens(inserted_ids)
            stats.user_turns += 1
            turn_start = len(conversation.response_ids)

    async def _assistant_turn(self, conversation, sampling_params, request_id, stats,
                              turn_start: int) -> Optional[tuple[list[int], Optional[str]]]:
        """Generate (the rest of) the assistant turn that starts at `turn_start`, with what is left of the budget:
        (the whole turn's ids, the engine's stop_reason), or None when the engine answered aborted (the tokens it
        generated before the abort are kept in `conversation`)."""
        budget = self.response_length - len(conversation.response_ids)
        started = time.perf_counter()
        output = await self.server_manager.generate(request_id=request_id, prompt_ids=conversation.all_ids(),
                                                    sampling_params={**sampling_params, "max_tokens": budget})
        stats.generate_s += time.perf_counter() - started
        conversation.add_model_tokens(output.token_ids, output.log_probs)
        if output.stop_reason == "aborted":
            return None
        return conversation.response_ids[turn_start:], output.stop_reason

    def _model_text(self, token_ids: list[int]) -> str:
        """The turn's text as the assistant message's content: its end-of-turn (EOS) token left to the template."""
        if token_ids and token_ids[-1] in self._eos_ids():
            token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def _eos_ids(self) -> set[int]:
        eos = self.tokenizer.eos_token_id
        return set(eos) if isinstance(eos, list) else {eos}

    async def _run_calls(self, calls: list[ParsedToolCall], instances, tools_kwargs, stats) -> list[dict]:
        started = time.perf_counter()
        for name in dict.fromkeys(call.name for call in calls if call.error is None and call.name in self.tools):
            if name not in instances:  # before the concurrent calls, so that two calls of a tool share one instance
                instances[name], _ = await self.tools[name].create(
                    create_kwargs=tool_phase_kwargs(tools_kwargs, name, "create"))
        results = await asyncio.gather(*(self._run_call(call, instances, tools_kwargs, stats) for call in calls))
        stats.tool_s += time.perf_counter() - started
        side = self.multi_turn.tool_response_truncate_side
        return [{"role": "tool", "content": truncate_text(text, self.multi_turn.max_tool_response_length, side)}
                for text in results]

    async def _run_call(self, call: ParsedToolCall, instances, tools_kwargs, stats) -> str:
        """The tool message's text; never raises (a bad call's error is the text)."""
        stats.num_tool_calls += 1
        if call.error is not None or call.name not in self.tools:
            stats.num_tool_errors += 1
            return "Error: " + (call.error or f"no tool named {call.name!r}; the tools are {sorted(self.tools)}")
        tool = self.tools[call.name]
        result = await run_tool_call(tool, instances[call.name], call.arguments,
                                     timeout_s=tool.config.get("timeout_s", DEFAULT_TOOL_TIMEOUT_S),
                                     **tool_phase_kwargs(tools_kwargs, call.name, "execute"))
        stats.tool_latency_s += result.metrics["tool_latency_s"]
        stats.num_tool_errors += int(result.error is not None)
        stats.tool_rewards.append(result.reward)
        return result.response.text or ""

    async def _inserted_message_ids(self, inserted: list[dict]) -> list[int]:
        """The template's tokens for the inserted (tool or user) messages and the next generation prompt (verl's
        delta)."""
        return await self.loop.run_in_executor(None, lambda: template_delta_ids(
            self.tokenizer, inserted, tools=self.tool_schemas or None, **self.apply_chat_template_kwargs))

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tool_schemas or None, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **self.apply_chat_template_kwargs)

    async def _output(self, messages, conversation, stats) -> AgentLoopOutput:
        """The finished conversation, its tokenization checked (multi_turn.tokenization_sanity_check_mode)."""
        mismatch, accepted = await self.loop.run_in_executor(None, self._check_tokenization, messages, conversation)
        response_ids = conversation.response_ids[:self.response_length]
        response_mask = conversation.response_mask[:self.response_length]
        logprobs = None if conversation.response_logprobs is None else \
            conversation.response_logprobs[:self.response_length]
        reward_score = None
        if not accepted:
            response_mask, reward_score = [0] * len(response_ids), 0.0  # kept out of training, as a failed loop
        return AgentLoopOutput(
            prompt_ids=conversation.prompt_ids, response_ids=response_ids, response_mask=response_mask,
            response_logprobs=logprobs, reward_score=reward_score, num_turns=stats.num_turns(),
            metrics=stats.metrics(tokenization_mismatch=int(mismatch)), extra_fields=stats.extra_fields())

    def _interrupted_output(self, messages, conversation, stats, request_id: str, turn_start: int) -> AgentLoopOutput:
        """The conversation an abort interrupted, as far as it got, with what `_resumed` continues it from (its
        tokenization is checked once, when the whole conversation is done)."""
        state = {"messages": messages, "turn_start": turn_start, "request_id": request_id, "stats": vars(stats)}
        return AgentLoopOutput(
            prompt_ids=conversation.prompt_ids, response_ids=conversation.response_ids,
            response_mask=conversation.response_mask, response_logprobs=conversation.response_logprobs,
            num_turns=stats.num_turns(), metrics=stats.metrics(tokenization_mismatch=0),
            extra_fields=stats.extra_fields(), resume_state=copy.deepcopy(state))

    def _check_tokenization(self, messages: list[dict], conversation: "_Conversation") -> tuple[bool, bool]:
        """(mismatch, accepted): whether the incrementally built ids differ from the whole conversation's
        tokenization, and whether multi_turn.tokenization_sanity_check_mode lets the sample train anyway."""
        mode = self.multi_turn.tokenization_sanity_check_mode
        if mode == "disable":
            return False, True
        rendered = self._render(messages, add_generation_prompt=False)
        last_content = messages[-1]["content"]
        end = rendered.rfind(last_content) + len(last_content)  # the model's last turn ends here, or after its EOS
        if conversation.response_ids and conversation.response_ids[-1] in self._eos_ids():
            end += len(self.tokenizer.eos_token)
        reference_text = rendered[:end]
        ours = conversation.all_ids()
        if self.tokenizer(reference_text, add_special_tokens=False)["input_ids"] == ours:
            return False, True
        if mode == "ignore_strippable":
            ours_text = self.tokenizer.decode(ours, skip_special_tokens=False)
            return True, "".join(ours_text.split()) == "".join(reference_text.split())
        return True, False

class _Conversation:
    """The token lists of one sample, grown turn by turn."""

    def __init__(self, prompt_ids: list[int]):
        self.prompt_ids = list(prompt_ids)
        self.response_ids: list[int] = []
        self.response_mask: list[int] = []
        self.response_logprobs: Optional[list[float]] = []

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_model_tokens(self, token_ids: list[int], log_probs: Optional[list[float]]) -> None:
        self.response_ids += token_ids
        self.response_mask += [1] * len(token_ids)
        if log_probs is None or self.response_logprobs is None:
            self.response_logprobs = None  # the engine gives none: the output has none
        else:
            self.response_logprobs += list(log_probs)

    def add_inserted_tokens(self, token_ids: list[int]) -> None:
        self.response_ids += token_ids
        self.response_mask += [0] * len(token_ids)
        if self.response_logprobs is not None:
            self.response_logprobs += [0.0] * len(token_ids)


class _Stats:
    """What one conversation counted and collected, across its resumes (plain values: they travel in resume_state)."""

    def __init__(self, **saved):
        self.assistant_turns = self.user_turns = 0  # finished turns: an interrupted one counts once, when it ends
        self.num_tool_calls = self.num_tool_errors = self.response_cut = 0
        self.generate_s = self.tool_s = self.tool_latency_s = 0.0
        self.tool_rewards: list[float] = []
        self.turn_scores: list[float] = []  # one per interaction reply
        self.reward_scores: dict[str, float] = {}  # tool name -> calc_reward when its last instance was released
        vars(self).update(copy.deepcopy(saved))

    def num_turns(self) -> int:
        """verl's count: the prompt, the assistant turns and the tool or interaction turns."""
        return self.assistant_turns + self.user_turns + 1

    def metrics(self, tokenization_mismatch: int) -> AgentLoopMetrics:
        return AgentLoopMetrics(
            generate_sequences=self.generate_s, tool_calls=self.tool_s, num_tool_calls=self.num_tool_calls,
            num_tool_errors=self.num_tool_errors, tool_latency_s=self.tool_latency_s,
            tokenization_mismatch=tokenization_mismatch, response_cut=self.response_cut)

    def extra_fields(self) -> dict[str, Any]:
        return {"tool_rewards": list(self.tool_rewards), "reward_scores": dict(self.reward_scores),
                "turn_scores": list(self.turn_scores)}


def _resumed(resume_from: AgentLoopOutput) -> tuple[list[dict], _Conversation, _Stats, str, int]:
    """(messages, conversation, stats, request_id, turn_start) of an interrupted conversation, as
    ToolAgentLoop._interrupted_output saved them; a resume_from that is not one names what is missing."""
    state = resume_from.resume_state
    missing = sorted({"messages", "turn_start", "request_id", "stats"} - set(state or {}))
    if missing:
        raise ValueError(f"tool_agent: resume_from.resume_state: expected the state of an interrupted tool_agent "
                         f"conversation, missing {missing}")
    conversation = _Conversation(resume_from.prompt_ids)
    conversation.response_ids = list(resume_from.response_ids)
    conversation.response_mask = list(resume_from.response_mask)
    conversation.response_logprobs = None if resume_from.response_logprobs is None else \
        list(resume_from.response_logprobs)
    messages = copy.deepcopy(state["messages"])
    return messages, conversation, _Stats(**state["stats"]), state["request_id"], int(state["turn_start"])


class _User:
    """The sample's interaction with its start arguments: the simulated user who answers a turn without tool calls."""

    def __init__(self, interaction: BaseInteraction, interaction_kwargs: dict):
        self.interaction = interaction
        self.interaction_kwargs = interaction_kwargs

    async def reply(self, request_id: str, messages: list[dict], stats: _Stats) -> tuple[list[dict], bool]:
        """([the user message], whether the interaction ends the conversation after it)."""
        conversation_over, reply, score, _ = await self.interaction.generate_response(
            request_id, messages, **self.interaction_kwargs)
        stats.turn_scores.append(float(score))
        return [{"role": "user", "content": reply}], bool(conversation_over)
