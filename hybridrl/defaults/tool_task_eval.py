"""Accuracy and tool use of a model on the arithmetic tool task, through the real tool_agent loop.

    python -m hybridrl.defaults.tool_task_eval MODEL_DIR [--cache_dir DIR] [--temperature 0]

Runs ToolAgentLoop in this process against the HF engine of the async rollout (async_server.HFGenerateEngine):
the same loop, template, parser and tool as training, no Ray. Used to measure the warm start and the trained
model; `accuracy` is the share of test questions whose final answer is right, `tool_use` the share of
conversations that called the calculator.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os

from hybridrl.reward.scorers.arithmetic_tool import compute_score


def tool_task_config(response_length: int = 96):
    """The run config of hybridrl/config/tool_default.yaml, with the packaged tool YAML."""
    import hybridrl.checks  # noqa: F401  registers the subsystems' config checks
    from hybridrl.config import compose_config, validate_config

    tool_config_path = os.path.join(os.path.dirname(__file__), "arithmetic_tool_config.yaml")
    return validate_config(compose_config([f"data.max_response_length={response_length}",
                                           f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config_path}"],
                                          config_name="tool_default"))


class LocalServer:
    """server_manager.generate on an in-process HFGenerateEngine."""

    def __init__(self, engine):
        self.engine = engine

    async def generate(self, request_id, *, prompt_ids, sampling_params, image_data=None):
        from hybridrl.agent_loop.base import TokenOutput
        return TokenOutput(**await self.engine.generate(prompt_ids, sampling_params))


def evaluate(model_dir: str, rows: list[dict], temperature: float = 0.0, response_length: int = 96) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrl.agent_loop.base import DictConfigWrap
    from hybridrl.agent_loop.tool_agent import ToolAgentLoop
    from hybridrl.workers.rollout.async_server import HFGenerateEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    config = tool_task_config(response_length)
    ToolAgentLoop._class_initialized = False

    async def run_all():
        engine = HFGenerateEngine(model, response_length, [tokenizer.eos_token_id], tokenizer.pad_token_id,
                                  max_batch_size=256)
        server = LocalServer(engine)
        params = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "logprobs": False}

        async def one(row):
            loop = ToolAgentLoop(DictConfigWrap(config), server_manager=server, tokenizer=tokenizer)
            return await loop.run(dict(params), raw_prompt=row["prompt"], extra_info=row["extra_info"])
        try:
            return await asyncio.gather(*(one(row) for row in rows))
        finally:
            await engine.close()

    outputs = asyncio.run(run_all())
    correct = [compute_score("", tokenizer.decode(output.response_ids, skip_special_tokens=True),
                             row["reward_model"]["ground_truth"]) for output, row in zip(outputs, rows)]
    used_tool = [output.metrics.num_tool_calls > 0 for output in outputs]
    return {"accuracy": sum(correct) / len(rows), "tool_use": sum(used_tool) / len(rows),
            "accuracy_with_tool": sum(c for c, u in zip(correct, used_tool) if u) / max(1, sum(used_tool)),
            "tokenization_mismatch": sum(output.metrics.tokenization_mismatch for output in outputs)}


def main() -> None:
    import pyarrow.parquet as pq

    from hybridrl.defaults.tool_task import tool_task_paths

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--cache_dir", default=os.environ.get("HYBRIDRL_CACHE_DIR", "~/.cache/hybridrl"))
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    rows = pq.read_table(tool_task_paths(args.cache_dir)["val_file"]).to_pylist()
    print(json.dumps(evaluate(args.model_dir, rows, args.temperature), indent=2))


if __name__ == "__main__":
    main()
