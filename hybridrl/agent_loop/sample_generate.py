"""Generating one Sample in an agent-loop worker: the data flow's generate function and what it is given.

The built-in `generate` is the single-turn loop that can continue: a pending sample generates from its prompt, an
aborted one (partial rollout) from its prompt plus the tokens it already has, with what is left of
rollout.response_length; the new tokens are recorded with the weight version the engine server reported for them
(TokenOutput.weight_version: the weights that really generated them, whatever the schedule). A completed or
truncated sample comes back unchanged. `data_flow.custom_generate_function` replaces it (same signature; see
hybridrl/data/hooks.py); a multi-turn one calls ctx.server_manager.generate once per turn.
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
