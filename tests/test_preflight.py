"""check_before_start: every input a run reads or writes, checked before Ray starts, each problem one line naming the
key and the file (issue 19, points 2, 3, 6 and 7). No Ray here: each case takes well under a second.

Before these checks, each bad input below failed only after Ray and the workers had started: an empty parquet deep in
torch (`num_samples=0`), an unwritable run directory at the first save, a wrong reward function name when the reward
manager was built, a truncated model file inside transformers without naming it, too many ranks when the placement
groups were created.
"""
import json
import os
import struct

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from hybridrl.config import ConfigError, check_before_start, compose_config, validate_config
from hybridrl.single_controller.config_checks import _cpus_ray_detects
from hybridrl.utils.disk import human_bytes
from hybridrl.data.rl_parquet import write_rl_parquet
from hybridrl.utils.safetensors_header import count_elements
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer

REWARD_FILE = '''
def letter_a(data_source, solution_str, ground_truth, extra_info=None):
    return float("a" in solution_str)

threshold = 0.5
'''


def rows(count):
    return [{"data_source": "toy", "prompt": [{"role": "user", "content": f"question {i}"}], "ability": "toy",
             "reward_model": {"style": "rule", "ground_truth": "a"}, "extra_info": {"index": i}} for i in range(count)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny model, 16 training and 4 validation rows, a reward file: everything a run reads, all good."""
    root = tmp_path_factory.mktemp("inputs")
    tokenizer = build_tokenizer([f"question {i}" for i in range(20)] * 5, vocab_size=300)
    model = build_tiny_model(str(root / "model"), tokenizer, hidden_size=32, num_layers=1, num_heads=2,
                             num_kv_heads=1, intermediate_size=64)
    write_rl_parquet(rows(16), str(root / "train.parquet"))
    write_rl_parquet(rows(4), str(root / "val.parquet"))
    (root / "reward.py").write_text(REWARD_FILE)
    return {"root": root, "model": model, "train": str(root / "train.parquet"), "val": str(root / "val.parquet"),
            "reward": str(root / "reward.py")}


def config_for(inputs, tmp_path, *overrides):
    return validate_config(compose_config([
        f"actor_rollout_ref.model.path={inputs['model']}", f"data.train_files={inputs['train']}",
        f"data.val_files={inputs['val']}", f"custom_reward_function.path={inputs['reward']}",
        "custom_reward_function.name=letter_a", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
        "trainer.n_gpus_per_node=2", "ray_init.num_cpus=2", "trainer.device=cpu",
        f"trainer.default_local_dir={tmp_path / 'run'}", *overrides]))


def problems_for(inputs, tmp_path, *overrides) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        check_before_start(config_for(inputs, tmp_path, *overrides))
    return caught.value.problems


def test_good_inputs_pass_without_starting_ray(inputs, tmp_path, monkeypatch):
    def no_ray(*args, **kwargs):
        raise AssertionError("the checks before start must not start Ray")

    monkeypatch.setattr(ray, "init", no_ray)
    assert check_before_start(config_for(inputs, tmp_path)) == []
    assert os.listdir(tmp_path / "run") == []  # created and test-written; the test file is gone


# ---- point 2: data ----

def write_table(path, columns: dict) -> str:
    pq.write_table(pa.table(columns), str(path))
    return str(path)


def empty_parquet(inputs, path) -> str:
    """The training file's columns, no rows."""
    pq.write_table(pq.read_table(inputs["train"]).slice(0, 0), str(path))
    return str(path)


def test_empty_train_and_validation_files_are_named(inputs, tmp_path):
    empty = empty_parquet(inputs, tmp_path / "empty.parquet")
    assert problems_for(inputs, tmp_path, f"data.train_files={empty}", f"data.val_files={empty}") == [
        f"data.train_files[0]: expected a parquet file with rows, got '{empty}' (0 rows)",
        f"data.val_files[0]: expected a parquet file with rows, got '{empty}' (0 rows)",
        f"data.train_files: expected at least data.train_batch_size=8 rows in all (one training batch), got 0 "
        f"({empty}: 0)",
    ]


def test_fewer_rows_than_one_batch(inputs, tmp_path):
    small = str(tmp_path / "small.parquet")
    write_rl_parquet(rows(3), small)
    assert problems_for(inputs, tmp_path, f"data.train_files=[{small},{small}]") == [
        f"data.train_files: expected at least data.train_batch_size=8 rows in all (one training batch), got 6 "
        f"({small}: 3, {small}: 3)"]
    assert problems_for(inputs, tmp_path, "data.train_max_samples=5") == [
        f"data.train_files: expected at least data.train_batch_size=8 rows in all (one training batch), got 16 "
        f"({inputs['train']}: 16, of which data.train_max_samples=5 are used)"]


def test_missing_and_mistyped_columns_are_named_with_the_key_that_reads_them(inputs, tmp_path):
    table = pq.read_table(inputs["train"])
    renamed = write_table(tmp_path / "renamed.parquet", {
        "question": table.column("prompt"), "source": table.column("data_source"), "extra_info": table["extra_info"]})
    text_prompt = write_table(tmp_path / "text.parquet", {
        "prompt": ["question 1"] * 8, "data_source": ["toy"] * 8, "reward_model": ["a"] * 8})
    assert problems_for(inputs, tmp_path, f"data.train_files={renamed}", f"data.val_files={text_prompt}") == [
        f"data.train_files[0]: expected a column 'prompt' (data.prompt_key), got '{renamed}' with columns "
        f"['question', 'source', 'extra_info']",
        f"data.train_files[0]: expected a column 'data_source' (data.reward_fn_key), got '{renamed}' with columns "
        f"['question', 'source', 'extra_info']",
        f"data.val_files[0]: expected column 'prompt' (data.prompt_key) to hold chat messages, a list of "
        f"{{role, content}}, got type string in '{text_prompt}'",
        # the reward manager's column is checked by reward/config_checks.py, after data's
        f"data.train_files[0]: expected a column 'reward_model' (its ground_truth is read by "
        f"reward_model.reward_manager='naive'), got '{renamed}' with columns ['question', 'source', 'extra_info']",
        f"data.val_files[0]: expected column 'reward_model' to be a struct with a 'ground_truth' field, got type "
        f"string in '{text_prompt}'",
    ]
    # The keys name the columns: with them pointed at the renamed ones, only the reward model's column is missing.
    assert problems_for(inputs, tmp_path, f"data.train_files={renamed}", "data.prompt_key=question",
                        "data.reward_fn_key=source", "trainer.val_before_train=false", "trainer.test_freq=-1") == [
        f"data.train_files[0]: expected a column 'reward_model' (its ground_truth is read by "
        f"reward_model.reward_manager='naive'), got '{renamed}' with columns ['question', 'source', 'extra_info']"]


def test_unreadable_parquet_is_named_and_validation_files_are_skipped_when_validation_is_off(inputs, tmp_path):
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1 not really parquet")
    (problem,) = problems_for(inputs, tmp_path, f"data.val_files={garbage}")
    assert problem.startswith(f"data.val_files[0]: expected a readable parquet file, got '{garbage}' (ArrowInvalid: ")
    # trainer.val_before_train=false and trainer.test_freq<=0: the run never validates, the file is never opened.
    config = config_for(inputs, tmp_path, f"data.val_files={garbage}", "trainer.val_before_train=false",
                        "trainer.test_freq=-1")
    assert check_before_start(config) == []
    assert not config.trainer.runs_validation()


def test_the_trainer_reads_no_validation_file_when_validation_is_off(inputs, tmp_path):
    from transformers import AutoTokenizer

    from hybridrl.trainer.ppo.ray_trainer import RayPPOTrainer

    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet")
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)  # its data loaders only: no Ray, no workers
    trainer.tokenizer = AutoTokenizer.from_pretrained(inputs["model"])
    trainer.config = config_for(inputs, tmp_path, f"data.val_files={garbage}", "trainer.val_before_train=false",
                                "trainer.test_freq=-1")
    train, val = trainer._create_dataloaders()
    assert (len(train), val) == (2, None)
    trainer.config = config_for(inputs, tmp_path, "trainer.val_before_train=false", "trainer.test_freq=5")
    assert len(trainer._create_dataloaders()[1].dataset) == 4


# ---- point 3: the run directory and the disk ----

def test_unwritable_run_dir_fails_before_the_first_step(inputs, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("a file where the run directory's parent should be")  # stops root too, unlike chmod
    run_dir = blocker / "run"
    assert problems_for(inputs, tmp_path, f"trainer.default_local_dir={run_dir}") == [
        f"trainer.default_local_dir: expected a directory this process can create and write (checkpoints, metrics "
        f"and summary.json go there), got '{run_dir}' ([Errno 20] Not a directory: '{run_dir}')"]


def sparse_model(directory, parameters: int) -> str:
    """A model directory whose one safetensors file declares `parameters` fp32 numbers. The file is sparse: it is
    complete by its header, takes no disk space, and nothing ever reads its data."""
    os.makedirs(directory)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [parameters], "data_offsets": [0, 4 * parameters]}}).encode()
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 4 * parameters)
    return str(directory)


def test_warns_when_one_checkpoint_does_not_fit_the_free_disk(inputs, tmp_path):
    parameters = 2 ** 40  # 12 TiB a checkpoint: more than any test machine's free disk
    model = sparse_model(tmp_path / "huge", parameters)
    tokenizer = f"data.tokenizer={inputs['model']}"  # the sparse model has weights only
    (warning,) = check_before_start(config_for(inputs, tmp_path, f"actor_rollout_ref.model.path={model}", tokenizer,
                                               "trainer.save_freq=5"))
    assert warning.startswith(f"trainer.default_local_dir: one checkpoint needs about 12.0 TiB "
                              f"(actor_rollout_ref.model.path: 1099511.63M parameters x 12 B), but "
                              f"'{tmp_path / 'run'}' has ")
    assert warning.endswith(" free: the first save (step 5) will fail")
    # model only, no optimizer state: 4 B a parameter
    (warning,) = check_before_start(config_for(inputs, tmp_path, f"actor_rollout_ref.model.path={model}", tokenizer,
                                               "trainer.save_freq=5",
                                               "actor_rollout_ref.actor.checkpoint.save_contents=[model]"))
    assert "about 4.0 TiB (actor_rollout_ref.model.path: 1099511.63M parameters x 4 B)" in warning
    # no saves, nothing to warn about
    assert check_before_start(config_for(inputs, tmp_path, f"actor_rollout_ref.model.path={model}", tokenizer)) == []


def test_warns_when_keeping_every_checkpoint_will_fill_the_disk(inputs, tmp_path):
    """max_actor_ckpt_to_keep=null (verl's default) keeps all: a long run with frequent saves fills any disk."""
    steps = 10 ** 9
    (warning,) = check_before_start(config_for(inputs, tmp_path, f"trainer.total_training_steps={steps}",
                                               "trainer.save_freq=1"))
    one = 12 * count_elements(os.path.join(inputs["model"], "model.safetensors"))  # fp32 weights + AdamW's moments
    assert warning.startswith(
        f"trainer.default_local_dir: this run saves {steps} checkpoints (trainer.save_freq=1) and holds up to {steps} "
        f"at once (trainer.max_actor_ckpt_to_keep=null: all), about {human_bytes(steps * one)} at "
        f"{human_bytes(one)} each, but '{tmp_path / 'run'}' has ")
    assert warning.endswith(" free; lower trainer.max_actor_ckpt_to_keep or free space, or saves will fail with 'No "
                            "space left on device'")
    # Keeping 3 holds at most 4 at once (the new one is published before the oldest is pruned): they fit.
    assert check_before_start(config_for(inputs, tmp_path, f"trainer.total_training_steps={steps}",
                                         "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=3")) == []
    # With a critic (it reads the same tiny model), its checkpoints count too, under its own limit.
    (warning,) = check_before_start(config_for(inputs, tmp_path, f"trainer.total_training_steps={steps}",
                                               "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=3",
                                               "algorithm=gae"))
    assert f"(trainer.max_actor_ckpt_to_keep=3, trainer.max_critic_ckpt_to_keep=null: all), about " \
           f"{human_bytes(4 * one + steps * one)} at {human_bytes(2 * one)} each" in warning
    assert "lower trainer.max_actor_ckpt_to_keep and trainer.max_critic_ckpt_to_keep or free space" in warning


# ---- point 6: reward function, resources, model files ----

def test_wrong_reward_function_name_lists_what_the_file_defines(inputs, tmp_path):
    assert problems_for(inputs, tmp_path, "custom_reward_function.name=letter_b") == [
        f"custom_reward_function.name: expected a function defined in custom_reward_function.path, got 'letter_b' "
        f"({inputs['reward']} defines no 'letter_b'; names it defines: ['letter_a', 'threshold'])"]
    assert problems_for(inputs, tmp_path, "custom_reward_function.name=threshold") == [
        f"custom_reward_function.name: expected a function, got 'threshold', which is a float in {inputs['reward']}"]
    broken = tmp_path / "broken.py"
    broken.write_text("def letter_a(:\n")
    (problem,) = problems_for(inputs, tmp_path, f"custom_reward_function.path={broken}")
    assert problem.startswith(f"custom_reward_function.path: expected a Python file that runs, got '{broken}' "
                              f"(SyntaxError: ")


def test_more_ranks_than_the_local_ray_has_cpus(inputs, tmp_path):
    batches = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
    assert problems_for(inputs, tmp_path, "trainer.n_gpus_per_node=4", *batches) == [
        "trainer.n_gpus_per_node: expected at most 2 ranks in all (one CPU each; the local Ray has 2 CPUs, "
        "ray_init.num_cpus), got trainer.nnodes * trainer.n_gpus_per_node = 1 * 4 = 4"]
    detected = _cpus_ray_detects()
    ranks = 2 ** detected.bit_length()  # the next power of two above what this machine has
    enough_rows = str(tmp_path / "rows.parquet")
    write_rl_parquet(rows(ranks), enough_rows)
    assert problems_for(inputs, tmp_path, f"trainer.n_gpus_per_node={ranks}", "ray_init.num_cpus=null",
                        f"data.train_files={enough_rows}", f"data.train_batch_size={ranks}",
                        f"actor_rollout_ref.actor.ppo_mini_batch_size={ranks}", *batches) == [
        f"trainer.n_gpus_per_node: expected at most {detected} ranks in all (one CPU each; the local Ray has "
        f"{detected} CPUs, ray_init.num_cpus=null: the CPUs Ray detects), got trainer.nnodes * "
        f"trainer.n_gpus_per_node = 1 * {ranks} = {ranks}"]
    # A running cluster declares its own resources: checked once joined, not here.
    assert check_before_start(config_for(inputs, tmp_path, "trainer.n_gpus_per_node=4", "ray_init.address=auto",
                                         "ray_init.num_cpus=null", *batches)) == []


def copy_model(inputs, target):
    import shutil

    return shutil.copytree(inputs["model"], target)


def test_broken_config_json_and_truncated_weights_name_the_file(inputs, tmp_path):
    model = copy_model(inputs, tmp_path / "model")
    weights = os.path.join(model, "model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(size - 100)  # an interrupted download
    with open(os.path.join(model, "config.json"), "w") as f:
        f.write('{"model_type": "qwen2",')
    assert problems_for(inputs, tmp_path, f"actor_rollout_ref.model.path={model}") == [
        f"actor_rollout_ref.model.path: expected a model directory whose config.json is a JSON object, got "
        f"'{model}/config.json' (Expecting property name enclosed in double quotes: line 1 column 24 (char 23))",
        f"actor_rollout_ref.model.path: expected complete safetensors weights, got '{weights}' (model.safetensors is "
        f"{size - 100} bytes, its header describes {size} (truncated or damaged))",
    ]


def test_broken_safetensors_header_and_missing_weights_name_the_file(inputs, tmp_path):
    model = copy_model(inputs, tmp_path / "model")
    weights = os.path.join(model, "model.safetensors")
    with open(weights, "r+b") as f:
        f.seek(8)
        f.write(b"#")  # the header's opening brace
    (problem,) = problems_for(inputs, tmp_path, f"actor_rollout_ref.model.path={model}")
    assert problem.startswith(f"actor_rollout_ref.model.path: expected complete safetensors weights, got '{weights}' "
                              f"(model.safetensors has an unreadable header (Expecting value: line 1 column 1")
    os.remove(weights)
    assert problems_for(inputs, tmp_path, f"actor_rollout_ref.model.path={model}") == [
        f"actor_rollout_ref.model.path: expected model weights (model.safetensors, model.safetensors.index.json or "
        f"pytorch_model.bin) in the directory, got '{model}' without any"]


def test_sharded_weights_are_checked_shard_by_shard(inputs, tmp_path):
    model = copy_model(inputs, tmp_path / "model")
    os.rename(os.path.join(model, "model.safetensors"), os.path.join(model, "model-00001-of-00002.safetensors"))
    with open(os.path.join(model, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                  "b": "model-00002-of-00002.safetensors"}}, f)
    missing = os.path.join(model, "model-00002-of-00002.safetensors")
    # The critic reads the same directory: it is checked (and reported) once.
    assert problems_for(inputs, tmp_path, f"actor_rollout_ref.model.path={model}",
                        f"data.tokenizer={inputs['model']}", "algorithm=gae") == [
        f"actor_rollout_ref.model.path: expected complete safetensors weights, got '{missing}' "
        f"(model-00002-of-00002.safetensors is missing)"]


def test_every_problem_is_reported_at_once(inputs, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    small = str(tmp_path / "small.parquet")
    write_rl_parquet(rows(2), small)
    problems = problems_for(inputs, tmp_path, f"data.train_files={small}", "custom_reward_function.name=nope",
                            "trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                            f"trainer.default_local_dir={blocker / 'run'}", f"data.val_files={tmp_path / 'no.parquet'}")
    assert [problem.split(":")[0] for problem in problems] == [
        "data.val_files[0]", "data.train_files", "custom_reward_function.name", "trainer.n_gpus_per_node",
        "trainer.default_local_dir"]
    assert problems[0].endswith("(no such file)")


def test_the_rollout_pool_counts_towards_the_ranks_of_a_disaggregated_run(inputs, tmp_path):
    """hybrid_engine=false: the trainer's 1 rank + the rollout pool's 2 do not fit a local Ray of 2 CPUs."""
    assert problems_for(inputs, tmp_path, "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=2",
                        "actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.mode=async",
                        "data.return_raw_chat=true") == [
        "trainer.n_gpus_per_node: expected at most 2 ranks in all (one CPU each; the local Ray has 2 CPUs, "
        "ray_init.num_cpus), got trainer.nnodes * trainer.n_gpus_per_node = 1 * 1 + rollout.nnodes * "
        "rollout.n_gpus_per_node = 1 * 2 = 3"]


@pytest.mark.parametrize("tp, name, refused", [(2, "sglang", False), (4, "sglang", True), (4, "hf", False)])
def test_a_tensor_parallel_engine_needs_the_heads_to_divide(inputs, tp, name, refused):
    """Checked on the model's config.json before any worker starts (sglang's config needs a GPU to validate, so the
    check runs on the config's namespace here)."""
    from types import SimpleNamespace

    from hybridrl.workers.rollout.config_checks import _check_tensor_parallel_heads

    rollout = SimpleNamespace(tensor_model_parallel_size=tp, name=name)
    config = SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=rollout, model=SimpleNamespace(
        path=inputs["model"])))
    problems = []
    _check_tensor_parallel_heads(config, problems)
    assert problems == ([f"actor_rollout_ref.rollout.tensor_model_parallel_size: expected a divisor of the model's "
                         f"num_attention_heads (2, {inputs['model']}/config.json), got 4"] if refused else [])
