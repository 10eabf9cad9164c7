"""tool_agent end to end: real local Ray, 2 gloo ranks each serving HF generate over HTTP, the calculator tool.

The tiny model is first taught (plain SFT, seconds) one conversation in the loop's own token layout: call the
calculator for 12*34, then answer with what the tool said. Sampled at temperature 1 it then mostly calls the
tool, so the rollout has tool turns whose tokens (response_mask 0) must reach the trainer masked, with no
advantage, and whose counts must reach the metrics.
"""
import os

import pytest
from transformers import AutoModelForCausalLM

from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.defaults.tool_chat_template import TOOL_CHAT_TEMPLATE
from hybridrl.defaults.tool_task import answer_text, sft, tool_call_text
from hybridrl.data.batch_layout import WEIGHT_VERSIONS_KEY
from hybridrl.data.rl_parquet import write_rl_parquet
from test_async_rollout import fit_keeping_update_batches
from test_e2e_training import make_config, read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALCULATOR_YAML = os.path.join(REPO, "examples/sglang_multiturn/config/tool_config/calculator_tool_config.yaml")


@pytest.fixture(scope="module")
def tool_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool_e2e")
    conversation = [{"role": "user", "content": "What is 12*34?"},
                    {"role": "assistant", "content": tool_call_text(12, 34)}, {"role": "tool", "content": "408"},
                    {"role": "assistant", "content": answer_text(408)}]
    texts = [message["content"] for message in conversation] * 20 + [
        "<|im_start|>system\nTools: calculator<|im_end|>\n<|im_start|>user\n<tool_response>\n</tool_response>"] * 20
    tokenizer = build_tokenizer(texts, vocab_size=300)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    model_dir = build_tiny_model(str(root / "model"), tokenizer, hidden_size=32, num_layers=2, num_heads=2,
                                 num_kv_heads=1, intermediate_size=64)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    sft(model, tokenizer, [conversation], steps=300, batch_size=1, lr=1e-2, seed=0, log_every=1000)
    model.save_pretrained(model_dir, safe_serialization=True)
    rows = [{"data_source": "hybridrl/arithmetic_tool", "agent_name": "tool_agent", "prompt": conversation[:1],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": "408"}, "extra_info": {"index": i}}
            for i in range(8)]
    write_rl_parquet(rows, str(root / "train.parquet"))
    return {"model": model_dir, "train": str(root / "train.parquet"), "val": str(root / "train.parquet"),
            "reward": None, "tokenizer": tokenizer}


def tool_overrides(tmp_path, tool_task, *extra):
    return [
        "custom_reward_function.path=null", "data.max_prompt_length=48", "data.max_response_length=96",
        "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true", "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.rollout.agent.num_workers=2", "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.max_user_turns=2",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={CALCULATOR_YAML}",
        "actor_rollout_ref.rollout.temperature=0.5", *extra]


def check_tool_rows(batch, tokenizer) -> int:
    """Every tool answer in the batch is masked, with no advantage and no log-prob, and every conversation ends on
    the model's turn; returns how many rows called the tool."""
    response_mask, advantages = batch.batch["response_mask"], batch.batch["advantages"]
    attention = batch.batch["attention_mask"][:, -response_mask.shape[1]:]
    rows_with_tool = 0
    for row in range(len(batch)):
        responses = batch.batch["responses"][row]
        inserted = (attention[row].bool() & ~response_mask[row].bool())
        if not response_mask[row].any():  # kept out of training (a tokenization mismatch, strict mode)
            continue
        if inserted.any():
            rows_with_tool += 1
            text = tokenizer.decode(responses[inserted].tolist())
            assert text.startswith("\n<|im_start|>user\n<tool_response>\n") and \
                text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n"), text
            assert advantages[row][inserted].abs().sum() == 0
            assert batch.batch["rollout_log_probs"][row][inserted].abs().sum() == 0
        assert response_mask[row][attention[row].bool()][-1] == 1  # every conversation ends on the model's turn
    return rows_with_tool


def check_tool_metrics(step, batch_rows: int, rows_with_tool: int) -> None:
    assert step["agent_loop/num_failed"] == 0
    assert step["agent_loop/tokenization_mismatch/sum"] <= batch_rows // 4
    assert step["num_turns/max"] >= 4 and step["num_turns/min"] >= 2
    assert step["agent_loop/num_tool_calls/mean"] >= 0.5
    assert step["agent_loop/used_tools/mean"] == rows_with_tool / batch_rows
    for key in ("agent_loop/num_tool_errors/sum", "agent_loop/tool_latency_s/mean",
                "agent_loop/tokenization_mismatch/sum", "agent_loop/response_cut/sum"):
        assert key in step


@pytest.mark.slow
def test_a_tool_agent_step_masks_tool_tokens_and_reports_tool_metrics(ray_local, tool_task, tmp_path):
    config = make_config({**tool_task, "reward": os.path.abspath(__file__)}, str(tmp_path),
                         *tool_overrides(tmp_path, tool_task, "trainer.total_training_steps=1"))
    _, batches = fit_keeping_update_batches(config)
    [batch] = batches
    rows_with_tool = check_tool_rows(batch, tool_task["tokenizer"])
    assert rows_with_tool >= len(batch) // 2
    [step] = read_metrics(str(tmp_path))
    check_tool_metrics(step, len(batch), rows_with_tool)


@pytest.mark.slow
def test_the_tool_agent_runs_in_the_data_flow(ray_local, tool_task, tmp_path):
    """The same loop through the data flow (groups scored as they finish, the buffer, its counts): tool turns are
    masked as in the async rollout, each generated token carries the version of the weights that made it (the step's:
    no partial rollout) and inserted ones -1, and the agent_loop/* and data_flow/* counts are logged every step."""
    config = make_config({**tool_task, "reward": os.path.abspath(__file__)}, str(tmp_path),
                         *tool_overrides(tmp_path, tool_task, "trainer.total_training_steps=2", "data_flow.enable=true"))
    _, batches = fit_keeping_update_batches(config)
    assert len(batches) == 2
    steps = read_metrics(str(tmp_path))
    for version, (batch, step) in enumerate(zip(batches, steps)):
        rows_with_tool = check_tool_rows(batch, tool_task["tokenizer"])
        assert rows_with_tool >= len(batch) // 2
        check_tool_metrics(step, len(batch), rows_with_tool)
        assert step["data_flow/num_groups_trained"] == config.data.train_batch_size
        assert step["data_flow/num_dropped_groups"] == 0 and step["data_flow/partial_ratio"] == 0
        versions = batch.batch[WEIGHT_VERSIONS_KEY]
        generated = batch.batch["response_mask"].bool()
        assert (versions[generated] == version).all()  # trained weights v0, then v1
        attention = batch.batch["attention_mask"][:, -generated.shape[1]:].bool()
        assert (versions[attention & ~generated] == -1).all()


# The seeds' features composed (issue 26): the tool agent, verl's filter_groups (dynamic sampling), partial rollout
# and an overlapping schedule on separate trainer and rollout ranks, 6 steps.
COMPOSED = ["actor_rollout_ref.hybrid_engine=false", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.temperature=1.0",
            "algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
            "algorithm.filter_groups.max_num_gen_batches=6", "data_flow.insufficient_groups=train",
            "data_flow.partial_rollout=true", "trainer.total_training_steps=6", "trainer.test_freq=-1"]
SCHEDULES = {"one_step_off": ["async_training.mode=one_step_off", "data_flow.over_sampling_batch_size=12"],
             "fully_async": ["async_training.mode=fully_async", "async_training.max_staleness=1"]}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_tool_agent_dynamic_sampling_and_partial_rollout_compose_with_an_overlapping_schedule(ray_local, tool_task,
                                                                                             tmp_path, schedule):
    """Every step calls tools (their tokens masked as ever), trains whole groups whose scores vary (the filter's
    verdict), logs the data_flow/* and agent_loop/* counts, and keeps its schedule's staleness: one_step_off never
    trains a token of the weights being updated (each is at least one version old from step 2 on), fully_async never
    one more than max_staleness=1 versions old."""
    config = make_config({**tool_task, "reward": os.path.abspath(__file__)}, str(tmp_path),
                         *tool_overrides(tmp_path, tool_task, *COMPOSED, *SCHEDULES[schedule]))
    _, batches = fit_keeping_update_batches(config)
    steps = read_metrics(str(tmp_path))
    assert len(batches) == len(steps) == 6
    for step, (batch, metrics) in enumerate(zip(batches, steps), start=1):
        rows_with_tool = check_tool_rows(batch, tool_task["tokenizer"])
        assert rows_with_tool > 0 and metrics["agent_loop/num_tool_calls/mean"] > 0
        for key in ("data_flow/num_dropped_groups", "data_flow/num_groups_trained", "data_flow/buffer_size",
                    "data_flow/partial_ratio", "agent_loop/num_failed"):
            assert key in metrics, (step, key)
        assert metrics["data_flow/num_groups_trained"] * 4 == len(batch)
        scores = batch.batch["token_level_scores"].sum(-1).view(-1, 4)
        assert (scores.std(dim=1) > 0).all()  # the filter kept only groups whose scores vary
        policy_version = metrics["async_training/policy_version"]
        assert policy_version == step - 1
        generated = batch.batch["response_mask"].bool()
        versions = batch.batch[WEIGHT_VERSIONS_KEY][generated]
        assert versions.min() >= 0
        if schedule == "one_step_off" and step > 1:
            assert versions.max() <= policy_version - 1 and metrics["async_training/staleness/min"] >= 1
        if schedule == "fully_async":
            assert metrics["async_training/staleness/max"] <= 1
            assert versions.min() >= policy_version - 1
