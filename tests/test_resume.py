"""Checkpoints in the running trainer: exact resume, a save killed midway, pruning, loggers of a real run.

The toy task of test_e2e_training (real local Ray, 2 gloo ranks, a tiny Qwen2), on 24 training prompts: with 8
prompts a batch an epoch is 3 batches, so a 4-step run crosses an epoch boundary (step 4 draws a new permutation)
and a resume after step 2 lands mid-epoch. The reference is one uninterrupted 4-step run; every resumed run must
give the same metrics for the steps after its checkpoint and bitwise the same final weights (CPU, fixed seeds,
same 2 ranks: every operation is deterministic, so nothing less than equality is accepted).
"""
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hybridrl.config import check_paths, compose_config, validate_config
from hybridrl.model_merger import load_full_model_state
from hybridrl.trainer.ppo import checkpointing
from hybridrl.trainer.ppo.ray_trainer import RayPPOTrainer
from hybridrl.trainer.checkpoint_dir import atomic_checkpoint_dir
from hybridrl.data.rl_dataset import make_dataloader
from hybridrl.data.rl_parquet import write_rl_parquet
from tests.test_e2e_training import read_metrics
from toy_task import WORDS, toy_rows

TOTAL_STEPS = 4
VAL_PROMPTS = 8

# A user's extension: the controller's save of data.pt sleeps at step 2, inside the temporary checkpoint
# directory, after writing a marker with its pid, so the test can kill -9 that process in the middle of a save.
# (The file names the marker itself: Ray starts the controller actor without the test's environment.)
SLOW_SAVE_EXTENSION = '''
import os
import time

from hybridrl.trainer.ppo import checkpointing

MARKER = {marker!r}
_original_save = checkpointing.save_data_state

def _slow_save(path, state):
    _original_save(path, state)
    if state["global_step"] == 2:
        with open(MARKER + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(MARKER + ".tmp", MARKER)  # the test never sees a half-written pid
        time.sleep(600)

checkpointing.save_data_state = _slow_save
'''


# ----------------------------------------------------------------------------------------------------------------
# Controller-side pieces, no Ray: the dataloader position and which checkpoint resume_mode picks
# ----------------------------------------------------------------------------------------------------------------

def _numbers_loader(seed=7):
    """10 numbers in batches of 3 (drop_last: 3 batches an epoch), shuffled by a seeded generator, as the trainer's."""
    return make_dataloader([{"x": torch.tensor(i)} for i in range(10)], batch_size=3, shuffle=True, seed=seed,
                           drop_last=True)


def _take(batches, count):
    return [next(batches)["x"].tolist() for _ in range(count)]


@pytest.mark.parametrize("stop_after", [1, 3, 4, 6])  # mid-epoch, at an epoch's end, early and late in epoch 2
def test_data_position_resumes_with_the_batches_an_uninterrupted_run_sees(stop_after):
    uninterrupted = _take(checkpointing.TrainDataPosition(_numbers_loader()).batches(), 8)
    assert uninterrupted[0:3] != uninterrupted[3:6], "each epoch should draw a new order"

    first = checkpointing.TrainDataPosition(_numbers_loader())
    seen = _take(first.batches(), stop_after)
    state = first.state_dict()
    resumed = checkpointing.TrainDataPosition(_numbers_loader())  # a fresh process: the generator at its seed
    resumed.load_state_dict(state)
    assert seen + _take(resumed.batches(), 8 - stop_after) == uninterrupted


def test_data_position_refuses_a_sampler_without_its_own_generator():
    loader = torch.utils.data.DataLoader(list(range(10)), batch_size=3, shuffle=True)
    with pytest.raises(ValueError, match="global RNG"):
        next(checkpointing.TrainDataPosition(loader).batches())


def _trainer_section(**keys):
    return SimpleNamespace(**{"resume_mode": "auto", "resume_from_path": None, "default_local_dir": None, **keys})


def _publish(root, step):
    with atomic_checkpoint_dir(str(root), step) as tmp_dir:
        os.makedirs(os.path.join(tmp_dir, "actor"))


def test_a_resumed_runs_weights_version_counts_the_actor_updates_of_its_steps():
    """The version a checkpoint's weights get on load: one per step that updated the actor (none in critic warmup)."""
    assert [checkpointing.weights_version_after(step, critic_warmup=2) for step in range(5)] == [0, 0, 0, 1, 2]
    assert checkpointing.weights_version_after(4, critic_warmup=0) == 4


def test_resume_mode_picks_the_checkpoint(tmp_path):
    root = tmp_path / "run"
    assert checkpointing.checkpoint_to_resume(_trainer_section(default_local_dir=str(root))) is None
    _publish(root, 2)
    _publish(root, 5)
    os.makedirs(root / ".tmp_global_step_6")  # an interrupted save is never picked
    os.makedirs(root / "global_step_7")  # a directory that was never published (no completion marker)
    assert checkpointing.checkpoint_to_resume(_trainer_section(default_local_dir=str(root))) == \
        str(root / "global_step_5")
    assert checkpointing.checkpoint_to_resume(_trainer_section(default_local_dir=str(root),
                                                               resume_mode="disable")) is None
    picked = checkpointing.checkpoint_to_resume(_trainer_section(resume_mode="resume_path",
                                                                 resume_from_path=str(root / "global_step_2")))
    assert picked == str(root / "global_step_2")
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        checkpointing.checkpoint_to_resume(_trainer_section(resume_mode="resume_path",
                                                            resume_from_path=str(root / "global_step_7")))
    with pytest.raises(ValueError, match="global_step_<N>"):
        checkpointing.checkpoint_to_resume(_trainer_section(resume_mode="resume_path", resume_from_path=str(root)))


# ----------------------------------------------------------------------------------------------------------------
# The trainer on Ray
# ----------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def task(toy_task):
    train_file = str(toy_task["root"] / "train24.parquet")
    write_rl_parquet(toy_rows(WORDS[:6] * 4), train_file)
    return {**toy_task, "train": train_file}


def overrides(task, run_dir, *extra, estimator="grpo"):
    return [
        f"actor_rollout_ref.model.path={task['model']}",
        f"data.train_files={task['train']}", f"data.val_files={task['val']}",
        f"custom_reward_function.path={task['reward']}", "custom_reward_function.name=share_of_a",
        "data.max_prompt_length=32", "data.max_response_length=8", "data.train_batch_size=8",
        f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3", "trainer.n_gpus_per_node=2", "trainer.device=cpu",
        f"trainer.total_training_steps={TOTAL_STEPS}", "trainer.total_epochs=10", "trainer.val_before_train=false",
        "trainer.test_freq=2", "trainer.logger=[console,jsonl]", f"trainer.default_local_dir={run_dir}",
        *extra,
    ]


def make_config(task, run_dir, *extra, estimator="grpo"):
    config = validate_config(compose_config(overrides(task, run_dir, *extra, estimator=estimator)))
    check_paths(config)
    return config


def train(config) -> dict:
    trainer = RayPPOTrainer(config)
    trainer.init_workers()
    try:
        return trainer.fit()
    finally:
        trainer.shutdown()


def comparable(step_metrics: dict) -> dict:
    """The metrics that must replay exactly: all but wall-clock timings, the rates derived from them, and the
    machine's memory in use (perf/cpu_memory_used_gb, perf/max_memory_*_gb)."""
    return {key: value for key, value in step_metrics.items()
            if not key.startswith(("timing_s/", "perf/mfu/", "perf/max_memory_", "perf/cpu_memory_"))
            and key not in ("perf/time_per_step", "perf/throughput", "rollout/engine_tokens_per_s")}


def metrics_by_step(run_dir) -> dict[int, dict]:
    return {row["step"]: comparable(row) for row in read_metrics(run_dir)}


def actor_weights(run_dir, step) -> dict[str, torch.Tensor]:
    return load_full_model_state(os.path.join(run_dir, f"global_step_{step}", "actor", "model"))


def critic_weights(run_dir, step) -> dict[str, torch.Tensor]:
    return load_full_model_state(os.path.join(run_dir, f"global_step_{step}", "critic", "model"))


def assert_same_weights(expected: dict, actual: dict):
    assert sorted(expected) == sorted(actual)
    different = [name for name in expected if not torch.equal(expected[name], actual[name])]
    assert not different, f"weights differ after resume: {different}"


def read_pointer(run_dir) -> str:
    with open(os.path.join(run_dir, "latest_checkpointed_iteration.txt")) as f:
        return f.read()


@pytest.fixture(scope="module")
def reference_run(ray_local, task, tmp_path_factory):
    """The uninterrupted FSDP2 run: 4 steps, a checkpoint every 2, validation every 2, jsonl + tensorboard."""
    run_dir = str(tmp_path_factory.mktemp("reference"))
    rollout_dir, val_dir = os.path.join(run_dir, "rollouts"), os.path.join(run_dir, "val_generations")
    summary = train(make_config(task, run_dir, "trainer.save_freq=2", "trainer.logger=[console,jsonl,tensorboard]",
                                "trainer.log_val_generations=3", f"trainer.rollout_data_dir={rollout_dir}",
                                f"trainer.validation_data_dir={val_dir}"))
    return {"dir": run_dir, "summary": summary, "metrics": metrics_by_step(run_dir),
            "weights": actor_weights(run_dir, TOTAL_STEPS), "rollout_dir": rollout_dir, "val_dir": val_dir}


def test_reference_run_writes_checkpoints_loggers_and_dumps(reference_run):
    run_dir = reference_run["dir"]
    assert read_pointer(run_dir) == "4"
    assert reference_run["summary"]["checkpoint_dir"] == os.path.join(os.path.abspath(run_dir), "global_step_4")
    for step in (2, 4):
        step_dir = os.path.join(run_dir, f"global_step_{step}")
        assert sorted(os.listdir(step_dir)) == ["actor", "batch_layout.json", "checkpoint_complete.json", "data.pt"]
        hf_files = os.listdir(os.path.join(step_dir, "actor", "huggingface"))
        assert "config.json" in hf_files and "tokenizer.json" in hf_files
    # data.pt after step 2: epoch 0 (3 batches of 8 prompts), 2 batches trained on and the next one read ahead
    # (prompt_source.prefetch), its 8 rows pending; after step 4, the second batch of epoch 1 read ahead.
    state = torch.load(os.path.join(run_dir, "global_step_2", "data.pt"), weights_only=True)
    assert (state["global_step"], state["dataloader"]["epoch"], state["dataloader"]["batches_done"]) == (2, 0, 3)
    assert len(state["prompt_source"]["pending_rows"]) == 8
    state = torch.load(os.path.join(run_dir, "global_step_4", "data.pt"), weights_only=True)
    assert (state["global_step"], state["dataloader"]["epoch"], state["dataloader"]["batches_done"]) == (4, 1, 2)
    assert len(state["prompt_source"]["pending_rows"]) == 8

    # jsonl: one row per step; validation at steps 2 and 4; the step's save timed at 2 and 4 only.
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert ["timing_s/save_checkpoint" in row for row in rows] == [False, True, False, True]
    assert ["val-core/toy/letter_a/reward/mean@1" in row for row in rows] == [False, True, False, True]

    # tensorboard: the same scalars, read back from the event file.
    events = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    events.Reload()
    scores = events.Scalars("critic/score/mean")
    assert [event.step for event in scores] == [1, 2, 3, 4]
    assert [event.value for event in scores] == pytest.approx([row["critic/score/mean"] for row in rows])

    # log_val_generations=3: 3 (input, output, score) rows per validation, in val_generations.jsonl.
    with open(os.path.join(run_dir, "val_generations.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert [row["step"] for row in logged] == [2, 2, 2, 4, 4, 4]
    assert all("say something about" in row["input"] and "score" in row for row in logged)

    # rollout_data_dir: 8 prompts x 2 responses per step; the scores average to the step's critic/score/mean.
    for row in rows:
        with open(os.path.join(reference_run["rollout_dir"], f"{row['step']}.jsonl")) as f:
            dumped = [json.loads(line) for line in f]
        assert len(dumped) == 16 and {d["step"] for d in dumped} == {row["step"]}
        assert sum(d["score"] for d in dumped) / 16 == pytest.approx(row["critic/score/mean"], abs=1e-6)
    # validation_data_dir: every validation prompt once (val_kwargs.n=1), at steps 2 and 4.
    assert sorted(os.listdir(reference_run["val_dir"])) == ["2.jsonl", "4.jsonl"]
    with open(os.path.join(reference_run["val_dir"], "4.jsonl")) as f:
        dumped = [json.loads(line) for line in f]
    assert len(dumped) == VAL_PROMPTS
    val_mean = rows[3]["val-core/toy/letter_a/reward/mean@1"]
    assert sum(d["score"] for d in dumped) / VAL_PROMPTS == pytest.approx(val_mean, abs=1e-6)


def test_model_merger_exports_the_trained_actor_as_a_hf_model(reference_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from hybridrl.model_merger import main as merge_main

    merge_main(["--local_dir", os.path.join(reference_run["dir"], "global_step_4", "actor"),
                "--target_dir", str(tmp_path / "hf")])
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).state_dict()
    trained = reference_run["weights"]
    assert set(trained) <= set(exported)
    assert all(torch.equal(exported[name], trained[name]) for name in trained)


def test_resume_from_path_replays_steps_3_and_4_exactly_fsdp2(reference_run, task, tmp_path):
    run_dir = str(tmp_path)
    resume_from = os.path.join(reference_run["dir"], "global_step_2")
    train(make_config(task, run_dir, "trainer.save_freq=2", "trainer.resume_mode=resume_path",
                      f"trainer.resume_from_path={resume_from}"))
    resumed = metrics_by_step(run_dir)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == reference_run["metrics"][step], f"step {step} differs after resume"
    assert_same_weights(reference_run["weights"], actor_weights(run_dir, TOTAL_STEPS))


@pytest.mark.slow
def test_process_killed_during_save_resumes_from_previous_step(reference_run, ray_local, task, tmp_path):
    """kill -9 the controller while it writes global_step_2: step 1 stays the checkpoint, and the resumed run
    replays steps 2-4 exactly as the uninterrupted run did."""
    run_dir, marker = str(tmp_path / "run"), str(tmp_path / "saving_pid")
    extension = tmp_path / "slow_save.py"
    extension.write_text(SLOW_SAVE_EXTENSION.format(marker=marker))
    command = [sys.executable, "-m", "hybridrl.main_ppo",
               *overrides(task, run_dir, "trainer.save_freq=1", f"extensions=[{extension}]"),
               f"ray_init.address={ray_local.get_runtime_context().gcs_address}"]
    log_path = tmp_path / "driver.log"
    with open(log_path, "w") as log:  # a file, not a pipe: a full pipe would block the driver
        driver = subprocess.Popen(command, cwd=os.getcwd(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 480  # a hang guard: the driver's start and 2 steps, on a loaded machine
        while not os.path.exists(marker) and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert os.path.exists(marker), f"the save of step 2 never started: {log_path.read_text()[-3000:]}"
        with open(marker) as f:
            os.kill(int(f.read()), signal.SIGKILL)
        driver.wait(timeout=300)  # the driver sees its controller actor die and exits (a hang guard)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode != 0
    assert os.path.isdir(os.path.join(run_dir, ".tmp_global_step_2"))
    assert not os.path.exists(os.path.join(run_dir, "global_step_2"))
    assert read_pointer(run_dir) == "1"

    summary = train(make_config(task, run_dir, "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=1"))
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # the killed run logged step 1, the resumed one 2-4
    for row in rows:
        assert comparable(row) == reference_run["metrics"][row["step"]], f"step {row['step']} differs"
    assert_same_weights(reference_run["weights"], actor_weights(run_dir, TOTAL_STEPS))
    # max_actor_ckpt_to_keep=1: only the newest checkpoint is left, and no temporary directory.
    assert sorted(name for name in os.listdir(run_dir) if "global_step" in name) == ["global_step_4"]
    assert summary["checkpoint_dir"] == os.path.join(os.path.abspath(run_dir), "global_step_4")


@pytest.mark.slow
def test_auto_resume_replays_exactly_fsdp1_ppo_with_critic_and_adaptive_kl(ray_local, task, tmp_path):
    """FSDP1 (strategy=fsdp) PPO: actor, critic and the adaptive in-reward KL coefficient all resume exactly; the
    newest complete checkpoint is picked when the pointer is stale."""
    fsdp1 = ["actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.ref.strategy=fsdp", "critic.strategy=fsdp",
             "critic.optim.lr=1e-3", "algorithm.use_kl_in_reward=true",
             "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.05", "algorithm.kl_ctrl.target_kl=0.001",
             "algorithm.kl_ctrl.horizon=10", "trainer.save_freq=2", "trainer.test_freq=-1"]
    run_dir, aside = str(tmp_path / "run"), tmp_path / "aside"
    train(make_config(task, run_dir, *fsdp1, estimator="gae"))
    reference_metrics, reference_weights = metrics_by_step(run_dir), actor_weights(run_dir, TOTAL_STEPS)
    reference_critic = critic_weights(run_dir, TOTAL_STEPS)
    coefficients = [reference_metrics[step]["actor/reward_kl_penalty_coeff"] for step in (1, 2, 3, 4)]
    assert len(set(coefficients)) == 4, "the adaptive KL coefficient should move every step"
    # As if the run had died before step 4 was saved (the pointer still says 4: find_latest falls back).
    aside.mkdir()
    for name in ("global_step_4", "metrics.jsonl"):
        os.rename(os.path.join(run_dir, name), aside / name)

    train(make_config(task, run_dir, *fsdp1, estimator="gae"))
    resumed = metrics_by_step(run_dir)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == reference_metrics[step], f"step {step} differs after resume"
    assert_same_weights(reference_weights, actor_weights(run_dir, TOTAL_STEPS))
    assert_same_weights(reference_critic, critic_weights(run_dir, TOTAL_STEPS))


@pytest.mark.slow
def test_resume_onto_one_rank_reshards_the_two_rank_checkpoint(reference_run, task, tmp_path):
    """A checkpoint from 2 ranks loads onto 1: DCP reshards model and optimizer (RNG states are not restored, so
    sampling differs from here on), and the dataloader continues with the batch the 2-rank run trained next."""
    run_dir = str(tmp_path / "run")
    resume_from = os.path.join(reference_run["dir"], "global_step_2")
    trainer = RayPPOTrainer(make_config(task, run_dir, "trainer.n_gpus_per_node=1", "trainer.save_freq=2",
                                        "trainer.test_freq=-1", "trainer.resume_mode=resume_path",
                                        f"trainer.resume_from_path={resume_from}"))
    trainer.init_workers()
    try:
        restored = checkpointing.load_checkpoint(trainer.config,
                                                 checkpointing.CheckpointedWorkers(trainer.actor_rollout_wg))
        assert restored.global_step == 2
        resaved = str(tmp_path / "resaved")
        trainer.actor_rollout_wg.save_checkpoint(resaved)
        summary = trainer.fit()
    finally:
        trainer.shutdown()
    assert_same_weights(actor_weights(reference_run["dir"], 2), load_full_model_state(os.path.join(resaved, "model")))
    with open(os.path.join(resaved, "checkpoint_meta.json")) as f:
        assert json.load(f)["world_size"] == 1
    rows = metrics_by_step(run_dir)
    assert sorted(rows) == [3, 4] and summary["steps"] == TOTAL_STEPS
    for step in (3, 4):  # the same prompts as the 2-rank run's steps 3 and 4
        assert rows[step]["prompt_length/mean"] == reference_run["metrics"][step]["prompt_length/mean"]
