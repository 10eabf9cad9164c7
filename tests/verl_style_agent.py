"""An agent loop, a tool and an interaction written against verl's API as verl documents it (agent-loop, tool and
interaction guides), with `verl.` replaced by `hybridrl.compat.verl.` in the import lines and nothing else.

tests/test_verl_compat.py runs them through the real agent-loop manager and a 2-step training run.
"""
import json
import re
from typing import Any, Optional
from uuid import uuid4

from hybridrl.compat.verl.experimental.agent_loop import AgentLoopBase, AgentLoopOutput, register
from hybridrl.compat.verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from hybridrl.compat.verl.interactions.base import BaseInteraction
from hybridrl.compat.verl.interactions.utils.interaction_registry import initialize_interactions_from_config
from hybridrl.compat.verl.tools.base_tool import BaseTool
from hybridrl.compat.verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from hybridrl.compat.verl.tools.utils.tool_registry import initialize_tools_from_config
from hybridrl.compat.verl.utils.profiler import simple_timer
from hybridrl.compat.verl.utils.rollout_trace import rollout_trace_op


@register("react_agent")
class ReactAgentLoop(AgentLoopBase):
    """Generate; run the tool calls of the turn; append the tool responses (remove_system_prompt, as verl's
    ToolAgentLoop does); without a tool call, let the interaction answer, if the sample has one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        multi_turn = self.config.actor_rollout_ref.rollout.multi_turn
        self.response_length = self.rollout_config.response_length
        self.max_user_turns = multi_turn.max_user_turns
        self.tools = {tool.name: tool for tool in initialize_tools_from_config(multi_turn.tool_config_path)}
        self.tool_schemas = [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
                             for tool in self.tools.values()]
        self.tool_parser = ToolParser.get_tool_parser(multi_turn.format, self.tokenizer)
        interaction_config_path = multi_turn.interaction_config_path
        self.interactions = initialize_interactions_from_config(interaction_config_path) \
            if interaction_config_path else {}

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        tools_kwargs = kwargs.get("tools_kwargs", {})
        interaction_kwargs = kwargs.get("interaction_kwargs", {})
        request_id = uuid4().hex
        interaction = None
        if self.interactions:
            interaction = self.interactions[interaction_kwargs["name"]]
            await interaction.start_interaction(request_id, **interaction_kwargs)
        metrics = {}
        multi_modal_data = await self.process_vision_info(messages)
        images, videos = multi_modal_data.get("images"), multi_modal_data.get("videos")
        prompt_ids = await self.apply_chat_template(messages, tools=self.tool_schemas, images=images, videos=videos)
        response_ids, response_mask, response_logprobs = [], [], []
        tool_rewards, turn_scores = [], []
        user_turns, assistant_turns = 0, 0
        while True:
            with simple_timer("generate_sequences", metrics):
                output = await self.server_manager.generate(
                    request_id=request_id, prompt_ids=prompt_ids + response_ids, sampling_params=sampling_params,
                    image_data=images, video_data=videos)
            metrics["num_preempted"] = output.num_preempted if output.num_preempted is not None else -1
            assistant_turns += 1
            response_ids += output.token_ids
            response_mask += [1] * len(output.token_ids)
            response_logprobs += output.log_probs or [0.0] * len(output.token_ids)
            if len(response_mask) >= self.response_length:
                break
            if self.max_user_turns and user_turns >= self.max_user_turns:
                break
            content, tool_calls = await self.tool_parser.extract_tool_calls(output.token_ids)
            messages.append({"role": "assistant", "content": content})
            if tool_calls:
                with simple_timer("tool_calls", metrics):
                    added = [await self._call_tool(call, tools_kwargs, tool_rewards) for call in tool_calls]
            elif interaction is not None:
                should_terminate, reply, score, _ = await interaction.generate_response(
                    request_id, messages, **interaction_kwargs)
                turn_scores.append(score)
                if should_terminate:
                    break
                added = [{"role": "user", "content": reply}]
            else:
                break
            messages.extend(added)
            added_ids = await self.apply_chat_template(added, remove_system_prompt=True)
            if len(response_mask) + len(added_ids) >= self.response_length:
                break
            response_ids += added_ids
            response_mask += [0] * len(added_ids)
            response_logprobs += [0.0] * len(added_ids)
            user_turns += 1
        if interaction is not None:
            await interaction.finalize_interaction(request_id)
        return AgentLoopOutput(
            prompt_ids=prompt_ids, response_ids=response_ids[: self.response_length],
            response_mask=response_mask[: self.response_length],
            response_logprobs=response_logprobs[: self.response_length],
            num_turns=user_turns + assistant_turns + 1, metrics=metrics,
            extra_fields={"tool_rewards": tool_rewards, "turn_scores": turn_scores})

    async def _call_tool(self, tool_call: FunctionCall, tools_kwargs: dict, tool_rewards: list) -> dict:
        tool = self.tools[tool_call.name]
        kwargs = tools_kwargs.get(tool_call.name, {})
        instance_id, _ = await tool.create(create_kwargs=kwargs.get("create_kwargs", {}))
        try:
            response, reward, _ = await tool.execute(instance_id, json.loads(tool_call.arguments))
        finally:
            await tool.release(instance_id)
        tool_rewards.append(reward)
        return {"role": "tool", "content": response.text}


class CheckedCalculatorTool(BaseTool):
    """A calculator that also checks the product against the sample's ground truth (given per sample in
    extra_info.tools_kwargs.calculator.create_kwargs); its schema comes from get_openai_tool_schema, the YAML
    says tool_schema: null."""

    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema] = None):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
            "name": "calculator", "description": "Evaluates an arithmetic expression exactly, e.g. \"123*456\".",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                           "required": ["expression"]}}})

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        if ground_truth is None:
            raise ValueError("created without its ground truth")
        self._instance_dict[instance_id] = {"ground_truth": ground_truth}
        return instance_id, ToolResponse()

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        factors = re.fullmatch(r"\s*(\d+)\s*\*\s*(\d+)\s*", str(parameters.get("expression", "")))
        if factors is None:
            return ToolResponse(text="Error: expected a*b"), 0.0, {}
        value = str(int(factors.group(1)) * int(factors.group(2)))
        return ToolResponse(text=value), float(value == self._instance_dict[instance_id]["ground_truth"]), {}

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]


class ExactAnswerInteraction(BaseInteraction):
    """The user checks the model's last reply for the right number: 1 and done, or 0 and "try again"."""

    def __init__(self, config: dict):
        super().__init__(config)
        self._instance_dict = {}

    async def start_interaction(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                                **kwargs) -> str:
        self._instance_dict[instance_id] = {"ground_truth": ground_truth}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict]:
        reply = [message["content"] for message in messages if message["role"] == "assistant"][-1]
        correct = self._instance_dict[instance_id]["ground_truth"] in reply
        return correct, "Correct." if correct else "Try again.", float(correct), {}

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
