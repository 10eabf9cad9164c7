"""verl's agent-loop, tool and interaction API here (issue 28): a file written against verl runs when `verl.` becomes
`hybridrl.compat.verl.` in its import lines.

tests/verl_style_agent.py holds a loop, a tool and an interaction written against verl's API as verl documents it.
They run here in process against a scripted engine (exact tokens), through the real agent-loop manager in Ray
workers (built at start), and in a 2-step CPU training run of the built-in arithmetic tool task.
"""
import asyncio
import importlib
import os
import re
import textwrap

import pytest
import torch

from hybridrl.agent_loop.base import DictConfigWrap, TokenOutput
from hybridrl.agent_loop.verl_config import unwrap
from hybridrl.config import ConfigError, compose_config, validate_config
from hybridrl.defaults.tiny_model import build_tokenizer
from hybridrl.defaults.tool_chat_template import TOOL_CHAT_TEMPLATE
from hybridrl.data.rl_dataset import RLHFDataset
from hybridrl.data.rl_parquet import write_rl_parquet

TESTS = os.path.dirname(os.path.abspath(__file__))
# ChatML with a default system prompt when the conversation has none, as Qwen2.5's template adds one
DEFAULT_SYSTEM_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nBe exact.<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


@pytest.fixture(autouse=True)
def agent_loop_registry_restored():
    """The loops these tests register (by import or by YAML) are gone afterwards: later modules see the registry
    they would see without this one."""
    from hybridrl.agent_loop import base

    saved = base.load_agent_loop_config(None)  # the built-in loops included: they register once, on import
    yield
    base._agent_loop_registry.clear()
    base._agent_loop_registry.update(saved)


# ---- the compat modules are hybridrl's own objects

@pytest.mark.parametrize("verl_module, name, hybridrl_module", [
    ("experimental.agent_loop", "AgentLoopBase", "hybridrl.agent_loop"),
    ("experimental.agent_loop.agent_loop", "AgentLoopOutput", "hybridrl.agent_loop"),
    ("experimental.agent_loop.agent_loop", "AsyncLLMServerManager", "hybridrl.agent_loop.server_manager"),
    ("experimental.agent_loop.agent_loop", "DictConfigWrap", "hybridrl.agent_loop"),
    ("experimental.agent_loop.agent_loop", "register", "hybridrl.agent_loop"),
    ("experimental.agent_loop.agent_loop", "ToolListWrap", "hybridrl.agent_loop.base"),
    ("experimental.agent_loop.tool_parser", "ToolParser", "hybridrl.agent_loop.tool_parser"),
    ("experimental.agent_loop.utils", "build_gpt_oss_tool_response_text", "hybridrl.agent_loop.gpt_oss"),
    ("tools.function_tool", "FunctionTool", "hybridrl.tools.function_tool"),
    ("tools.function_tool", "normalize_function_tool_return", "hybridrl.tools.function_tool"),
    ("experimental.agent_loop.tool_agent_loop", "ToolAgentLoop", "hybridrl.agent_loop.tool_agent"),
    ("tools.base_tool", "BaseTool", "hybridrl.tools"),
    ("tools.schemas", "ToolResponse", "hybridrl.tools"),
    ("tools.utils.tool_registry", "initialize_tools_from_config", "hybridrl.tools"),
    ("tools.gsm8k_tool", "Gsm8kTool", "hybridrl.tools.gsm8k_tool"),
    ("interactions.base", "BaseInteraction", "hybridrl.interactions"),
    ("interactions.utils.interaction_registry", "initialize_interactions_from_config", "hybridrl.interactions"),
    ("interactions.gsm8k_interaction", "Gsm8kInteraction", "hybridrl.interactions.gsm8k_interaction"),
    ("workers.rollout.replica", "TokenOutput", "hybridrl.agent_loop"),
])
def test_each_verl_path_holds_hybridrls_own_object(verl_module, name, hybridrl_module):
    ported = importlib.import_module(f"hybridrl.compat.verl.{verl_module}")
    assert getattr(ported, name) is getattr(importlib.import_module(hybridrl_module), name)


# ---- a verl loop in process, against a scripted engine

class ScriptedServer:
    """server_manager.generate with verl's arguments, answering each call with the next scripted text + EOS."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.calls = tokenizer, list(turns), []

    async def generate(self, request_id, *, prompt_ids, sampling_params, image_data=None, video_data=None):
        self.calls.append({"prompt_ids": list(prompt_ids), "image_data": image_data, "video_data": video_data})
        ids = self.tokenizer(self.turns.pop(0), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return TokenOutput(token_ids=ids, log_probs=[-1.0] * len(ids), num_preempted=0)


@pytest.fixture(scope="module")
def tokenizer():
    texts = [CALL, "<tool_response> user assistant system Be exact. Tools: calculator Correct. Try again.",
             "What is 12*34? The answer is 408. 400"] * 20
    built = build_tokenizer(texts, vocab_size=400)
    built.chat_template = DEFAULT_SYSTEM_TEMPLATE
    return built


def write_yaml(path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def verl_files(tmp_path):
    """The tool YAML (tool_schema: null: the class gives it) and the interaction YAML, as verl's guides write them."""
    tools = write_yaml(tmp_path / "tools.yaml", """\
        tools:
          - class_name: verl_style_agent.CheckedCalculatorTool
            config: {type: native}
            tool_schema: null
        """)
    interactions = write_yaml(tmp_path / "interactions.yaml", """\
        interaction:
          - name: exact
            class_name: verl_style_agent.ExactAnswerInteraction
            config: {}
        """)
    return {"tools": tools, "interactions": interactions}


def loop_config(tools_yaml, *overrides):
    return validate_config(compose_config([
        "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true", "data.max_response_length=200",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools_yaml}", *overrides]))


def dataset_row(tmp_path, tokenizer, config) -> dict:
    """Row 0 of the real dataset as the manager hands it to a loop: its non-tensor columns, for a parquet row with
    tools_kwargs and interaction_kwargs under extra_info (verl's preprocessing layout)."""
    row = {"data_source": "hybridrl/arithmetic_tool", "agent_name": "react_agent",
           "prompt": [{"role": "user", "content": "What is 12*34?"}], "ability": "math",
           "reward_model": {"style": "rule", "ground_truth": "408"},
           "extra_info": {"index": 0, "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": "408"}}},
                          "interaction_kwargs": {"name": "exact", "ground_truth": "408"}}}
    write_rl_parquet([row], str(tmp_path / "train.parquet"))
    item = RLHFDataset(str(tmp_path / "train.parquet"), tokenizer, config.data)[0]
    return {key: value for key, value in item.items() if not isinstance(value, torch.Tensor)}


def run_loop(loop_cls, config, tokenizer, server, row):
    loop_cls._class_initialized = False

    async def go():
        loop = loop_cls(DictConfigWrap(config), server_manager=server, tokenizer=tokenizer)
        return loop, await loop.run({"temperature": 1.0, "logprobs": True}, **row)
    return asyncio.run(go())


def test_a_verl_loop_gets_verls_attributes_tools_kwargs_interaction_and_system_prompt_removal(
        tokenizer, verl_files, tmp_path, monkeypatch):
    import verl_style_agent  # noqa: F401 - tests/ is on sys.path under pytest

    config = loop_config(verl_files["tools"],
                         f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={verl_files['interactions']}")
    row = dataset_row(tmp_path, tokenizer, config)
    assert row["tools_kwargs"] == {"calculator": {"create_kwargs": {"ground_truth": "408"}}}
    assert row["interaction_kwargs"] == {"name": "exact", "ground_truth": "408"}
    server = ScriptedServer(tokenizer, [CALL, "The answer is 400.", "The answer is 408."])
    loop, output = run_loop(verl_style_agent.ReactAgentLoop, config, tokenizer, server, row)

    assert (loop.dataset_cls, unwrap(loop.data_config), loop.apply_chat_template_kwargs) == (RLHFDataset, config.data,
                                                                                             {})
    assert tokenizer.decode(loop.system_prompt) == "<|im_start|>system\nBe exact.<|im_end|>\n"
    assert [(call["image_data"], call["video_data"]) for call in server.calls] == [(None, None)] * 3
    # the ground truth reached the tool (its reward is 1 for the right product); the interaction scored both answers
    assert output.extra_fields == {"tool_rewards": [1.0], "turn_scores": [0.0, 1.0]}
    assert output.num_turns == 6 and output.metrics.num_preempted == 0
    assert output.metrics.generate_sequences > 0 and output.metrics.tool_calls > 0
    inserted = tokenizer.decode([t for t, m in zip(output.response_ids, output.response_mask) if m == 0])
    # every inserted turn without the template's default system prompt (remove_system_prompt=True)
    assert inserted == ("<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
                        "<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n")


def test_tool_agent_answers_turns_without_a_tool_call_with_the_interaction_and_counts_them_as_user_turns(
        tokenizer, tmp_path):
    """hybridrl's own tool_agent with verl's GSM8K interaction (its YAML naming the class by its verl path)."""
    from hybridrl.agent_loop.tool_agent import ToolAgentLoop

    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    interactions = write_yaml(tmp_path / "interactions.yaml", """\
        interaction:
          - class_name: hybridrl.compat.verl.interactions.gsm8k_interaction.Gsm8kInteraction
            config: {}
        """)
    calculator = os.path.join(os.path.dirname(TESTS), "hybridrl/defaults/arithmetic_tool_config.yaml")
    row = {"raw_prompt": [{"role": "user", "content": "What is 12*34?"}],
           "interaction_kwargs": {"name": "gsm8k", "ground_truth": "408"}}
    for max_user_turns, second_answer, scores in ((None, "#### 408", [0.0, 1.0]), (1, "#### 401", [0.0])):
        config = loop_config(calculator, f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={interactions}",
                             f"actor_rollout_ref.rollout.multi_turn.max_user_turns={max_user_turns or 'null'}")
        server = ScriptedServer(tokenizer, ["#### 400", second_answer, "never asked"])
        _, output = run_loop(ToolAgentLoop, config, tokenizer, server, row)
        # the wrong answer is answered once; the right one ends the conversation, or max_user_turns=1 ends it first
        assert output.extra_fields["turn_scores"] == scores and len(server.calls) == 2
        user_text = tokenizer.decode([t for t, m in zip(output.response_ids, output.response_mask) if m == 0])
        assert user_text == "\n<|im_start|>user\nYour response is incorrect! You need to reflect on your answer " \
                            "and try again.<|im_end|>\n<|im_start|>assistant\n"
    tokenizer.chat_template = DEFAULT_SYSTEM_TEMPLATE


# ---- keys and files refused or acted on before start

def test_chat_template_kwargs_reach_the_prompt_and_keys_that_cannot_apply_are_refused(tokenizer, tmp_path):
    tokenizer.chat_template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    config = loop_config("x.yaml", "+data.apply_chat_template_kwargs.greeting=Hello")
    write_rl_parquet([{"data_source": "d", "prompt": [{"role": "user", "content": " world"}], "ability": "a",
                       "reward_model": {"style": "rule", "ground_truth": "1"}, "extra_info": {"index": 0}}],
                     str(tmp_path / "p.parquet"))
    ids = RLHFDataset(str(tmp_path / "p.parquet"), tokenizer, config.data)[0]["raw_prompt_ids"]
    assert tokenizer.decode(ids) == "Hello world"
    tokenizer.chat_template = DEFAULT_SYSTEM_TEMPLATE
    with pytest.raises(ConfigError) as refused:
        loop_config("x.yaml", "actor_rollout_ref.rollout.over_sample_rate=0.1",
                    "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=true",
                    "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=2")
    assert sorted(problem.split(":")[0] for problem in refused.value.problems) == [
        "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts",
        "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template", "actor_rollout_ref.rollout.over_sample_rate"]


def test_an_agent_loop_target_that_does_not_import_is_refused_before_ray_starts(tmp_path):
    from hybridrl.agent_loop.config_checks import _check_agent_loops

    loops = write_yaml(tmp_path / "loops.yaml", "- name: mine\n  _target_: no_such_module.MyLoop\n")
    config = loop_config("x.yaml", f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}")
    problems: list[str] = []
    _check_agent_loops(config, problems)
    assert len(problems) == 1 and problems[0].startswith("actor_rollout_ref.rollout.agent.agent_loop_config_path")
    assert "entry 0 ('mine'): cannot import _target_ 'no_such_module.MyLoop'" in problems[0], problems



def test_a_tool_yaml_that_does_not_build_is_refused_before_start_naming_the_file(tmp_path):
    from hybridrl.tools.config_checks import _check_tool_config

    calculator = os.path.join(os.path.dirname(TESTS), "hybridrl/defaults/arithmetic_tool_config.yaml")
    problems: list[str] = []
    _check_tool_config(loop_config(calculator), problems)
    assert problems == []
    tools = write_yaml(tmp_path / "tools.yaml", """\
        tools:
          - class_name: no_such_module.NoTool
            config: {type: native}
        """)
    _check_tool_config(loop_config(tools), problems)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"actor_rollout_ref.rollout.multi_turn.tool_config_path: expected a tool YAML whose "
                                  f"every entry builds, got {tools!r}: "), problems
    assert "no_such_module" in problems[0], problems


def test_an_interaction_yaml_that_does_not_build_is_refused_before_start_naming_the_entry(tmp_path):
    from hybridrl.interactions.config_checks import _check_interaction_config

    interactions = write_yaml(tmp_path / "interactions.yaml", """\
        interaction:
          - class_name: hybridrl.compat.verl.interactions.gsm8k_interaction.Gsm8kInteraction
          - class_name: hybridrl.interactions.gsm8k_interaction.Gsm8kInteraction
        """)
    calculator = os.path.join(os.path.dirname(TESTS), "hybridrl/defaults/arithmetic_tool_config.yaml")
    config = loop_config(calculator, f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={interactions}")
    problems: list[str] = []
    _check_interaction_config(config, problems)
    assert problems == [f"actor_rollout_ref.rollout.multi_turn.interaction_config_path: expected an interaction YAML "
                        f"whose every entry builds, got {interactions!r}: {interactions}: interaction[1]: a second "
                        f"interaction named 'gsm8k'; interaction names must be unique"]
    example = os.path.join(os.path.dirname(TESTS), "examples/sglang_multiturn/config/interaction_config/"
                                                   "gsm8k_interaction_config.yaml")
    config.actor_rollout_ref.rollout.multi_turn.interaction_config_path = example
    problems = []
    _check_interaction_config(config, problems)
    assert problems == []

# ---- through the real agent-loop manager (Ray workers)

START_LOOPS = '''
from hybridrl.compat.verl.experimental.agent_loop import AgentLoopBase


class TemplateProbe(AgentLoopBase):
    """Refuses to be built unless the worker's tokenizer has the run's custom_chat_template."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.tokenizer.chat_template != self.config.actor_rollout_ref.model.custom_chat_template:
            raise ValueError("the agent-loop worker's tokenizer lacks actor_rollout_ref.model.custom_chat_template")

    async def run(self, sampling_params, **kwargs):
        raise NotImplementedError


class TracedLoop(AgentLoopBase):
    """Reads verl's rollout.trace config, which hybridrl does not have."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trace_backend = self.config.actor_rollout_ref.rollout.trace.backend

    async def run(self, sampling_params, **kwargs):
        raise NotImplementedError
'''


def test_loops_are_built_at_start_in_a_worker_whose_tokenizer_has_the_custom_template(ray_local, tmp_path,
                                                                                       monkeypatch):
    """One tokenizer for every mode: the agent-loop workers get the controller's, with custom_chat_template
    (TemplateProbe checks it); a
    loop reading a key hybridrl lacks fails when the manager starts, naming the loop and the key."""
    from hybridrl.agent_loop.manager import AgentLoopManager
    from hybridrl.defaults.tiny_model import build_tiny_model
    from hybridrl.utils.tokenizer import policy_tokenizer

    (tmp_path / "start_loops.py").write_text(START_LOOPS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    tokenizer = build_tokenizer(["What is 12*34? The answer is 408."] * 10, vocab_size=300)
    model_dir = build_tiny_model(str(tmp_path / "model"), tokenizer, hidden_size=16, num_layers=1, num_heads=2,
                                 num_kv_heads=1, intermediate_size=32)
    entries = "- name: probe\n  _target_: start_loops.TemplateProbe\n"
    for loops, failure in ((entries, None), (entries + "- name: traced\n  _target_: start_loops.TracedLoop\n",
                                             r"agent loop 'traced' \(start_loops.TracedLoop\) cannot be built: "
                                             r"AttributeError: the run config has no key "
                                             r"'actor_rollout_ref.rollout.trace'")):
        config = loop_config("x.yaml", f"actor_rollout_ref.model.path={model_dir}",
                             "actor_rollout_ref.rollout.multi_turn.enable=false",
                             "actor_rollout_ref.rollout.agent.num_workers=1",
                             f"actor_rollout_ref.rollout.agent.agent_loop_config_path="
                             f"{write_yaml(tmp_path / 'loops.yaml', loops)}",
                             "actor_rollout_ref.rollout.agent.default_agent_loop=probe")
        config.actor_rollout_ref.model.custom_chat_template = DEFAULT_SYSTEM_TEMPLATE
        if failure is None:
            AgentLoopManager(config, policy_tokenizer(config), ["127.0.0.1:9"]).shutdown()
        else:
            with pytest.raises(Exception, match=failure):
                AgentLoopManager(config, policy_tokenizer(config), ["127.0.0.1:9"])


def small_tool_task(root, agent_name: str) -> dict:
    """The built-in arithmetic tool task (--config-name tool_default), small: 14 questions on operands 10-13, a
    200-step warm start that mostly calls the calculator and copies its answer. Its rows are run by the loop
    registered as `agent_name`, each with its product as the calculator's ground truth in tools_kwargs."""
    import pyarrow.parquet as pq

    from hybridrl.defaults.tool_task import ToolTaskRecipe, prepare_tool_task

    recipe = ToolTaskRecipe(train_size=14, test_size=2, low=10, high=13, hidden_size=64, num_heads=2, num_kv_heads=1,
                            intermediate_size=128, sft_steps=200, sft_batch_size=16, tool_fraction=0.75)
    paths = prepare_tool_task(str(root / "cache"), recipe)
    rows = pq.read_table(paths["train_file"]).to_pylist()
    for row in rows:
        row["agent_name"] = agent_name
        product = str(row["extra_info"]["a"] * row["extra_info"]["b"])
        row["extra_info"]["tools_kwargs"] = {"calculator": {"create_kwargs": {"ground_truth": product}}}
    write_rl_parquet(rows, str(root / "train.parquet"))
    return {"model": paths["model_dir"], "train": str(root / "train.parquet"), "val": str(root / "train.parquet"),
            "reward": None}


@pytest.fixture(scope="module")
def arithmetic_task(tmp_path_factory):
    """The small tool task, its rows run by the look-alike verl loop (agent_name react_agent)."""
    return small_tool_task(tmp_path_factory.mktemp("arithmetic"), "react_agent")


def tool_task_run_config(task, run_dir: str, tools_yaml: str, loops_yaml: str, default_loop: str):
    """The built-in tool task's 2-step CPU run (async mode, multi-turn, two user turns) driven by `default_loop` of
    the agent-loop YAML; temperature 0.5 keeps mostly the warm start's tool call and copied answer."""
    from test_e2e_training import make_config

    return make_config(
        task, run_dir, "custom_reward_function.path=null", "data.max_prompt_length=48",
        "data.max_response_length=96", "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true",
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.rollout.agent.num_workers=2",
        "actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_user_turns=2",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools_yaml}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops_yaml}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={default_loop}",
        "actor_rollout_ref.rollout.temperature=0.5")


@pytest.mark.slow
def test_the_builtin_tool_task_trains_two_steps_driven_by_a_verl_loop(ray_local, arithmetic_task, verl_files,
                                                                      tmp_path, monkeypatch):
    from test_async_rollout import fit_keeping_update_batches
    from test_e2e_training import read_metrics

    monkeypatch.setenv("PYTHONPATH", f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    loops = write_yaml(tmp_path / "loops.yaml", "- name: react_agent\n  _target_: verl_style_agent.ReactAgentLoop\n")
    config = tool_task_run_config(arithmetic_task, str(tmp_path), verl_files["tools"], loops, "react_agent")
    trainer, batches = fit_keeping_update_batches(config)
    steps = read_metrics(str(tmp_path))
    assert len(steps) == 2 and all(step["agent_loop/num_failed"] == 0 for step in steps)
    tool_calls = 0
    for batch in batches:
        attention = batch.batch["attention_mask"][:, -batch.batch["responses"].shape[1]:].bool()
        for row in range(len(batch)):
            text = trainer.tokenizer.decode(batch.batch["responses"][row][attention[row]], skip_special_tokens=True)
            product = batch.non_tensor_batch["reward_model"][row]["ground_truth"]
            answers = re.findall(r"The answer is (-?\d+)", text)
            assert batch.batch["token_level_scores"][row].sum().item() == float(bool(answers) and answers[-1] == product)
            # each tool answer equal to the question's product earned 1: its ground truth came from tools_kwargs
            answered = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
            assert batch.non_tensor_batch["tool_rewards"][row] == [float(value == product) for value in answered]
            tool_calls += len(answered)
    assert tool_calls > 0 and sum(step["critic/score/mean"] for step in steps) > 0
    assert sum(step["timing_s/agent_loop/generate_sequences/mean"] for step in steps) > 0
