"""Generations as text: decoding prompt/response rows, the per-step jsonl dumps, the validation sample choice."""
import json
import os

import pytest
import torch

from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.generation_dump import decode_generations, dump_generations, select_val_samples
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
    path = dump_generations(str(tmp_path / "dumps"), 3, [("q1", "a1", 0.25), ("q2", "a2", 1.0)])
    assert path == str(tmp_path / "dumps" / "3.jsonl")
    with open(path) as f:
        assert [json.loads(line) for line in f] == [{"input": "q1", "output": "a1", "score": 0.25, "step": 3},
                                                    {"input": "q2", "output": "a2", "score": 1.0, "step": 3}]
    dump_generations(str(tmp_path / "dumps"), 3, [("q3", "a3", 0.0)])  # a resumed run redoing step 3
    with open(path) as f:
        assert [json.loads(line)["input"] for line in f] == ["q3"]


def test_rollout_dumps_stop_at_their_size_limit_and_say_where(tmp_path, caplog):
    directory, max_mb = str(tmp_path / "dumps"), 100 / 2 ** 20  # 100 bytes: room for two one-sample steps
    written = [dump_generations(directory, step, [("q", "a", 1.0)], max_mb=max_mb) for step in (1, 2, 3, 4)]
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
