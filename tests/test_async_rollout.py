"""rollout.mode=async end to end: real local Ray, 2 gloo ranks each serving HF generate over HTTP, agent-loop
workers on the controller, the toy task of test_e2e_training (reward: the share of "a" in the response).

A user loop loaded from YAML makes two generate calls with a tool-like span between them (response_mask 0):
the span must reach the trainer unmasked in attention, masked in response_mask, with no advantage (so no
loss), and the loop's own reward must replace the reward manager's.
"""
import os
import re
import sys
import textwrap
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridrl.config.preflight import check_before_start
from hybridrl.config.validation import ConfigError
from hybridrl.trainer.ppo import worker_inputs
from hybridrl.trainer.ppo.ray_trainer import RayPPOTrainer
from test_e2e_training import make_config, read_metrics

USER_LOOPS = '''
import asyncio
import os
import time
from uuid import uuid4

from hybridrl.agent_loop import AgentLoopBase, AgentLoopOutput, register


class ToolSpanLoop(AgentLoopBase):
    """Turn 1 (3 tokens), a tool answer `span_text` the model did not write, turn 2 (the rest of the budget).
    Its reward: 1 for an even extra_info index, else 0 (so the test knows each row's score)."""

    def __init__(self, *args, span_text, **kwargs):
        super().__init__(*args, **kwargs)
        self.span = self.tokenizer(span_text, add_special_tokens=False)["input_ids"]

    async def run(self, sampling_params, **kwargs):
        prompt_ids = await self.apply_chat_template(kwargs["raw_prompt"])
        budget = self.config.actor_rollout_ref.rollout.response_length
        request_id = uuid4().hex
        first = await self.server_manager.generate(request_id=request_id, prompt_ids=prompt_ids,
                                                   sampling_params={**sampling_params, "max_tokens": 3})
        response = first.token_ids + self.span
        mask = [1] * len(first.token_ids) + [0] * len(self.span)
        logprobs = first.log_probs + [0.0] * len(self.span)
        second = await self.server_manager.generate(request_id=request_id, prompt_ids=prompt_ids + response,
                                                    sampling_params={**sampling_params,
                                                                     "max_tokens": budget - len(response)})
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response + second.token_ids,
                               response_mask=mask + [1] * len(second.token_ids),
                               response_logprobs=logprobs + second.log_probs,
                               reward_score=float(kwargs["extra_info"]["index"] % 2 == 0), num_turns=4,
                               extra_fields={"span_start": len(first.token_ids)})


@register("flaky_agent")
class FlakyLoop(AgentLoopBase):
    """Raises for odd extra_info indices; otherwise one turn."""

    async def run(self, sampling_params, **kwargs):
        if kwargs["extra_info"]["index"] % 2:
            raise KeyError("flaky loop: odd index")
        output = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=list(kwargs["raw_prompt_ids"]),
                                                    sampling_params=sampling_params)
        return AgentLoopOutput(prompt_ids=list(kwargs["raw_prompt_ids"]), response_ids=output.token_ids,
                               response_mask=[1] * len(output.token_ids), num_turns=2)


@register("slow_agent")
class SlowLoop(AgentLoopBase):
    """Waits before its one turn until the test has killed a rank and written `rank_killed` next to this module
    (300 s at most)."""

    async def run(self, sampling_params, **kwargs):
        marker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_killed")
        deadline = time.monotonic() + 300
        while not os.path.exists(marker) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        output = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=list(kwargs["raw_prompt_ids"]),
                                                    sampling_params=sampling_params)
        return AgentLoopOutput(prompt_ids=list(kwargs["raw_prompt_ids"]), response_ids=output.token_ids,
                               response_mask=[1] * len(output.token_ids), num_turns=2)


@register("greedy_server_breaker")
class ServerBreaker(AgentLoopBase):
    """Asks the engine for more tokens than rollout.response_length: the server refuses, the step must fail."""

    async def run(self, sampling_params, **kwargs):
        await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=list(kwargs["raw_prompt_ids"]),
                                           sampling_params={**sampling_params, "max_tokens": 1000})
'''


@pytest.fixture
def user_loops(tmp_path, monkeypatch):
    """The loops module on sys.path (here and, through PYTHONPATH, in the Ray actors) and the YAML naming one."""
    (tmp_path / "my_agent_loops.py").write_text(USER_LOOPS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    path = tmp_path / "agent_loops.yaml"
    path.write_text(textwrap.dedent("""
        - name: tool_span_agent
          _target_: my_agent_loops.ToolSpanLoop
          span_text: ink ink
    """))
    return str(path)


def async_overrides(loops_yaml, default_loop):
    return ["actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true",
            "actor_rollout_ref.rollout.agent.num_workers=2",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops_yaml}",
            f"actor_rollout_ref.rollout.agent.default_agent_loop={default_loop}"]


def spy_on_update_actor(trainer):
    """Keep every training batch the actor is updated on, whole, as the trainer holds it when it sends the update (the
    update still runs, and gets only the tensors it reads: trainer/ppo/worker_inputs.py). The tests read columns the
    worker is not sent (scores, dataset columns), so the spy sits on that selection, until the trainer shuts down."""
    seen, select, shutdown = [], worker_inputs.actor_update, trainer.shutdown
    trainer_module = sys.modules[RayPPOTrainer.__module__]

    def keep_whole(batch, use_kl_loss):
        seen.append(batch)
        return select(batch, use_kl_loss)

    def shutdown_and_restore():
        trainer_module.worker_inputs = worker_inputs
        shutdown()

    trainer_module.worker_inputs = SimpleNamespace(**{**vars(worker_inputs), "actor_update": keep_whole})
    trainer.shutdown = shutdown_and_restore
    return seen


def fit_keeping_update_batches(config):
    """(the trainer the config asks for, after fit and shutdown; every batch its actor was updated on)."""
    trainer = RayPPOTrainer(config)
    trainer.init_workers()
    try:
        batches = spy_on_update_actor(trainer)
        trainer.fit()
    finally:
        trainer.shutdown()
    return trainer, batches


@pytest.mark.slow
def test_yaml_loop_with_a_masked_span_trains_only_on_model_tokens(ray_local, toy_task, user_loops, tmp_path):
    config = make_config(toy_task, str(tmp_path), *async_overrides(user_loops, "tool_span_agent"),
                         "algorithm.adv_estimator=reinforce_plus_plus",
                         "actor_rollout_ref.rollout.calculate_log_probs=true")
    trainer, batches = fit_keeping_update_batches(config)
    span = trainer.tokenizer("ink ink", add_special_tokens=False)["input_ids"]
    assert len(batches) == 2
    for batch in batches:
        response_mask, advantages = batch.batch["response_mask"], batch.batch["advantages"]
        attention = batch.batch["attention_mask"][:, -response_mask.shape[1]:]
        for row in range(len(batch)):
            first_turn = int(response_mask[row, :3].sum())  # the span follows turn 1 (3 tokens, fewer at an EOS)
            assert batch.non_tensor_batch["span_start"][row] == first_turn  # extra_fields became a column
            hole = slice(first_turn, first_turn + len(span))
            assert batch.batch["responses"][row, hole].tolist() == span
            assert response_mask[row, hole].tolist() == [0] * len(span)
            assert attention[row, hole].tolist() == [1] * len(span)  # the model still reads the tool's answer
            assert advantages[row, hole].abs().sum() == 0  # no advantage, so no policy-gradient loss, on the span
        trained = response_mask.bool()
        assert advantages[trained].abs().sum() > 0
        # the loop's reward replaced the manager's share-of-"a": 1 for even indices, else 0
        expected = torch.tensor([float(info["index"] % 2 == 0) for info in batch.non_tensor_batch["extra_info"]])
        assert torch.equal(batch.batch["token_level_scores"].sum(-1), expected)
    for step in read_metrics(str(tmp_path)):
        assert step["agent_loop/num_failed"] == 0
        assert step["num_turns/mean"] == 4
        # the rank's server reports its rollout window at trainer_mode: its requests, when the first and last came
        assert step["rollout/server_requests"] > 0
        assert step["timing_s/server_last_request"] >= step["timing_s/server_first_request"] >= 0
        # the servers generated with the trainer's own weights: their log-probs match the actor's
        assert step["training/rollout_probs_diff_max"] < 1e-3
        assert step["timing_s/gen"] > 0


def write_rows(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.slow
def test_failed_loops_cost_their_samples_until_the_share_is_exceeded(ray_local, toy_task, user_loops, tmp_path,
                                                                     capsys):
    rows = [{"data_source": "toy/letter_a", "prompt": [{"role": "user", "content": f"say something about {w}"}],
             "ability": "toy", "reward_model": {"style": "rule", "ground_truth": "a"},
             "extra_info": {"index": i}, "agent_name": "flaky_agent"} for i, w in enumerate(["apple", "dog"] * 8)]
    train = write_rows(str(tmp_path / "flaky.parquet"), rows)
    config = make_config(toy_task, str(tmp_path / "run"), *async_overrides(user_loops, "single_turn_agent"),
                         f"data.train_files={train}", "data.shuffle=false",
                         "actor_rollout_ref.rollout.agent.max_failed_sample_ratio=0.5",
                         "trainer.total_training_steps=1")
    trainer = RayPPOTrainer(config)
    trainer.init_workers()
    try:
        batches = spy_on_update_actor(trainer)
        trainer.fit()
        printed = capsys.readouterr().out
        # half the rows (odd indices) failed: counted, traceback printed once, no loss on them, score 0
        step = read_metrics(str(tmp_path / "run"))[0]
        assert step["agent_loop/num_failed"] == 8
        assert printed.count("KeyError: 'flaky loop: odd index'") == 1
        batch = batches[0]
        odd = torch.tensor([info["index"] % 2 == 1 for info in batch.non_tensor_batch["extra_info"]])
        assert batch.batch["response_mask"][odd].sum() == 0
        assert batch.batch["token_level_scores"][odd].abs().sum() == 0
        assert batch.batch["response_mask"][~odd].sum(-1).min() > 0

        trainer.agent_loop_manager.max_failed_ratio = 0.25  # more than a quarter fails: the step fails
        with pytest.raises(RuntimeError, match="(?s)8 of 16 agent loops failed.*max_failed_sample_ratio=0.25.*"
                                               "KeyError: 'flaky loop: odd index'"):
            trainer.train_step()
        trainer.placement.trainer_mode()  # the failed step left the ranks in rollout mode
        # an engine server's error is no sample failure: it fails the step with the server's own message
        get_groups = trainer.prompt_source.get_groups

        def breaking_groups(*args):
            groups = get_groups(*args)
            for sample in (sample for group in groups for sample in group):
                sample.metadata["agent_name"] = "greedy_server_breaker"
            return groups

        trainer.prompt_source.get_groups = breaking_groups
        with pytest.raises(Exception, match="(?s)engine server .* HTTP 500.*max_tokens=1000"):
            trainer.train_step()
    finally:
        trainer.shutdown()


def test_unknown_agent_name_is_refused_before_workers_start(toy_task, user_loops, tmp_path):
    rows = [{"data_source": "toy/letter_a", "prompt": [{"role": "user", "content": "say something about dog"}],
             "ability": "toy", "reward_model": {"style": "rule", "ground_truth": "a"},
             "extra_info": {"index": i}, "agent_name": name} for i, name in enumerate(["tool_span_agent", "nope"] * 8)]
    train = write_rows(str(tmp_path / "named.parquet"), rows)
    config = make_config(toy_task, str(tmp_path / "run"), *async_overrides(user_loops, "single_turn_agent"),
                         f"data.train_files={train}")
    with pytest.raises(ConfigError) as refused:
        check_before_start(config)
    [problem] = [problem for problem in refused.value.problems if "agent_name" in problem]
    assert re.fullmatch(r"data.train_files\[0\]: expected agent_name values among the registered agent loops \[.*"
                        r"'single_turn_agent', 'slow_agent', 'tool_agent', 'tool_span_agent'\], got \['nope'\] in "
                        + re.escape(repr(train)) + r" \(register with @register\(name\) or list them in "
                        r"actor_rollout_ref.rollout.agent.agent_loop_config_path\)", problem)


def test_a_dead_engine_server_fails_the_step_within_60_s(ray_local, toy_task, user_loops, tmp_path):
    """Rank 1 is SIGKILLed while the step's loops run; they wait for the test's word that it is gone, so their
    requests meet a dead server whatever the machine's load (no timer racing a sleep). The step then fails at once,
    which is shown by how, not by a time: the error is the lost connection itself (refused, or a pooled one found
    dropped), not a timeout of any kind, so nothing in it waited (the connect timeout is 30 s; requests have no
    other)."""
    import threading

    import psutil
    import ray

    config = make_config(toy_task, str(tmp_path), *async_overrides(user_loops, "slow_agent"),
                         "trainer.total_training_steps=1")
    trainer = RayPPOTrainer(config)
    trainer.init_workers()
    try:
        rank1 = trainer.actor_rollout_wg.workers[1]
        pid = ray.get(rank1.__ray_call__.remote(lambda worker: os.getpid()))
        wait = trainer.group_rollout.generator.wait
        marker = tmp_path / "rank_killed"  # next to my_agent_loops.py, where SlowLoop looks for it
        killer_errors = []

        def kill_rank1():
            try:
                process = psutil.Process(pid)
                process.kill()
                process.wait(120)  # gone: its server's socket is closed
            except Exception as error:  # noqa: BLE001 — reported below, after the step
                killer_errors.append(error)
            finally:
                marker.touch()  # the loops go on either way: a failed kill fails the test, it does not hang it

        def kill_rank1_then_wait(handles):  # in rollout mode, while the submitted loops wait for the marker
            if marker.exists():  # killed at the first wait already
                return wait(handles)
            killer = threading.Thread(target=kill_rank1)
            killer.start()
            try:
                return wait(handles)
            finally:
                killer.join()

        trainer.group_rollout.generator.wait = kill_rank1_then_wait
        with pytest.raises(Exception, match=r"engine server \S+ \(rank 1\) is unreachable or died mid-request: "
                                            r"(ClientConnectorError|ServerDisconnectedError|ClientOSError)"):
            trainer.train_step()
        assert not killer_errors, killer_errors
    finally:
        trainer.shutdown()
