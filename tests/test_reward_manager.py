"""The naive reward manager: decoded responses, score on the last valid token, extras, custom functions."""
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from hybridrl.protocol import DataProto
from hybridrl.utils.import_utils import load_extern_object
from hybridrl.defaults.tiny_model import build_tokenizer
from hybridrl.reward.managers.base import rewards_on_last_tokens
from hybridrl.reward.managers import (NaiveRewardManager, get_reward_manager_cls, load_reward_manager,
                                      register_reward_manager)

PROMPT_LEN, RESPONSE_LEN = 6, 12


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["#### 7 so 7 then #### 8 and 12 is the answer", "what is 3 + 4 ? so the sum"] * 5)


def make_batch(tokenizer, prompts, responses, data_sources, ground_truths, extra_infos=None):
    """Left-padded prompts and right-padded responses, as a rollout returns them."""
    prompt_rows, response_rows, masks = [], [], []
    for prompt, response in zip(prompts, responses):
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][-PROMPT_LEN:]
        r_ids = tokenizer(response, add_special_tokens=False)["input_ids"][:RESPONSE_LEN]
        pad = tokenizer.pad_token_id
        prompt_rows.append([pad] * (PROMPT_LEN - len(p_ids)) + p_ids)
        response_rows.append(r_ids + [pad] * (RESPONSE_LEN - len(r_ids)))
        prompt_mask = [0] * (PROMPT_LEN - len(p_ids)) + [1] * len(p_ids)
        masks.append(prompt_mask + [1] * len(r_ids) + [0] * (RESPONSE_LEN - len(r_ids)))
    non_tensors = {"data_source": data_sources, "reward_model": [{"ground_truth": g} for g in ground_truths]}
    if extra_infos is not None:
        non_tensors["extra_info"] = extra_infos
    prompts_t, responses_t = torch.tensor(prompt_rows), torch.tensor(response_rows)
    return DataProto.from_dict(
        tensors={"prompts": prompts_t, "responses": responses_t, "input_ids": torch.cat([prompts_t, responses_t], 1),
                 "attention_mask": torch.tensor(masks)},
        non_tensors=non_tensors)


def response_lengths(tokenizer, responses):
    return [len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in responses]


def test_score_lands_on_last_valid_token_of_right_padded_responses(tokenizer):
    responses = ["#### 7", "so 7 then #### 8<|im_end|>", "so #### 3"]
    batch = make_batch(tokenizer, ["what is 3 + 4 ?"] * 3, responses, ["openai/gsm8k"] * 3, ["7", "8", "4"])
    rewards = NaiveRewardManager(tokenizer, num_examine=0)(batch)

    lengths = response_lengths(tokenizer, responses)
    assert len(set(lengths)) == 3 and max(lengths) < RESPONSE_LEN  # really different lengths, really padded
    expected = torch.zeros(3, RESPONSE_LEN)
    expected[0, lengths[0] - 1] = 1.0
    expected[1, lengths[1] - 1] = 1.0  # on the EOS token, the last valid one
    assert rewards.dtype == torch.float32
    assert torch.equal(rewards, expected)


def test_rewards_on_last_tokens_writes_each_row_once_as_float32():
    """Row i gets rewards[i] at column lengths[i] - 1 and zeros elsewhere, rounded to float32 as a per-element
    write rounds it (0.1 is no float32)."""
    responses = torch.zeros(3, 4, dtype=torch.long)
    placed = rewards_on_last_tokens(responses, [0.1, -2.0, 1], [4, 1, 2])
    assert placed.dtype == torch.float32
    assert placed.tolist() == [[0.0, 0.0, 0.0, torch.tensor(0.1, dtype=torch.float32).item()],
                               [-2.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]


def test_compute_score_gets_decoded_text_and_extra_info(tokenizer):
    calls = []

    def record(data_source, solution_str, ground_truth, extra_info):
        calls.append((data_source, solution_str, ground_truth, extra_info))
        return float(len(solution_str))

    responses = ["#### 7<|im_end|>", "the answer is 12"]
    batch = make_batch(tokenizer, ["what is 3 + 4 ?", "so"], responses, ["a", "b"], ["7", "12"],
                       extra_infos=[{"index": 0}, {"index": 1}])
    rewards = NaiveRewardManager(tokenizer, num_examine=0, compute_score=record)(batch)

    assert calls == [("a", "#### 7", "7", {"index": 0}), ("b", "the answer is 12", "12", {"index": 1})]
    lengths = response_lengths(tokenizer, responses)
    assert rewards[0, lengths[0] - 1] == 6.0 and rewards[1, lengths[1] - 1] == 16.0
    assert rewards.sum() == 22.0


def test_a_custom_score_adds_the_agent_loops_tool_rewards_from_extra_info(tokenizer):
    """verl's extra_info keys for multi-turn: num_turns, tool_rewards, rollout_reward_scores (calc_reward)."""
    def score_plus_tools(data_source, solution_str, ground_truth, extra_info):
        return float(solution_str.strip().endswith(ground_truth)) + 0.1 * sum(extra_info["tool_rewards"]) \
            + extra_info["rollout_reward_scores"].get("calculator", 0.0) + 0.01 * extra_info["num_turns"]

    responses = ["#### 7<|im_end|>", "the answer is 12"]
    batch = make_batch(tokenizer, ["what is 3 + 4 ?", "so"], responses, ["a", "b"], ["7", "3"],
                       extra_infos=[{"index": 0}, None])
    columns = {"__num_turns__": [4, 2], "tool_rewards": [[1.0, 0.5], []], "reward_scores": [{"calculator": 0.25}, {}]}
    for name, values in columns.items():
        batch.non_tensor_batch[name] = np.empty(2, dtype=object)
        batch.non_tensor_batch[name][:] = values
    rewards = NaiveRewardManager(tokenizer, num_examine=0, compute_score=score_plus_tools)(batch)

    assert rewards.sum(-1).tolist() == pytest.approx([1.0 + 0.15 + 0.25 + 0.04, 0.0 + 0.0 + 0.0 + 0.02])
    assert batch.non_tensor_batch["extra_info"][0] == {"index": 0}  # the batch's own column is not changed


def test_reward_fn_key_selects_the_dispatch_column(tokenizer):
    batch = make_batch(tokenizer, ["so"], ["#### 7"], ["ignored"], ["7"])
    batch.non_tensor_batch["my_source"] = np.array(["openai/gsm8k"], dtype=object)
    rewards = NaiveRewardManager(tokenizer, num_examine=0, reward_fn_key="my_source")(batch)
    assert rewards.sum() == 1.0


def test_dict_scores_become_reward_extra_info(tokenizer):
    def score_with_extras(data_source, solution_str, ground_truth, extra_info):
        correct = solution_str.strip().endswith(ground_truth)
        return {"score": 2.0 if correct else -1.0, "acc": correct, "pred": solution_str[-1]}

    responses = ["#### 7", "#### 8"]
    batch = make_batch(tokenizer, ["so", "so"], responses, ["x", "x"], ["7", "7"])
    out = NaiveRewardManager(tokenizer, num_examine=0, compute_score=score_with_extras)(batch, return_dict=True)

    assert set(out) == {"reward_tensor", "reward_extra_info", "reward_metrics"}
    assert out["reward_extra_info"] == {"acc": [True, False], "pred": ["7", "8"]}
    lengths = response_lengths(tokenizer, responses)
    assert out["reward_tensor"][0, lengths[0] - 1] == 2.0 and out["reward_tensor"][1, lengths[1] - 1] == -1.0
    assert out["reward_tensor"].sum() == 1.0


def test_dict_scores_must_agree_on_keys_and_have_score(tokenizer):
    batch = make_batch(tokenizer, ["so", "so"], ["#### 7", "#### 8"], ["x", "x"], ["7", "7"])
    keys_differ = lambda solution_str, **_: {"score": 1.0, **({"acc": 1} if "7" in solution_str else {})}
    with pytest.raises(ValueError, match="sample 1 returned extra keys"):
        NaiveRewardManager(tokenizer, 0, compute_score=keys_differ)(batch, return_dict=True)
    with pytest.raises(KeyError, match="without 'score'"):
        NaiveRewardManager(tokenizer, 0, compute_score=lambda **_: {"acc": 1.0})(batch)


def test_empty_response_is_an_error(tokenizer):
    batch = make_batch(tokenizer, ["so"], ["#### 7"], ["openai/gsm8k"], ["7"])
    batch.batch["attention_mask"][:, PROMPT_LEN:] = 0
    with pytest.raises(ValueError, match="sample 0 has an empty response"):
        NaiveRewardManager(tokenizer, num_examine=0)(batch)


def test_prints_num_examine_samples_per_data_source(tokenizer, capsys):
    batch = make_batch(tokenizer, ["so"] * 4, ["#### 7"] * 4, ["openai/gsm8k", "openai/gsm8k", "other", "other"],
                       ["7"] * 4)
    NaiveRewardManager(tokenizer, num_examine=1, compute_score=lambda **_: 0.5)(batch)
    printed = capsys.readouterr().out
    assert printed.count("[response] #### 7") == 2
    assert printed.count("[prompt] so") == 2 and printed.count("[score] 0.5") == 2


# ---------------------------------------------------------------------------------------------- loading

CUSTOM_REWARD_FILE = '''
def my_score(data_source, solution_str, ground_truth, extra_info=None):
    return 10.0 if solution_str == "#### " + ground_truth else -10.0
'''


def run_config(custom_path=None, manager="naive"):
    return OmegaConf.create({
        "data": {"reward_fn_key": "data_source"},
        "reward_model": {"reward_manager": manager, "max_concurrent": 4, "reward_kwargs": {}},
        "custom_reward_function": {"path": custom_path, "name": "my_score"},
    })


def test_load_reward_manager_with_custom_function_from_file(tokenizer, tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_REWARD_FILE)
    manager = load_reward_manager(run_config(str(path)), tokenizer, num_examine=0)
    assert isinstance(manager, NaiveRewardManager)

    responses = ["#### 7", "#### 8"]
    rewards = manager(make_batch(tokenizer, ["so", "so"], responses, ["unregistered/source"] * 2, ["7", "7"]))
    lengths = response_lengths(tokenizer, responses)
    assert rewards[0, lengths[0] - 1] == 10.0 and rewards[1, lengths[1] - 1] == -10.0


def test_load_reward_manager_without_custom_function_uses_builtin_scorers(tokenizer):
    manager = load_reward_manager(run_config(None), tokenizer, num_examine=0)
    rewards = manager(make_batch(tokenizer, ["so"], ["#### 7"], ["openai/gsm8k"], ["7"]))
    assert rewards.sum() == 1.0


def test_load_extern_object_errors_name_file_and_object(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_REWARD_FILE)
    assert load_extern_object(str(path), "my_score")("s", "#### 1", "1") == 10.0
    with pytest.raises(AttributeError, match=r"my_reward\.py defines no 'missing'.*my_score"):
        load_extern_object(str(path), "missing")
    with pytest.raises(FileNotFoundError, match="nope.py does not exist"):
        load_extern_object(str(tmp_path / "nope.py"), "my_score")


def test_reward_manager_registry(tokenizer):
    @register_reward_manager("test_constant")
    class ConstantRewardManager:
        def __init__(self, tokenizer, num_examine, compute_score=None, reward_fn_key="data_source"):
            self.reward_fn_key = reward_fn_key

    assert get_reward_manager_cls("naive") is NaiveRewardManager
    assert isinstance(load_reward_manager(run_config(None, "test_constant"), tokenizer, 0), ConstantRewardManager)
    with pytest.raises(ValueError, match=r"unknown reward_model.reward_manager 'nope'.*'naive'"):
        get_reward_manager_cls("nope")


def test_reasoning_gym_rows_through_dataset_collate_and_manager(tmp_path):
    """Preprocessed parquet -> RLHFDataset -> collate_fn -> DataProto -> naive manager -> library verifier."""
    from hybridrl.data.rl_dataset import RLHFDataset, collate_fn
    from hybridrl.reward.scorers.reasoning_gym import make_rows
    from hybridrl.data.rl_parquet import write_rl_parquet

    rows = make_rows("chain_sum", size=4, seed=0, split="train")
    write_rl_parquet(rows, str(tmp_path / "train.parquet"))
    tokenizer = build_tokenizer([r["prompt"][0]["content"] for r in rows] + ["<answer>0123456789-</answer>"])
    config = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 96, "truncation": "error",
                               "return_raw_chat": False, "return_full_prompt": False, "filter_overlong_prompts": False})
    dataset = RLHFDataset(str(tmp_path / "train.parquet"), tokenizer, config)
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(4)]))

    answers = [r["reward_model"]["ground_truth"] for r in rows]
    texts = [f"<answer>{answers[0]}</answer>", f"so <answer>{answers[1]}</answer><|im_end|>",
             f"<answer>{int(answers[2]) + 1}</answer>", answers[3]]
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, encoded))
    responses = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in encoded])
    response_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in encoded])
    batch.batch["prompts"] = batch.batch["input_ids"]
    batch.batch["responses"] = responses
    batch.batch["attention_mask"] = torch.cat([batch.batch["attention_mask"], response_mask], dim=1)

    rewards = NaiveRewardManager(tokenizer, num_examine=0)(batch)
    expected = torch.zeros(4, width)
    expected[0, len(encoded[0]) - 1] = 1.0
    expected[1, len(encoded[1]) - 1] = 1.0
    assert torch.equal(rewards, expected)
