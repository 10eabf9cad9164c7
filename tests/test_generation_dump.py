"""Generations as text: decoding prompt/response rows, the per-step jsonl dumps, the validation sample choice."""
import json
import os

import numpy as np
import pytest
import torch

from hybridrl.data.sample import Sample
from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.generation_dump import (decode_generations, dump_generations, filtered_records,
                                                  rollout_records, select_val_samples)
from hybridrl.defaults.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["hello world", "apple banana", "zebra"] * 20, vocab_size=120)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def padded_row(tokenizer, prompt, response, prompt_len, response_len, junk):
    """One row as generate_sequences lays it out: left-padded prompt, right-padded response (+ eos). The padding
    holds `junk` (a real word's token) instead of pad, so only the attention mask can tell it is not text."""
    prompt_ids, response_ids = ids(tokenizer, prompt), ids(tokenizer, response) + [tokenizer.eos_token_id]
    prompt_row = [junk] * (prompt_len - len(prompt_ids)) + prompt_ids
    response_row = response_ids + [junk] * (response_len - len(response_ids))
    mask = [0] * (prompt_len - len(prompt_ids)) + [1] * (len(prompt_ids) + len(response_ids)) \
        + [0] * (response_len - len(response_ids))
    return prompt_row, response_row, mask


def test_decode_uses_the_attention_mask_and_drops_special_tokens(tokenizer):
    junk = ids(tokenizer, "zebra")[0]
    rows = [padded_row(tokenizer, "hello world", "banana", 16, 16, junk),
            padded_row(tokenizer, "apple", "apple banana", 16, 16, junk)]
    batch = DataProto.from_dict({"prompts": torch.tensor([r[0] for r in rows]),
                                 "responses": torch.tensor([r[1] for r in rows]),
                                 "attention_mask": torch.tensor([r[2] for r in rows])})
    samples = decode_generations(tokenizer, batch, torch.tensor([0.5, 1.0]))
    assert [(i.strip(), o.strip(), s) for i, o, s in samples] == [("hello world", "banana", 0.5),
                                                                   ("apple", "apple banana", 1.0)]
    with pytest.raises(ValueError, match="1 scores for 2 rows"):
        decode_generations(tokenizer, batch, torch.tensor([0.5]))


def test_dump_writes_one_json_object_per_sample_and_replaces_the_steps_file(tmp_path):
    path = dump_generations(str(tmp_path / "dumps"), 3, [{"input": "q1", "output": "a1", "score": 0.25},
                                                          {"input": "q2", "output": "a2", "score": 1.0}])
    assert path == str(tmp_path / "dumps" / "3.jsonl")
    with open(path) as f:
        assert [json.loads(line) for line in f] == [{"input": "q1", "output": "a1", "score": 0.25, "step": 3},
                                                    {"input": "q2", "output": "a2", "score": 1.0, "step": 3}]
    dump_generations(str(tmp_path / "dumps"), 3, [{"input": "q3", "output": "a3", "score": 0.0}])  # a resumed run redoing step 3
    with open(path) as f:
        assert [json.loads(line)["input"] for line in f] == ["q3"]


def test_rollout_dumps_stop_at_their_size_limit_and_say_where(tmp_path, caplog):
    directory, max_mb = str(tmp_path / "dumps"), 100 / 2 ** 20  # 100 bytes: room for two one-sample steps
    written = [dump_generations(directory, step, [{"input": "q", "output": "a", "score": 1.0}], max_mb=max_mb) for step in (1, 2, 3, 4)]
    step_bytes = os.path.getsize(written[0])  # 54: {"input": "q", "output": "a", "score": 1.0, "step": 1}
    assert 50 <= step_bytes < 100 <= 2 * step_bytes
    assert written[2:] == [None, None] and sorted(os.listdir(directory)) == ["1.jsonl", "2.jsonl",
                                                                              "size_limit_reached.json"]
    with open(os.path.join(directory, "size_limit_reached.json")) as f:
        assert json.load(f) == {"first_step_not_dumped": 3, "dumped_bytes": 2 * step_bytes, "max_mb": max_mb}
    assert [r.getMessage() for r in caplog.records] == [
        f"{directory}: its dumps reached trainer.rollout_data_max_mb={max_mb} ({2 * step_bytes} bytes); steps from 3 "
        f"on are not dumped"]


def test_validation_samples_are_the_same_prompts_whatever_the_order():
    samples = [(f"prompt {i}", f"answer {i}", i / 10) for i in range(10)]
    chosen = select_val_samples(samples, 4)
    assert len(chosen) == 4 and len({c[0] for c in chosen}) == 4
    assert select_val_samples(list(reversed(samples)), 4) == chosen
    assert chosen != sorted(samples)[:4]  # shuffled, not just the first ones
    assert sorted(select_val_samples(samples, 50)) == sorted(samples)


def test_rollout_records_carry_reward_advantage_tokens_group_and_the_tools_turns(tokenizer):
    """Row 0 is single-turn; row 1's middle word came from a tool (response_mask 0 there), so its record is cut
    into the policy's and the tool's pieces. Reward = score + a KL penalty; advantage = the mean over trained
    tokens (the tool's token, advantage 9.0, is not trained and must not count)."""
    junk = ids(tokenizer, "zebra")[0]
    rows = [padded_row(tokenizer, "hello world", "banana", 40, 40, junk),
            padded_row(tokenizer, "apple", "apple hello banana", 40, 40, junk)]
    attention = torch.tensor([r[2] for r in rows])
    written = attention[:, 40:]
    response_mask = written.clone()
    tool_tokens = len(ids(tokenizer, "apple")), len(ids(tokenizer, "apple hello"))
    response_mask[1, tool_tokens[0]:tool_tokens[1]] = 0
    scores = torch.zeros(2, 40)
    scores[0, 1], scores[1, 3] = 1.0, 0.5
    advantages = torch.where(response_mask.bool(), torch.tensor([[0.5], [-0.25]]), torch.tensor(9.0))
    batch = DataProto.from_dict({"prompts": torch.tensor([r[0] for r in rows]),
                                 "responses": torch.tensor([r[1] for r in rows]),
                                 "attention_mask": attention, "response_mask": response_mask,
                                 "token_level_scores": scores, "token_level_rewards": scores - 0.125 * written,
                                 "advantages": advantages},
                                non_tensors={"uid": np.array(["g0", "g1"], dtype=object)})
    first, second = rollout_records(tokenizer, batch)
    assert (first["output"].strip(), first["score"], first["group"]) == ("banana", 1.0, "g0")
    assert first["reward"] == pytest.approx(1.0 - 0.125 * int(written[0].sum()))
    assert (first["advantage"], first["response_tokens"]) == (0.5, int(written[0].sum()))
    assert "turns" not in first
    assert second["advantage"] == -0.25 and second["response_tokens"] == int(written[1].sum())
    assert [(turn["by"], turn["text"].strip()) for turn in second["turns"]] == [
        ("policy", "apple"), ("tool", "hello"), ("policy", "banana")]


def test_rollout_records_name_the_version_each_samples_generation_started_under(tokenizer):
    """started_version: the oldest version among a row's generated tokens (a sample continued after an abort spans
    versions 2 and 3: it started under 2), inserted tokens (-1) not counted; a batch without versions has none."""
    from hybridrl.data.batch_layout import WEIGHT_VERSIONS_KEY

    junk = ids(tokenizer, "zebra")[0]
    rows = [padded_row(tokenizer, "hello", "banana apple", 40, 40, junk),
            padded_row(tokenizer, "apple", "hello", 40, 40, junk)]
    attention = torch.tensor([r[2] for r in rows])
    versions = torch.full((2, 40), -1)
    versions[0, :3] = torch.tensor([3, 2, 3])  # continued: started under 2
    versions[1, 0], versions[1, 2] = 5, 5  # a tool token (-1) between
    tensors = {"prompts": torch.tensor([r[0] for r in rows]), "responses": torch.tensor([r[1] for r in rows]),
               "attention_mask": attention, "token_level_scores": torch.zeros(2, 40)}
    first, second = rollout_records(tokenizer, DataProto.from_dict({**tensors, WEIGHT_VERSIONS_KEY: versions}))
    assert (first["started_version"], second["started_version"]) == (2, 5)
    assert "started_version" not in rollout_records(tokenizer, DataProto.from_dict(tensors))[0]


def test_filtered_records_mark_a_dropped_groups_samples_and_leave_out_its_baseline(tokenizer):
    prompt, answer, tool = ids(tokenizer, "apple"), ids(tokenizer, "banana"), ids(tokenizer, "hello")
    group = [Sample(group_index=7, index=0, prompt_ids=prompt, response_ids=answer, loss_mask=[1] * len(answer),
                    reward=0.0),
             Sample(group_index=7, index=1, prompt_ids=prompt, response_ids=answer + tool + answer,
                    loss_mask=[1] * len(answer) + [0] * len(tool) + [1] * len(answer), reward=0.0),
             Sample(group_index=7, index=2, prompt_ids=prompt, response_ids=answer, loss_mask=[1] * len(answer),
                    reward=0.0, is_baseline=True)]
    first, second = filtered_records(tokenizer, [group])  # two: the baseline is not a sampled response
    assert (first["input"].strip(), first["output"].strip(), first["score"]) == ("apple", "banana", 0.0)
    assert (first["group"], first["filtered"], first["response_tokens"]) == ("7", True, len(answer))
    assert "turns" not in first
    assert [(turn["by"], turn["text"].strip()) for turn in second["turns"]] == [
        ("policy", "banana"), ("tool", "hello"), ("policy", "banana")]
