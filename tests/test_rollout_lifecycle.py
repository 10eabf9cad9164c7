"""The engine lifecycle contract (issue 13): a user's engine gets the trainer's weights and memory switches.

`CopyEngine` below is what a user would write as `rollout.custom_cls`: an engine with its own copy
of the model that starts with zeroed weights and only ever gets real ones through
`update_weights`, then decodes greedily from its copy. So what it generates proves which weights it
received. Checked on a real local Ray with 2 gloo ranks (FSDP2), and end to end through the trainer:
  - the pushed tensors are exactly the FSDP actor's full state (HF names; the tied head once),
  - resume / update_weights / resume / generate / release arrive in that order,
  - an unchanged weights version is not pushed twice (validation before training, then step 1),
  - a train step reports every part of the switch as timing_s/*, and validation runs through the
    same generate / score path as training.
The switch's failure path and the push rules are checked in-process with plain modules.
"""
import json
import sys

import pytest
import ray
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from hybridrl.protocol import DataProto
from hybridrl.single_controller import Dispatch, register
from hybridrl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from hybridrl.trainer.ppo.ray_trainer import RayPPOTrainer
from hybridrl.models.fsdp_utils import iter_full_state_dict
from hybridrl.models.spec import policy_model_spec
from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybridrl.workers.rollout import BaseRollout
from hybridrl.workers.rollout.mode_switch import RolloutModeSwitch
from tests.test_e2e_training import make_config as make_e2e_config, read_metrics
from tests.test_workers import RESPONSE_LENGTH, TEXTS, make_config, make_prompts, tiny  # noqa: F401

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ENGINE_FILE = '''
import json
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from hybridrl.workers.rollout import BaseRollout
from hybridrl.data.batch_layout import to_batch_layout
from hybridrl.workers.rollout.hf_rollout import mask_through_first_eos

EVENTS_DIR = {events_dir!r}


class CopyEngine(BaseRollout):
    """Its own copy of the model, zeroed at start: it generates only from what update_weights gave it."""

    weights_survive_release = True  # release frees nothing here, so an unchanged version need not come again

    def __init__(self, config, model_config=None, module=None):
        super().__init__(config, model_config, module)
        self.model = AutoModelForCausalLM.from_pretrained(model_config.path, dtype=torch.float32).eval()
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.zero_()
        self.events, self.received = [], {{}}

    def resume(self, tags):
        self._record("resume", list(tags))

    def update_weights(self, named_tensors):
        self.received = {{name: tensor.detach().clone() for name, tensor in named_tensors}}
        missing, unexpected = self.model.load_state_dict(self.received, strict=False)
        if unexpected or set(missing) - {{"lm_head.weight"}}:  # the head is tied to the embeddings
            raise RuntimeError(f"CopyEngine: unexpected {{unexpected}}, missing {{missing}}")
        self._record("update_weights", len(self.received))

    def release(self, tags):
        self._record("release", list(tags))

    @torch.no_grad()
    def generate_sequences(self, prompts):
        self._record("generate", bool(prompts.meta_info.get("validate", False)))
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        eos, pad = prompts.meta_info["eos_token_id"], prompts.meta_info["pad_token_id"]
        output = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=self.config.response_length,
                                     do_sample=False, eos_token_id=eos, pad_token_id=pad, repetition_penalty=1.0)
        generated = output[:, ids.shape[1]:]
        lengths = mask_through_first_eos(generated, [eos]).sum(dim=1).tolist()
        return to_batch_layout([row[m.bool()].tolist() for row, m in zip(ids, mask)],
                               [row[:n].tolist() for row, n in zip(generated, lengths)],
                               prompt_length=ids.shape[1], response_length=self.config.response_length,
                               pad_token_id=pad)

    def _record(self, what, detail):
        self.events.append((what, detail))
        if EVENTS_DIR:
            with open(os.path.join(EVENTS_DIR, f"events-{{dist.get_rank()}}.jsonl"), "a") as handle:
                handle.write(json.dumps([what, detail]) + "\\n")
'''


def write_engine(tmp_path, events_dir: str = "") -> str:
    path = tmp_path / "copy_engine.py"
    path.write_text(ENGINE_FILE.format(events_dir=events_dir))
    return str(path)


class ProbeWorker(ActorRolloutRefWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def actor_weights(self) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() for name, tensor in iter_full_state_dict(self.actor_module, torch.float32)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def engine_record(self, clear: bool = True) -> dict:
        """The engine's events since the last call, and the tensors it last received."""
        record = {"events": list(self.rollout.events), "received": dict(self.rollout.received)}
        if clear:
            self.rollout.events.clear()
        return record


@pytest.fixture(scope="module")
def engine_group(ray_local, tiny, tmp_path_factory):
    model_dir, _ = tiny
    engine_path = write_engine(tmp_path_factory.mktemp("engine"))
    config = make_config(model_dir, f"actor_rollout_ref.rollout.custom_cls.path={engine_path}",
                         "actor_rollout_ref.rollout.custom_cls.name=CopyEngine")
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, name_prefix="test_rollout_lifecycle")
    group = RayWorkerGroup(pool, RayClassWithInitArgs(ProbeWorker, config.actor_rollout_ref, policy_model_spec(config), role="actor_rollout",
                                                      seed=1, device="cpu"))
    group.init_model()
    yield group
    pool.remove()


def greedy_by_hand(model_dir, weights, prompts: DataProto) -> torch.Tensor:
    """Single-process greedy decoding of `weights` (what the engine must produce if it got exactly them)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(weights)
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    with torch.no_grad():
        output = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=RESPONSE_LENGTH, do_sample=False,
                                eos_token_id=prompts.meta_info["eos_token_id"],
                                pad_token_id=prompts.meta_info["pad_token_id"], repetition_penalty=1.0)
    return output[:, ids.shape[1]:]


def assert_received_the_full_state(record, weights):
    expected = {name: value for name, value in weights.items() if name != "lm_head.weight"}  # tied: sent once
    assert record["received"].keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(record["received"][name], value), name


def test_a_user_engine_gets_the_trainers_weights_in_lifecycle_order(engine_group, tiny):
    model_dir, tokenizer = tiny
    prompts = make_prompts(tokenizer, TEXTS[:4], validate=True)
    weights = engine_group.actor_weights()
    with pytest.raises(Exception, match=r"trainer mode; call rollout_mode\(\) first"):
        engine_group.generate_sequences(prompts)

    timings = engine_group.rollout_mode()
    output = engine_group.generate_sequences(prompts)
    with pytest.raises(Exception, match=r"rollout mode; call trainer_mode\(\) first"):
        engine_group.compute_log_prob(DataProto.from_dict(dict(output.batch)))
    release_timings = engine_group.trainer_mode()

    records = engine_group.engine_record()
    for rank in range(2):
        assert records[rank]["events"] == [("resume", ["weights"]), ("update_weights", len(weights[rank]) - 1),
                                           ("resume", ["kv_cache"]), ("generate", True),
                                           ("release", ["kv_cache", "weights"])]
        assert_received_the_full_state(records[rank], weights[rank])
        assert {"timing_s/resume_weights", "timing_s/update_weights", "timing_s/resume_kv_cache"} <= set(timings[rank])
        assert set(release_timings[rank]) == {"timing_s/release_engine"}
    # Each rank decoded its half of the rows from the received copy: exactly the actor's greedy answers.
    expected = greedy_by_hand(model_dir, weights[0], prompts)
    for row in range(len(prompts)):
        length = int(output.batch["response_mask"][row].sum())
        assert length > 0 and output.batch["responses"][row, :length].equal(expected[row, :length])


def test_an_unchanged_weights_version_is_not_pushed_again_and_an_update_is(engine_group, tiny):
    _, tokenizer = tiny
    engine_group.engine_record()  # forget earlier tests' events
    before = engine_group.actor_weights()[0]

    timings = engine_group.rollout_mode()
    output = engine_group.generate_sequences(make_prompts(tokenizer, TEXTS[:4], validate=True))
    engine_group.trainer_mode()
    records = engine_group.engine_record()
    assert [event[0] for event in records[0]["events"]] == ["resume", "resume", "generate", "release"]
    assert "timing_s/update_weights" not in timings[0]

    batch = DataProto.from_dict(dict(output.batch), meta_info={"temperature": 1.0})
    batch.union(engine_group.compute_log_prob(batch))
    batch.batch["advantages"] = torch.linspace(-1, 1, len(batch)).unsqueeze(-1) * batch.batch["response_mask"]
    engine_group.update_actor(batch)
    after = engine_group.actor_weights()

    timings = engine_group.rollout_mode()
    engine_group.trainer_mode()
    records = engine_group.engine_record()
    assert max((after[0][name] - before[name]).abs().max().item() for name in before) > 1e-4
    for rank in range(2):
        assert [event[0] for event in records[rank]["events"]] == ["resume", "update_weights", "resume", "release"]
        assert_received_the_full_state(records[rank], after[rank])
        assert "timing_s/update_weights" in timings[rank]


# ---------------------------------------------------------------------- the switch in-process


class ScriptedEngine(BaseRollout):
    """Records the calls; fails a resume of `fail_on` with MemoryError (as sglang's EngineMemoryError would)."""

    def __init__(self, shares: bool = False, survives: bool = False, fail_on: str | None = None):
        super().__init__(config=None)
        self.shares_trainer_weights, self.weights_survive_release, self.fail_on = shares, survives, fail_on
        self.calls = []

    def resume(self, tags):
        self.calls.append(("resume", tags))
        if self.fail_on in tags:
            raise MemoryError(f"no room for {self.fail_on}")

    def update_weights(self, named_tensors):
        self.calls.append(("update_weights", sorted(name for name, _ in named_tensors)))

    def release(self, tags):
        self.calls.append(("release", tags))

    def generate_sequences(self, prompts):
        raise AssertionError("not used")


def round_trip(switch, version):
    metrics = switch.rollout_mode(version)
    switch.trainer_mode()
    return metrics


def test_the_push_follows_the_version_and_what_a_release_keeps():
    module = nn.Linear(2, 3)
    dropping = ScriptedEngine(survives=False)
    switch = RolloutModeSwitch(module, dropping)
    round_trip(switch, 0)
    round_trip(switch, 0)
    assert [call for call in dropping.calls if call[0] == "update_weights"] == [("update_weights", ["bias", "weight"])] * 2

    keeping = ScriptedEngine(survives=True)
    switch = RolloutModeSwitch(module, keeping)
    assert "timing_s/update_weights" in round_trip(switch, 0)
    assert "timing_s/update_weights" not in round_trip(switch, 0)
    assert "timing_s/update_weights" in round_trip(switch, 1)
    assert switch.weights_pushed == 2

    sharing = ScriptedEngine(shares=True)
    switch = RolloutModeSwitch(module, sharing)
    round_trip(switch, 0)
    round_trip(switch, 1)
    assert [call[0] for call in sharing.calls] == ["resume", "resume", "release"] * 2


def test_a_failed_rollout_mode_releases_what_resumed_and_raises():
    engine = ScriptedEngine(survives=True, fail_on="kv_cache")
    switch = RolloutModeSwitch(nn.Linear(2, 3), engine)
    with pytest.raises(MemoryError, match="no room for kv_cache"):
        switch.rollout_mode(0)
    assert [call[0] for call in engine.calls] == ["resume", "update_weights", "resume", "release"]
    assert not switch.in_rollout_mode and switch.engine_weights_version is None  # the next try pushes again
    with pytest.raises(RuntimeError, match="not in rollout mode"):
        switch.trainer_mode()
    engine.fail_on = None
    switch.rollout_mode(0)
    assert [call[0] for call in engine.calls[-3:]] == ["resume", "update_weights", "resume"]
    with pytest.raises(RuntimeError, match="already in rollout mode"):
        switch.rollout_mode(0)


# ---------------------------------------------------------------------- through the trainer

def test_train_steps_and_validation_drive_a_user_engine_through_one_path(ray_local, toy_task, tmp_path, monkeypatch):
    """Validation before training, 2 steps, validation at step 2, with the user's engine: the rollout-mode windows,
    the pushes (none for step 1: validation already loaded version 0), the timing metrics, and validation's use of
    the training path's _generate / _score."""
    events_dir = tmp_path / "events"
    events_dir.mkdir()
    engine_path = write_engine(tmp_path, str(events_dir))
    run_dir = str(tmp_path / "run")
    config = make_e2e_config(toy_task, run_dir, f"actor_rollout_ref.rollout.custom_cls.path={engine_path}",
                             "actor_rollout_ref.rollout.custom_cls.name=CopyEngine", "trainer.val_before_train=true",
                             "trainer.test_freq=2")
    scored_with = []
    real_score = RayPPOTrainer._score

    def recording_score(self, batch, reward_fn):
        scored_with.append("val" if reward_fn is self.val_reward_fn else "train")
        return real_score(self, batch, reward_fn)

    monkeypatch.setattr(RayPPOTrainer, "_score", recording_score)
    trainer = RayPPOTrainer(config)
    trainer.init_workers()
    try:
        summary = trainer.fit()
    finally:
        trainer.shutdown()

    assert summary["steps"] == 2 and summary["val_score_before"] is not None
    assert scored_with == ["val", "train", "train", "val"]  # one val batch (val_batch_size: the whole set)
    events = [tuple(json.loads(line)) for line in (events_dir / "events-0.jsonl").read_text().splitlines()]
    windows, current = [], []
    for what, detail in events:
        current.append(what if what != "generate" else f"generate(validate={detail})")
        if what == "release":
            windows.append(current)
            current = []
    switch_in, switch_out = ["resume", "update_weights", "resume"], ["release"]
    assert windows == [
        switch_in + ["generate(validate=True)"] + switch_out,  # validation before training: version 0 pushed
        ["resume", "resume", "generate(validate=False)"] + switch_out,  # step 1: version 0 already there
        switch_in + ["generate(validate=False)"] + switch_out,  # step 2: version 1
        switch_in + ["generate(validate=True)"] + switch_out,  # validation after step 2: version 2
    ]
    steps = read_metrics(run_dir)
    parts = ["timing_s/rollout_mode", "timing_s/gen", "timing_s/trainer_mode", "timing_s/resume_weights",
             "timing_s/resume_kv_cache", "timing_s/release_engine", "timing_s/reward", "timing_s/old_log_prob",
             "timing_s/update_actor"]
    train_steps = [m for m in steps if "timing_s/step" in m]
    assert len(train_steps) == 2
    for m in train_steps:
        assert all(m[key] >= 0 for key in parts), {key: m.get(key) for key in parts}
    assert "timing_s/update_weights" not in train_steps[0] and train_steps[1]["timing_s/update_weights"] >= 0
