"""Dataset options: filter_overlong_prompts, train/val_max_samples, prompt_key, reward_fn_key, data.custom_cls."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf

from hybridrl.config.compose import compose_config
from hybridrl.config.validation import validate_config
from hybridrl.protocol import DataProto
from hybridrl.data.rl_dataset import RLHFDataset, collate_fn, create_rl_dataset, make_dataloader
from hybridrl.defaults.tiny_model import build_tokenizer
from hybridrl.reward.managers import NaiveRewardManager

SHORT, LONG = "2 + 2 ?", "what is 12 + 30 + 5 ? think about it step by step and then answer"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer([SHORT, LONG] * 5 + ["user assistant"] * 5)


def prompt_tokens(tokenizer, question):
    """The chat template written out by hand."""
    return len(tokenizer(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n",
                         add_special_tokens=False)["input_ids"])


def write_rows(path, questions, prompt_column="prompt", source_column="data_source"):
    """verl's layout, except that the prompt and data-source columns may be named otherwise."""
    rows = [{source_column: "openai/gsm8k", prompt_column: [{"role": "user", "content": q}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"index": 10 + i}}
            for i, q in enumerate(questions)]
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def data_config(**overrides):
    config = {"prompt_key": "prompt", "reward_fn_key": "data_source", "max_prompt_length": 64, "truncation": "error",
              "return_raw_chat": False, "return_full_prompt": False, "filter_overlong_prompts": False,
              "custom_cls": {"path": None, "name": None}}
    return OmegaConf.create({**config, **overrides})


def indices(dataset):
    return [dataset[i]["index"] for i in range(len(dataset))]


def test_filter_overlong_prompts_then_max_samples(tokenizer, tmp_path, capsys):
    path = write_rows(tmp_path / "d.parquet", [SHORT, LONG, SHORT, LONG, SHORT])
    limit = prompt_tokens(tokenizer, SHORT)
    assert prompt_tokens(tokenizer, LONG) > limit

    filtered = RLHFDataset(path, tokenizer, data_config(max_prompt_length=limit, filter_overlong_prompts=True))
    assert indices(filtered) == [10, 12, 14]
    assert "filter_overlong_prompts kept 3 of 5 rows, dropped 2 whose prompt is longer than " \
           f"data.max_prompt_length={limit} tokens" in capsys.readouterr().out

    capped = RLHFDataset(path, tokenizer, data_config(max_prompt_length=limit, filter_overlong_prompts=True),
                         max_samples=2)
    assert indices(capped) == [10, 12]  # the cap counts rows that survived the filter
    assert "max_samples=2 keeps the first 2 of 3 rows" in capsys.readouterr().out


def test_max_samples_all_more_than_all_and_invalid(tokenizer, tmp_path):
    path = write_rows(tmp_path / "d.parquet", [SHORT, LONG, SHORT])
    assert indices(RLHFDataset(path, tokenizer, data_config(), max_samples=-1)) == [10, 11, 12]
    assert indices(RLHFDataset(path, tokenizer, data_config(), max_samples=10)) == [10, 11, 12]
    assert indices(RLHFDataset(path, tokenizer, data_config(), max_samples=1)) == [10]
    for bad in (0, -2):
        with pytest.raises(ValueError, match=rf"must be -1 \(all rows\) or a positive int, got {bad}"):
            RLHFDataset(path, tokenizer, data_config(), max_samples=bad)


def test_prompt_key_and_reward_fn_key_name_the_columns(tokenizer, tmp_path):
    path = write_rows(tmp_path / "d.parquet", [SHORT, LONG], prompt_column="question", source_column="my_source")
    config = data_config(prompt_key="question", reward_fn_key="my_source")
    dataset = RLHFDataset(path, tokenizer, config)
    item = dataset[0]
    assert int(item["attention_mask"].sum()) == prompt_tokens(tokenizer, SHORT)
    assert "question" not in item and item["my_source"] == "openai/gsm8k"

    # The column reaches the reward manager that dispatches on it.
    batch = DataProto.from_single_dict(collate_fn([dataset[0], dataset[1]]))
    answer = tokenizer("#### 4", add_special_tokens=False)["input_ids"]
    batch.batch["prompts"] = batch.batch["input_ids"]
    batch.batch["responses"] = torch.tensor([answer, answer])
    batch.batch["attention_mask"] = torch.cat([batch.batch["attention_mask"], torch.ones(2, len(answer))], 1)
    assert NaiveRewardManager(tokenizer, 0, reward_fn_key="my_source")(batch).sum() == 2.0

    with pytest.raises(KeyError, match=r"has no column 'data_source' \(data.reward_fn_key\)"):
        RLHFDataset(path, tokenizer, data_config(prompt_key="question"))


CUSTOM_DATASET_FILE = '''
from torch.utils.data import Dataset


class TinyDataset(Dataset):
    def __init__(self, data_files, tokenizer, config, max_samples):
        self.data_files, self.tokenizer, self.config, self.max_samples = data_files, tokenizer, config, max_samples

    def __len__(self):
        return 3 if self.max_samples == -1 else self.max_samples

    def __getitem__(self, index):
        return {"index": index}


class NotADataset:
    pass
'''


def test_create_rl_dataset_builtin_and_custom_class(tokenizer, tmp_path):
    path = write_rows(tmp_path / "d.parquet", [SHORT, LONG, SHORT])
    data = validate_config(compose_config(["actor_rollout_ref.model.path=unused", f"data.train_files={path}",
                                           f"data.val_files={path}", "data.max_prompt_length=64",
                                           "trainer.n_gpus_per_node=1"])).data
    builtin = create_rl_dataset(data.train_files, tokenizer, data, max_samples=2)
    assert isinstance(builtin, RLHFDataset) and indices(builtin) == [10, 11]

    custom_file = tmp_path / "my_dataset.py"
    custom_file.write_text(CUSTOM_DATASET_FILE)
    config = data_config(custom_cls={"path": str(custom_file), "name": "TinyDataset"})
    custom = create_rl_dataset([path], tokenizer, config, max_samples=2)
    assert type(custom).__name__ == "TinyDataset" and len(custom) == 2
    assert custom.data_files == [path] and custom.tokenizer is tokenizer and custom.config is config
    # spawned DataLoader workers get the class by value: its module is a file, not an importable name
    loader = make_dataloader(custom, batch_size=2, shuffle=False, seed=0, drop_last=False, num_workers=1)
    assert [batch["index"].tolist() for batch in loader] == [[0, 1]]

    with pytest.raises(TypeError, match="'NotADataset' in .*my_dataset.py must be a subclass of"):
        create_rl_dataset(path, tokenizer, data_config(custom_cls={"path": str(custom_file), "name": "NotADataset"}),
                          max_samples=-1)
    with pytest.raises(ValueError, match="data.custom_cls.name is empty"):
        create_rl_dataset(path, tokenizer, data_config(custom_cls={"path": str(custom_file), "name": None}),
                          max_samples=-1)
