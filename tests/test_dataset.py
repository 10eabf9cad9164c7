"""RLHFDataset: chat template, left padding, truncation modes, metadata columns, collation, seeded loading."""
import pytest
import torch
from omegaconf import OmegaConf

from hybridrl.protocol import DataProto
from hybridrl.data.rl_dataset import RLHFDataset, collate_fn, make_dataloader
from hybridrl.data.rl_parquet import write_rl_parquet
from hybridrl.utils.tokenizer import load_tokenizer
from hybridrl.defaults.tiny_model import build_tokenizer

QUESTIONS = ["what is 3 + 4 ?", "what is 12 + 30 + 5 ? think about it step by step", "2 + 2 ?"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(QUESTIONS * 5 + ["user assistant"] * 5)


def row(question, answer, index):
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": index}}


@pytest.fixture()
def train_file(tmp_path):
    path = str(tmp_path / "train.parquet")
    write_rl_parquet([row(q, str(i), 100 + i) for i, q in enumerate(QUESTIONS)], path)
    return path


def data_config(**overrides):
    config = {"prompt_key": "prompt", "max_prompt_length": 32, "truncation": "error", "return_raw_chat": False,
              "return_full_prompt": False, "filter_overlong_prompts": False}
    return OmegaConf.create({**config, **overrides})


def templated_ids(tokenizer, question):
    """The chat template written out by hand, so the test does not trust apply_chat_template."""
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_item_is_templated_and_left_padded(tokenizer, train_file):
    item = RLHFDataset(train_file, tokenizer, data_config())[0]
    ids = templated_ids(tokenizer, QUESTIONS[0])
    pad = 32 - len(ids)
    assert pad > 0
    assert item["input_ids"].tolist() == [tokenizer.pad_token_id] * pad + ids
    assert item["attention_mask"].tolist() == [0] * pad + [1] * len(ids)
    assert item["position_ids"].tolist() == [0] * pad + list(range(len(ids)))
    assert item["raw_prompt_ids"] == ids
    assert tokenizer.decode(item["input_ids"][pad:]).endswith("<|im_start|>assistant\n")  # generation prompt added


def test_item_carries_the_row_metadata(tokenizer, train_file):
    item = RLHFDataset(train_file, tokenizer, data_config(return_raw_chat=True, return_full_prompt=True))[1]
    assert item["data_source"] == "openai/gsm8k" and item["ability"] == "math"
    assert item["reward_model"] == {"style": "rule", "ground_truth": "1"}
    assert item["extra_info"] == {"split": "train", "index": 101}
    assert item["index"] == 101  # from extra_info
    assert item["raw_prompt"] == [{"role": "user", "content": QUESTIONS[1]}]
    assert item["full_prompts"] == f"<|im_start|>user\n{QUESTIONS[1]}<|im_end|>\n<|im_start|>assistant\n"
    assert "prompt" not in item
    plain = RLHFDataset(train_file, tokenizer, data_config())[1]
    assert "raw_prompt" not in plain and "full_prompts" not in plain


def test_truncation_left_right_and_error(tokenizer, train_file):
    long_ids = templated_ids(tokenizer, QUESTIONS[1])
    limit = len(long_ids) - 5
    left = RLHFDataset(train_file, tokenizer, data_config(max_prompt_length=limit, truncation="left"))[1]
    right = RLHFDataset(train_file, tokenizer, data_config(max_prompt_length=limit, truncation="right"))[1]
    assert left["input_ids"].tolist() == long_ids[-limit:]
    assert right["input_ids"].tolist() == long_ids[:limit]
    assert left["attention_mask"].tolist() == [1] * limit

    strict = RLHFDataset(train_file, tokenizer, data_config(max_prompt_length=limit))
    assert strict[0]["input_ids"].shape == (limit,)  # short rows are fine
    with pytest.raises(ValueError) as error:
        strict[1]
    assert f"train.parquet row 1 (dataset index 1): prompt is {len(long_ids)} tokens" in str(error.value)
    assert f"max_prompt_length={limit}" in str(error.value)


def test_error_names_the_file_of_a_later_file_row(tokenizer, train_file, tmp_path):
    second = str(tmp_path / "second.parquet")
    write_rl_parquet([row(QUESTIONS[2], "4", 7), row(QUESTIONS[1], "47", 8)], second)
    limit = len(templated_ids(tokenizer, QUESTIONS[0]))
    dataset = RLHFDataset([train_file, second], tokenizer, data_config(max_prompt_length=limit))
    assert len(dataset) == 5
    assert dataset[3]["index"] == 7
    with pytest.raises(ValueError, match=r"second\.parquet row 1 \(dataset index 4\)"):
        dataset[4]


def test_filter_overlong_prompts_drops_rows(tokenizer, train_file, capsys):
    limit = len(templated_ids(tokenizer, QUESTIONS[0]))
    dataset = RLHFDataset(train_file, tokenizer, data_config(max_prompt_length=limit, filter_overlong_prompts=True))
    assert [dataset[i]["index"] for i in range(len(dataset))] == [100, 102]
    assert "kept 2 of 3 rows" in capsys.readouterr().out


def test_config_and_file_errors(tokenizer, train_file, tmp_path):
    with pytest.raises(KeyError, match="data.max_prompt_length"):
        RLHFDataset(train_file, tokenizer, OmegaConf.create({"prompt_key": "prompt", "truncation": "error"}))
    with pytest.raises(ValueError, match="data.truncation must be one of"):
        RLHFDataset(train_file, tokenizer, data_config(truncation="middle"))
    with pytest.raises(KeyError, match=r"has no column 'question' \(data.prompt_key\)"):
        RLHFDataset(train_file, tokenizer, data_config(prompt_key="question"))
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        RLHFDataset(str(tmp_path / "missing.parquet"), tokenizer, data_config())


def test_collate_fn_feeds_dataproto(tokenizer, train_file):
    dataset = RLHFDataset(train_file, tokenizer, data_config())
    batch = collate_fn([dataset[i] for i in range(3)])
    assert batch["input_ids"].shape == (3, 32) and batch["input_ids"].dtype == torch.long
    assert batch["reward_model"].dtype == object and batch["reward_model"].shape == (3,)
    assert batch["raw_prompt_ids"].shape == (3,)  # lists stay one object per row, never a 2-D array
    data = DataProto.from_single_dict(batch)
    assert len(data) == 3
    assert [rm["ground_truth"] for rm in data.non_tensor_batch["reward_model"]] == ["0", "1", "2"]
    assert list(data.non_tensor_batch["index"]) == [100, 101, 102]
    assert torch.equal(data.batch["attention_mask"], torch.stack([dataset[i]["attention_mask"] for i in range(3)]))


def test_dataloader_is_seeded_and_deterministic(tokenizer, tmp_path):
    path = str(tmp_path / "many.parquet")
    write_rl_parquet([row(QUESTIONS[i % 3], str(i), i) for i in range(10)], path)
    dataset = RLHFDataset(path, tokenizer, data_config())

    def order(seed, shuffle=True, drop_last=True):
        loader = make_dataloader(dataset, batch_size=4, shuffle=shuffle, seed=seed, drop_last=drop_last)
        return [list(batch["index"]) for batch in loader]

    first = order(seed=1)
    assert first == order(seed=1)
    assert len(first) == 2 and all(len(b) == 4 for b in first)  # 10 rows, drop_last: 2 full batches
    assert order(seed=1) != order(seed=2)
    assert order(seed=1, shuffle=False, drop_last=False) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    loader = make_dataloader(dataset, batch_size=4, shuffle=True, seed=1, drop_last=True)
    epoch_one, epoch_two = [list(b["index"]) for b in loader], [list(b["index"]) for b in loader]
    assert epoch_one == first and epoch_two != epoch_one  # each epoch reshuffles, deterministically
    assert isinstance(loader.sampler.generator.get_state(), torch.Tensor)  # saveable for resume


def test_dataloader_workers_give_the_same_batches(tokenizer, tmp_path):
    """data.dataloader_num_workers: worker processes tokenise and collate; the order stays the sampler's."""
    path = str(tmp_path / "many.parquet")
    write_rl_parquet([row(QUESTIONS[i % 3], str(i), i) for i in range(10)], path)
    dataset = RLHFDataset(path, tokenizer, data_config())
    loader = make_dataloader(dataset, batch_size=4, shuffle=True, seed=3, drop_last=False, num_workers=2)
    # spawned, not forked: a fork copies the gRPC threads of the Ray in this process (make_dataloader's docstring)
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    assert loader.dataset.rows is dataset.rows and len(loader.dataset) == 10  # reads pass through _ByValue
    in_process = list(make_dataloader(dataset, batch_size=4, shuffle=True, seed=3, drop_last=False))
    with_workers, second_epoch = list(loader), list(loader)
    assert [list(b["index"]) for b in with_workers] == [list(b["index"]) for b in in_process]
    assert [list(b["index"]) for b in second_epoch] != [list(b["index"]) for b in with_workers]  # reshuffled
    for ours, theirs in zip(with_workers, in_process):
        assert torch.equal(ours["input_ids"], theirs["input_ids"])
        assert torch.equal(ours["attention_mask"], theirs["attention_mask"])


def test_custom_chat_template_replaces_the_tokenizers_own(tokenizer, train_file, tmp_path):
    """actor_rollout_ref.model.custom_chat_template: every process that loads the policy's tokenizer
    (load_tokenizer) renders prompts with it."""
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    template = "{% for m in messages %}{{ m['content'] }} = {% endfor %}"
    custom = load_tokenizer(str(tmp_path / "tok"), custom_chat_template=template)
    assert custom.chat_template == template
    assert load_tokenizer(str(tmp_path / "tok")).chat_template == tokenizer.chat_template != template
    dataset = RLHFDataset(train_file, custom, data_config())
    ids = dataset[0]["input_ids"][dataset[0]["attention_mask"].bool()].tolist()
    assert ids == custom(QUESTIONS[0] + " = ", add_special_tokens=False)["input_ids"]
