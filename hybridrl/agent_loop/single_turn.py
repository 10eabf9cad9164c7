"""`single_turn_agent`: the built-in loop, one generate call per sample (what sync mode does, per request)."""
from __future__ import annotations

import time
from typing import Any
from uuid import uuid4

from hybridrl.agent_loop.base import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    """The prompt is the dataset's own tokenization (raw_prompt_ids: templated and truncated as data.* says), so
    sync and async modes generate from identical prompts; the response is everything the engine returned."""

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        prompt_ids = list(kwargs["raw_prompt_ids"])
        started = time.perf_counter()
        output = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=prompt_ids,
                                                    sampling_params=sampling_params)
        metrics = AgentLoopMetrics(generate_sequences=time.perf_counter() - started,
                                   num_preempted=-1 if output.num_preempted is None else output.num_preempted)
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=output.token_ids,
                               response_mask=[1] * len(output.token_ids), response_logprobs=output.log_probs,
                               routed_experts=output.routed_experts, num_turns=2, metrics=metrics)
