"""SFTDataset: labels on exactly the assistant tokens, truncation rules, errors that name the row."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridrl.data.sft_dataset import IGNORE_INDEX, SFTDataset, collate_right_padded
from hybridrl.defaults.tiny_model import build_tokenizer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "what is 2+3?"},
    {"role": "assistant", "content": "<answer>5</answer>"},
    {"role": "user", "content": "and 2+4?"},
    {"role": "assistant", "content": "6"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["system\nBe brief.", "user\nwhat is 2+3?", "assistant\n<answer>5</answer>"], vocab_size=300)


def write_rows(path, conversations, key="messages"):
    pq.write_table(pa.Table.from_pylist([{key: messages} for messages in conversations]), str(path))
    return str(path)


def test_labels_are_exactly_the_assistant_turns_up_to_eos(tmp_path, tokenizer):
    path = write_rows(tmp_path / "sft.parquet", [CONVERSATION])
    item = SFTDataset(path, tokenizer, "messages", max_length=128, truncation="error")[0]
    tokens = tokenizer.convert_ids_to_tokens(item["input_ids"].tolist())
    # ChatML, tokenized by hand: the header "<|im_start|>assistant\n" and the "\n" after <|im_end|> are context.
    assert tokens == [
        "<|im_start|>", "system", "Ċ", "Be", "Ġbrief", ".", "<|im_end|>", "Ċ",
        "<|im_start|>", "user", "Ċ", "what", "Ġis", "Ġ", "2", "+", "3", "?", "<|im_end|>", "Ċ",
        "<|im_start|>", "assistant", "Ċ", "<", "answer", ">", "5", "</", "answer", ">", "<|im_end|>", "Ċ",
        "<|im_start|>", "user", "Ċ", "an", "d", "Ġ", "2", "+", "4", "?", "<|im_end|>", "Ċ",
        "<|im_start|>", "assistant", "Ċ", "6", "<|im_end|>", "Ċ"]
    labelled = [position for position, label in enumerate(item["labels"].tolist()) if label != IGNORE_INDEX]
    assert labelled == list(range(23, 31)) + [47, 48]
    assert item["labels"][labelled].tolist() == item["input_ids"][labelled].tolist()


def test_truncation_error_names_file_row_and_length(tmp_path, tokenizer):
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "6"}]
    path = write_rows(tmp_path / "sft.parquet", [short, CONVERSATION])
    with pytest.raises(ValueError, match=r"sft\.parquet row 1: 50 tokens, longer than data\.max_length=20"):
        SFTDataset(path, tokenizer, "messages", max_length=20, truncation="error")


def test_left_and_right_truncation_keep_the_named_end(tmp_path, tokenizer):
    path = write_rows(tmp_path / "sft.parquet", [CONVERSATION])
    full = SFTDataset(path, tokenizer, "messages", max_length=128, truncation="error")[0]
    right = SFTDataset(path, tokenizer, "messages", max_length=31, truncation="right")[0]
    left = SFTDataset(path, tokenizer, "messages", max_length=10, truncation="left")[0]
    assert torch.equal(right["input_ids"], full["input_ids"][:31]) and torch.equal(right["labels"], full["labels"][:31])
    assert torch.equal(left["input_ids"], full["input_ids"][-10:]) and torch.equal(left["labels"], full["labels"][-10:])


def test_row_left_without_assistant_tokens_is_an_error(tmp_path, tokenizer):
    path = write_rows(tmp_path / "sft.parquet", [CONVERSATION])
    with pytest.raises(ValueError, match=r"row 0: no assistant token to train on after truncation=right"):
        SFTDataset(path, tokenizer, "messages", max_length=20, truncation="right")
    no_answer = write_rows(tmp_path / "user_only.parquet", [[{"role": "user", "content": "hi"}]])
    with pytest.raises(ValueError, match=r"row 0: no assistant token to train on \(the conversation has no"):
        SFTDataset(no_answer, tokenizer, "messages", max_length=128, truncation="error")


def test_bad_layout_names_column_and_row(tmp_path, tokenizer):
    path = write_rows(tmp_path / "sft.parquet", [CONVERSATION], key="conversation")
    with pytest.raises(KeyError, match=r"no column 'messages' \(data.multiturn.messages_key\)"):
        SFTDataset(path, tokenizer, "messages", max_length=128, truncation="error")
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": CONVERSATION}, {"messages": [{"role": "user", "text": "x"}]}]),
                   str(bad))
    with pytest.raises(ValueError, match=r"bad\.parquet row 1: 'messages' must be a non-empty list"):
        SFTDataset(str(bad), tokenizer, "messages", max_length=128, truncation="error")


def test_collate_pads_on_the_right_and_ignores_padding():
    items = [{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([-100, 6, 7])},
             {"input_ids": torch.tensor([8]), "labels": torch.tensor([8])}]
    batch = collate_right_padded(items, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]
