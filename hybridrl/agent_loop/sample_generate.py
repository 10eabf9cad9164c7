"""Generating one Sample in an agent-loop worker: the data flow's generate function and what it is given.

Which function generates a sample (AgentLoopWorker.generate_group): `data_flow.custom_generate_function` when set
(same signature as `generate`; see hybridrl/data/hooks.py); else, for the single-turn loop, the built-in `generate`;
else the sample's agent loop (its `agent_name` column, or rollout.agent.default_agent_loop: tool_agent, a verl-style
loop of the user's), run from the prompt as the async rollout runs it (or continued, below), its output made into the
sample by `sample_from_loop`. A ReMax baseline (Sample.is_baseline) is generated the same way, with the greedy sampling
parameters AgentLoopWorker.generate_group gives it.

The built-in `generate` is the single-turn loop that can continue: a pending sample generates from its prompt, an
aborted one (partial rollout) from its prompt plus the tokens it already has, with what is left of
rollout.response_length; the new tokens are recorded with the weight version the engine server reported for them
(TokenOutput.weight_version: the weights that really generated them, whatever the schedule). A completed or
truncated sample comes back unchanged.

A multi-turn loop's state is a conversation with tool results, not a token list, so only the loop itself can
continue it: a loop that declares `can_resume` (AgentLoopBase.can_resume; tool_agent does) returns, when an abort
interrupts it, its tokens so far and its `resume_state`, which `sample_from_loop` keeps on the sample; next time
the loop gets them back (`resume_from`) and finishes the conversation, the tokens it already had keeping their
weight versions. For any other loop an aborted sample cannot be continued: partial rollout is refused for it (config
check and, for a row's own agent_name, at run time) and its aborted groups are generated again from the prompt.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from hybridrl.data.sample import ABORTED, COMPLETED, PENDING, TRUNCATED, Sample

STOP_REASON_STATUS = {"completed": COMPLETED, "length": TRUNCATED, "aborted": ABORTED}


@dataclass
class GenerateContext:
    """What a generate function gets besides the sample: the engines, the tokenizer, the run config and the response
    budget (rollout.response_length). The weights' version comes with every answer (TokenOutput.weight_version)."""
    server_manager: Any
    tokenizer: Any
    config: Any
    response_length: int


async def generate(ctx: GenerateContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    if sample.status not in (PENDING, ABORTED):
        return sample
    budget = ctx.response_length - sample.response_length
    if budget <= 0:
        sample.status = TRUNCATED
        return sample
    output = await ctx.server_manager.generate(request_id=uuid4().hex, prompt_ids=sample.tokens,
                                               sampling_params={**sampling_params, "max_tokens": budget})
    if output.weight_version is None:
        raise RuntimeError("the engine server answered without a weight_version: it serves no known weights (an engine "
                           "server must be started with serve(weight_version), as the rollout worker does)")
    sample.append(output.token_ids, output.log_probs if sampling_params.get("logprobs") else None,
                  output.weight_version)
    sample.status = STOP_REASON_STATUS[output.stop_reason or "completed"]
    if sample.status == ABORTED:
        sample.num_aborts += 1
    return sample


def sample_from_loop(sample: Sample, result: dict[str, Any], eos_token_id: int, with_log_probs: bool) -> Sample:
    """`sample` filled from one agent-loop run (AgentLoopWorker._run_row's result), as the async rollout's batch holds
    it: the loop's own prompt (its chat template and tools), response tokens with response_mask as the loss mask
    (tool output: 0), every generated token's weight version (inserted ones: -1), the loop's reward_score when it
    gave one (else the reward manager scores it), its turns, metrics and extra_fields (as metadata, verl's columns, with
    __num_turns__ and routed_experts).

    A loop that failed leaves the sample one EOS token with no loss and reward 0, its traceback in `error`, as a failed
    row of the async rollout. A run cut by an abort is marked aborted, with the loop's resume_state (a resumable loop
    continues from it; for others it is None and the group is generated again)."""
    if "error" in result:
        sample.response_ids, sample.loss_mask, sample.token_versions = [eos_token_id], [0], [-1]
        sample.rollout_log_probs = [0.0] if with_log_probs else None
        sample.reward, sample.status, sample.error = 0.0, COMPLETED, result["error"]
        sample.resume_state = None
        return sample
    output = result["output"]
    sample.prompt_ids = list(output["prompt_ids"])
    sample.response_ids, sample.loss_mask = list(output["response_ids"]), list(output["response_mask"])
    sample.token_versions = list(result["token_versions"])
    sample.rollout_log_probs = list(output["response_logprobs"]) if with_log_probs else None
    sample.reward = output["reward_score"]
    sample.num_turns, sample.agent_metrics = output["num_turns"], dict(output["metrics"])
    sample.metadata.update(output["extra_fields"])
    sample.metadata["__num_turns__"] = output["num_turns"]  # verl's column (the scorer's extra_info num_turns)
    if output.get("routed_experts") is not None:
        sample.metadata["routed_experts"] = output["routed_experts"]
    sample.resume_state = output.get("resume_state") if result["aborted"] else None
    if result["aborted"]:
        sample.status, sample.num_aborts = ABORTED, sample.num_aborts + 1
    else:
        sample.status = TRUNCATED if output["metrics"].get("response_cut") else COMPLETED
    return sample
