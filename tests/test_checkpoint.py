"""Checkpoint mechanics: atomic publish, kill -9 safety, pointer fallback, pruning, FSDP2/FSDP sharded state on
2 gloo ranks (bitwise round trip, resharding to 1 rank) and the HF export of the model merger."""
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridrl.models.checkpoint import load_sharded_model_state, save_hf_config_and_tokenizer, save_sharded_model_state
from hybridrl.trainer.checkpoint_dir import (COMPLETE_MARKER_FILE, LATEST_POINTER_FILE, atomic_checkpoint_dir,
                                             checkpoint_step, find_latest_checkpoint, prune_checkpoints)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------------------------
# Directory mechanics
# ----------------------------------------------------------------------------------------------------------------

def _save(root, step, value, subdirs=("actor",)):
    """A checkpoint whose role files hold one tensor filled with `value`."""
    with atomic_checkpoint_dir(root, step) as tmp:
        for subdir in subdirs:
            os.makedirs(os.path.join(tmp, subdir))
            torch.save(torch.full((3,), float(value)), os.path.join(tmp, subdir, "w.pt"))
    return os.path.join(root, f"global_step_{step}")


def _value(step_dir, subdir="actor"):
    return torch.load(os.path.join(step_dir, subdir, "w.pt"))[0].item()


def _pointer(root):
    with open(os.path.join(root, LATEST_POINTER_FILE)) as f:
        return f.read()


def test_atomic_save_publishes_directory_then_pointer(tmp_path):
    root = str(tmp_path)
    path = _save(root, 1, 1.0)
    assert sorted(os.listdir(root)) == ["global_step_1", LATEST_POINTER_FILE]
    assert sorted(os.listdir(path)) == ["actor", COMPLETE_MARKER_FILE]
    assert _pointer(root) == "1"
    assert find_latest_checkpoint(root) == path
    assert checkpoint_step(path) == 1


def test_save_that_raises_leaves_previous_checkpoint_and_pointer(tmp_path):
    root = str(tmp_path)
    first = _save(root, 1, 1.0)
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_checkpoint_dir(root, 2) as tmp:
            os.makedirs(os.path.join(tmp, "actor"))
            torch.save(torch.full((3,), 2.0), os.path.join(tmp, "actor", "w.pt"))
            raise RuntimeError("disk full")
    assert not os.path.exists(os.path.join(root, "global_step_2"))
    assert _pointer(root) == "1"
    assert find_latest_checkpoint(root) == first and _value(first) == 1.0
    # The next save clears the half-written temporary directory (and a pointer write cut short) and succeeds.
    open(os.path.join(root, ".tmp_" + LATEST_POINTER_FILE), "w").close()
    second = _save(root, 2, 2.0)
    assert not any(name.startswith(".") for name in os.listdir(root))
    assert find_latest_checkpoint(root) == second and _value(second) == 2.0


def test_saving_the_same_step_again_replaces_it(tmp_path):
    root = str(tmp_path)
    _save(root, 3, 1.0)
    path = _save(root, 3, 7.0)
    assert _value(path) == 7.0 and sorted(os.listdir(root)) == ["global_step_3", LATEST_POINTER_FILE]


KILLED_SAVER = textwrap.dedent("""
    import os, sys, time, torch
    from hybridrl.trainer.checkpoint_dir import atomic_checkpoint_dir
    root = sys.argv[1]
    for step in (1, 2):
        with atomic_checkpoint_dir(root, step) as tmp:
            os.makedirs(os.path.join(tmp, "actor"))
            torch.save(torch.full((3,), float(step)), os.path.join(tmp, "actor", "w.pt"))
            if step == 2:  # a slow save: the parent kills us here
                print("saving step 2", flush=True)
                time.sleep(120)
""")


def test_process_killed_during_save_resumes_from_previous_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    saver = subprocess.Popen([sys.executable, "-c", KILLED_SAVER, root], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert saver.stdout.readline().strip() == "saving step 2"
        os.kill(saver.pid, signal.SIGKILL)
    finally:
        saver.wait(timeout=30)
    assert saver.returncode == -signal.SIGKILL
    assert os.path.isfile(os.path.join(root, ".tmp_global_step_2", "actor", "w.pt"))  # the kill hit mid-save
    latest = find_latest_checkpoint(root)
    assert latest == os.path.join(root, "global_step_1") and _value(latest) == 1.0
    assert _pointer(root) == "1"


def test_find_latest_falls_back_when_pointer_is_stale(tmp_path, caplog):
    root = str(tmp_path)
    assert find_latest_checkpoint(str(tmp_path / "missing")) is None
    assert find_latest_checkpoint(root) is None
    _save(root, 1, 1.0)
    second = _save(root, 2, 2.0)
    os.makedirs(os.path.join(root, ".tmp_global_step_9", "actor"))  # an interrupted save is never picked
    with open(os.path.join(root, LATEST_POINTER_FILE), "w") as f:
        f.write("5")
    with caplog.at_level(logging.WARNING):
        assert find_latest_checkpoint(root) == second
    assert "'5', which is not a complete checkpoint" in caplog.text
    os.remove(os.path.join(root, LATEST_POINTER_FILE))
    assert find_latest_checkpoint(root) == second
    os.remove(os.path.join(second, COMPLETE_MARKER_FILE))  # step 2 incomplete: step 1 is the newest complete
    assert find_latest_checkpoint(root) == os.path.join(root, "global_step_1")


def test_prune_keeps_the_newest_per_role(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3, 4):
        _save(root, step, step, subdirs=("actor", "critic"))
    assert prune_checkpoints(root, None) == [] and prune_checkpoints(root, -1) == []
    with pytest.raises(ValueError, match="max_to_keep"):
        prune_checkpoints(root, 0)

    deleted = prune_checkpoints(root, 1, subdir="actor")
    assert deleted == [os.path.join(root, f"global_step_{s}", "actor") for s in (1, 2, 3)]
    assert [os.path.isdir(os.path.join(root, f"global_step_{s}", "actor")) for s in (1, 2, 3, 4)] == \
        [False, False, False, True]
    assert find_latest_checkpoint(root) == os.path.join(root, "global_step_4")
    # Steps without their actor are no longer resumable, even if the pointer went stale.
    os.remove(os.path.join(root, LATEST_POINTER_FILE))
    assert find_latest_checkpoint(root) == os.path.join(root, "global_step_4")

    deleted = prune_checkpoints(root, 2, subdir="critic")  # each role keeps its own count
    assert deleted == [os.path.join(root, f"global_step_{s}", "critic") for s in (1, 2)]
    # Steps 1 and 2 lost every role directory, so they are gone; step 3 keeps its critic.
    assert sorted(os.listdir(root)) == ["global_step_3", "global_step_4"]
    assert sorted(os.listdir(os.path.join(root, "global_step_3"))) == [COMPLETE_MARKER_FILE, "critic"]
    assert prune_checkpoints(root, 1, subdir="actor") == []
    assert prune_checkpoints(root, 2, subdir="critic") == []


# ----------------------------------------------------------------------------------------------------------------
# Sharded model state: FSDP2 and FSDP on 2 gloo ranks, then resharded onto 1 rank, then merged to HF
# ----------------------------------------------------------------------------------------------------------------

def _tiny_qwen2(seed):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(62)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def _fsdp2(model, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp1(model):
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Qwen2DecoderLayer})
    # FSDP1 on CPU needs device_id=cpu explicitly; without it, it asks for an accelerator.
    return FullyShardedDataParallel(model, device_id=torch.device("cpu"), auto_wrap_policy=policy,
                                    use_orig_params=True)


def _optimizer_and_scheduler(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return optimizer, scheduler


def _train_step(model, optimizer, scheduler, rank, step):
    generator = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data, as in data parallel
    input_ids = torch.randint(0, 64, (2, 8), generator=generator)
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _full_state(model, optimizer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))


def _assert_bitwise_equal(actual, expected, where=""):
    """Nested dicts/lists of tensors and numbers are identical; returns how many tensors were compared."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), f"tensor differs at {where}"
        return 1
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"keys differ at {where}"
        return sum(_assert_bitwise_equal(actual[k], expected[k], f"{where}/{k}") for k in expected)
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"length differs at {where}"
        return sum(_assert_bitwise_equal(a, e, f"{where}[{i}]") for i, (a, e) in enumerate(zip(actual, expected)))
    assert actual == expected, f"{actual!r} != {expected!r} at {where}"
    return 0


def _rng_draws():
    return [random.random(), float(np.random.rand()), torch.rand(2).tolist()]


PROBE_IDS = torch.tensor([[5, 9, 13, 2, 40, 33, 7, 1]])


def _two_rank_worker(rank, world_size, work_dir):
    torch.set_num_threads(1)  # 2 ranks on a 2-core machine: no oversubscription
    dist.init_process_group("gloo", init_method=f"file://{work_dir}/pg_init", rank=rank, world_size=world_size)
    try:
        _check_fsdp2_round_trip(rank, world_size, work_dir)
        _check_fsdp1_round_trip(rank, work_dir)
    finally:
        dist.destroy_process_group()


def _check_fsdp2_round_trip(rank, world_size, work_dir):
    model = _fsdp2(_tiny_qwen2(seed=0), world_size)
    optimizer, scheduler = _optimizer_and_scheduler(model)
    for step in (1, 2):
        _train_step(model, optimizer, scheduler, rank, step)
    root = os.path.join(work_dir, "ckpt")
    with atomic_checkpoint_dir(root, 2) as tmp:
        actor_dir = os.path.join(tmp, "actor")
        save_sharded_model_state(model, optimizer, scheduler, actor_dir, rank, ["model", "optimizer", "extra"])
        if rank == 0:
            save_hf_config_and_tokenizer(actor_dir, model.config, _tiny_tokenizer())
    draws_after_save = _rng_draws()
    expected_model, expected_optim = _full_state(model, optimizer)
    with torch.no_grad():
        logits = model(input_ids=PROBE_IDS).logits
    if rank == 0:
        torch.save({"model": expected_model, "optim": expected_optim, "logits": logits,
                    "scheduler": scheduler.state_dict()}, os.path.join(work_dir, "expected.pt"))

    restored = _fsdp2(_tiny_qwen2(seed=1), world_size)
    restored_optimizer, restored_scheduler = _optimizer_and_scheduler(restored)
    assert not torch.equal(_full_state(restored, restored_optimizer)[0]["lm_head.weight"],
                           expected_model["lm_head.weight"])
    load_sharded_model_state(restored, restored_optimizer, restored_scheduler, os.path.join(root, "global_step_2",
                             "actor"), rank, ["model", "optimizer", "extra"])
    assert _rng_draws() == draws_after_save
    restored_model_state, restored_optim_state = _full_state(restored, restored_optimizer)
    assert _assert_bitwise_equal(restored_model_state, expected_model) == len(expected_model) == 27, len(expected_model)
    assert _assert_bitwise_equal(restored_optim_state, expected_optim) >= 2 * 26  # exp_avg, exp_avg_sq per parameter
    assert restored_scheduler.state_dict() == scheduler.state_dict()
    assert restored_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 3)
    # Exact resume: one more step from the restored state equals one more step from the original.
    _train_step(model, optimizer, scheduler, rank, 3)
    _train_step(restored, restored_optimizer, restored_scheduler, rank, 3)
    _assert_bitwise_equal(_full_state(restored, restored_optimizer), _full_state(model, optimizer))


def _check_fsdp1_round_trip(rank, work_dir):
    model = _fsdp1(_tiny_qwen2(seed=0))
    optimizer, scheduler = _optimizer_and_scheduler(model)
    _train_step(model, optimizer, scheduler, rank, 1)
    path = os.path.join(work_dir, "fsdp1_actor")
    save_sharded_model_state(model, optimizer, scheduler, path, rank, ["model", "optimizer", "extra"])
    restored = _fsdp1(_tiny_qwen2(seed=1))
    restored_optimizer, restored_scheduler = _optimizer_and_scheduler(restored)
    load_sharded_model_state(restored, restored_optimizer, restored_scheduler, path, rank,
                             ["model", "optimizer", "extra"])
    assert _assert_bitwise_equal(_full_state(restored, restored_optimizer), _full_state(model, optimizer)) > 27
    with open(os.path.join(work_dir, f"fsdp1_ok_{rank}"), "w") as f:
        f.write("ok")


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory):
    """Train a tiny Qwen2 on 2 gloo ranks with FSDP2, save at step 2, verify the round trip on those ranks."""
    work_dir = str(tmp_path_factory.mktemp("two_ranks"))
    mp.spawn(_two_rank_worker, args=(2, work_dir), nprocs=2, join=True)
    return work_dir


def test_fsdp2_and_fsdp1_sharded_state_round_trip_bitwise_on_two_ranks(two_rank_checkpoint):
    # The assertions ran inside both ranks (a failure there fails mp.spawn); here: what they left behind.
    actor_dir = os.path.join(two_rank_checkpoint, "ckpt", "global_step_2", "actor")
    with open(os.path.join(actor_dir, "checkpoint_meta.json")) as f:
        assert json.load(f) == {"world_size": 2, "save_contents": ["extra", "model", "optimizer"]}
    assert sorted(os.listdir(os.path.join(actor_dir, "extra"))) == ["rank_0.pt", "rank_1.pt"]
    assert sorted(n for n in os.listdir(os.path.join(actor_dir, "model")) if n.endswith(".distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]
    assert {"config.json", "tokenizer.json"} <= set(os.listdir(os.path.join(actor_dir, "huggingface")))
    assert all(os.path.exists(os.path.join(two_rank_checkpoint, f"fsdp1_ok_{r}")) for r in (0, 1))
    assert find_latest_checkpoint(os.path.join(two_rank_checkpoint, "ckpt")) == os.path.dirname(actor_dir)


def test_checkpoint_from_two_ranks_reshards_onto_one(two_rank_checkpoint, tmp_path, caplog):
    expected = torch.load(os.path.join(two_rank_checkpoint, "expected.pt"))
    actor_dir = os.path.join(two_rank_checkpoint, "ckpt", "global_step_2", "actor")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg_init", rank=0, world_size=1)
    try:
        model = _fsdp2(_tiny_qwen2(seed=1), world_size=1)
        optimizer, scheduler = _optimizer_and_scheduler(model)
        with caplog.at_level(logging.WARNING):
            load_sharded_model_state(model, optimizer, scheduler, actor_dir, 0, ["model", "optimizer", "extra"])
        model_state, optim_state = _full_state(model, optimizer)
    finally:
        dist.destroy_process_group()
    assert _assert_bitwise_equal(model_state, expected["model"]) == 27
    _assert_bitwise_equal(optim_state, expected["optim"])
    assert scheduler.state_dict() == expected["scheduler"]
    assert "saved with world size 2, now 1" in caplog.text and "RNG states were NOT restored" in caplog.text


def test_plain_module_without_process_group_and_contents_checks(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = str(tmp_path / "actor")
    save_sharded_model_state(model, None, None, path, 0, ["model"])
    restored = torch.nn.Linear(3, 2)
    load_sharded_model_state(restored, None, None, path, 0, ["model"])
    assert torch.equal(restored.weight, model.weight) and torch.equal(restored.bias, model.bias)
    optimizer = torch.optim.SGD(restored.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"asks for \['optimizer'\] but the checkpoint .* holds only \['model'\]"):
        load_sharded_model_state(restored, optimizer, None, path, 0, ["model", "optimizer"])
    with pytest.raises(ValueError, match="subset of"):
        save_sharded_model_state(model, None, None, path, 0, ["weights"])
    with pytest.raises(ValueError, match="no optimizer was given to save"):
        save_sharded_model_state(model, None, None, path, 0, ["optimizer"])


def test_model_merger_exports_hf_model_with_identical_logits(two_rank_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from hybridrl import model_merger

    actor_dir = os.path.join(two_rank_checkpoint, "ckpt", "global_step_2", "actor")
    target = str(tmp_path / "hf")
    model_merger.main(["--local_dir", actor_dir, "--target_dir", target])
    assert "model.safetensors" in os.listdir(target)
    exported = AutoModelForCausalLM.from_pretrained(target)
    assert exported.dtype == torch.float32
    with torch.no_grad():
        logits = exported(input_ids=PROBE_IDS).logits
    assert torch.equal(logits, torch.load(os.path.join(two_rank_checkpoint, "expected.pt"))["logits"])
    # PreTrainedTokenizerFast, not AutoTokenizer: with a qwen2 config.json beside it, transformers 5 picks
    # Qwen2Tokenizer, which rebuilds a byte-level pre-tokenizer this tiny word-level vocabulary does not have.
    assert PreTrainedTokenizerFast.from_pretrained(target)("w3 w4")["input_ids"] == [5, 6]
    with pytest.raises(FileNotFoundError, match="global_step_N/actor"):
        model_merger.main(["--local_dir", str(tmp_path), "--target_dir", str(tmp_path / "x")])
