"""main_sft / FSDPSFTTrainer on real gloo ranks: the loss falls, 1 rank == 2 ranks, the saved HF dir is the model."""
import json
import os
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridrl.config.validation import ConfigError
from hybridrl.trainer.main_sft import compose_sft_config, run_sft
from hybridrl.data.sft_dataset import IGNORE_INDEX, SFTDataset, collate_right_padded
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer

STEPS = 20


def conversation(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"<answer>{a + b}</answer>"}]


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    train = [conversation(a, b) for a in range(8) for b in range(8)]           # 64 rows
    val = [conversation(a, 9) for a in range(10)] + [conversation(9, b) for b in range(9)]  # 19 rows: padding slots
    for name, rows in (("train", train), ("val", val)):
        pq.write_table(pa.Table.from_pylist([{"messages": messages} for messages in rows]), str(root / f"{name}.parquet"))
    texts = [f"{m['role']}\n{m['content']}" for messages in train + val for m in messages]
    model_dir = build_tiny_model(str(root / "init"), build_tokenizer(texts, vocab_size=200), hidden_size=32,
                                 num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    return root, model_dir


def sft_config(root, model_dir, out_name, ranks, **extra):
    overrides = {"data.train_files": str(root / "train.parquet"), "data.val_files": str(root / "val.parquet"),
                 "data.train_batch_size": 16, "data.micro_batch_size_per_gpu": 4, "model.partial_pretrain": model_dir,
                 "optim.lr": 2e-2, "optim.warmup_steps_ratio": 0.0, "trainer.total_training_steps": STEPS,
                 "trainer.total_epochs": 5, "trainer.logger": ["jsonl"], "trainer.n_gpus_per_node": ranks,
                 "trainer.device": "cpu", "trainer.default_local_dir": str(root / out_name), **extra}
    return compose_sft_config(overrides)


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def two_rank_run(sft_inputs):
    root, model_dir = sft_inputs
    return run_sft(sft_config(root, model_dir, "two_ranks", ranks=2)), read_metrics(root / "two_ranks")


def test_two_gloo_ranks_lower_the_loss_and_save_a_loadable_hf_dir(two_rank_run, sft_inputs):
    model_dir, metrics = two_rank_run
    root, _ = sft_inputs
    assert model_dir == str(root / "two_ranks" / f"global_step_{STEPS}")
    assert [row["step"] for row in metrics] == list(range(1, STEPS + 1))
    first, last = metrics[0]["train/loss"], metrics[-1]["train/loss"]
    assert last < 0.6 * first, f"loss went {first} -> {last}"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template is not None and model.generation_config.eos_token_id == tokenizer.eos_token_id
    # The saved weights are the trained ones: their validation loss, computed here in one process over every
    # row once, is the val/loss the two ranks reported after the last step.
    val = SFTDataset(str(root / "val.parquet"), tokenizer, "messages", max_length=128, truncation="error")
    batch = collate_right_padded([val[i] for i in range(len(val))], tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                               ignore_index=IGNORE_INDEX)
    assert metrics[-1]["val/loss"] == pytest.approx(expected.item(), rel=1e-4)
    assert metrics[-1]["val/loss"] < metrics[0]["train/loss"]


def test_one_rank_and_two_ranks_take_the_same_steps(two_rank_run, sft_inputs, temp_folder):
    root, model_dir = sft_inputs
    run_sft(sft_config(root, model_dir, "one_rank", ranks=1))
    assert os.listdir(temp_folder) == []  # a launch that succeeds leaves nothing either
    one_rank = [row["train/loss"] for row in read_metrics(root / "one_rank")]
    two_ranks = [row["train/loss"] for row in two_rank_run[1]]
    # The same global batches (the sampler deals one permutation round robin) and a loss normalised by the
    # global token count: identical steps up to float summation order.
    assert one_rank[0] == pytest.approx(two_ranks[0], rel=1e-6)
    assert one_rank == pytest.approx(two_ranks, rel=1e-3)


@pytest.fixture
def temp_folder(tmp_path, monkeypatch):
    """This process's temp folder, of this test alone: what a launch leaves in it (torch's launcher, left to itself:
    a torchelastic_* log folder, the failed ranks' pytorch-errorfile-*.pickle) is this launch's."""
    folder = tmp_path / "temp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_an_error_inside_a_rank_reaches_the_caller_and_the_launch_leaves_nothing_behind(sft_inputs, temp_folder):
    root, model_dir = sft_inputs
    config = sft_config(root, model_dir, "too_long", ranks=2, **{"data.max_length": 8})
    with pytest.raises(ChildFailedError, match=r"train\.parquet row 0: \d+ tokens, longer than data\.max_length=8"):
        run_sft(config)
    assert os.listdir(temp_folder) == []


def test_config_problems_are_reported_before_any_rank_starts(sft_inputs, tmp_path):
    root, model_dir = sft_inputs
    with pytest.raises(ConfigError) as err:
        sft_config(root, model_dir, "x", ranks=2, **{
            "data.train_batch_size": 15, "data.multiturn.enable": False, "model.partial_pretrain": str(tmp_path),
            "trainer.logger": ["console", "stdout"]})
    assert sorted(err.value.problems) == sorted([
        "data.multiturn.enable: expected true (rows of chat messages), got false; single-turn prompt/response rows "
        "are not supported: write them as messages (examples/data_preprocess/sft_from_rl.py does it for RL parquet)",
        "data.train_batch_size: expected a multiple of the 2 ranks (trainer.nnodes x trainer.n_gpus_per_node), got 15",
        f"model.partial_pretrain: expected a local model directory containing config.json, got {str(tmp_path)!r}",
        "trainer.logger: expected names from ['console', 'jsonl', 'mlflow', 'tensorboard', 'wandb'], got ['stdout']",
    ])
    with pytest.raises(ConfigError, match=r"data.micro_batch_size_per_gpu: expected a divisor of the per-rank batch 8"):
        sft_config(root, model_dir, "x", ranks=2, **{"data.micro_batch_size_per_gpu": 3})
