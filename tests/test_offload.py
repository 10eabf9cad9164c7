"""param_offload / optimizer_offload (hybridrl/models/offload.py) on the CPU path.

On a CPU-only machine the compute device is the CPU, so every move is a no-op; what these tests prove is
that the code path keeps the state intact and wired: the Parameter objects FSDP2 and the optimizer hold
survive a round trip through `module.to`, AdamW's state is where it belongs, gradients are dropped
when parameters are parked, and a whole run of real workers (2 gloo ranks, Ray) with both flags on
computes exactly what the run without them does, checkpoints included. tests/gpu/test_scale_features_gpu.py
checks the moves themselves (CPU, pinned) and the GPU memory they free.
"""
import sys

import pytest
import ray
import torch
import torch.distributed as dist

from hybridrl.config.compose import compose_config
from hybridrl.config.validation import ConfigError, validate_config
from hybridrl.protocol import DataProto
from hybridrl.single_controller import Dispatch, register
from hybridrl.single_controller.ray import (RayClassWithInitArgs, RayResourcePool, RayWorkerGroup,
                                            create_colocated_worker_cls)
from hybridrl.models.fsdp_utils import iter_full_state_dict, load_hf_model, shard_model
from hybridrl.models.offload import (FSDPOffload, load_fsdp_params, load_optimizer_state, offload_fsdp_params,
                                    offload_optimizer_state)
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.models.spec import critic_model_spec, policy_model_spec
from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybridrl.workers.critic import CriticWorker

# Ray workers cannot import this test module by name; ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROMPT_LENGTH, RESPONSE_LENGTH = 6, 8
TEXTS = ["what is 12 plus 7 ? the answer is 19", "count to five : 1 2 3 4 5", "the cat sat on the mat",
         "seven times six is 42"]
OFFLOAD = ["actor_rollout_ref.actor.fsdp_config.param_offload=true",
           "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
           "actor_rollout_ref.ref.fsdp_config.param_offload=true",
           "critic.model.fsdp_config.param_offload=true", "critic.model.fsdp_config.optimizer_offload=true"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = build_tokenizer(TEXTS * 20, vocab_size=128)
    model_dir = build_tiny_model(str(tmp_path_factory.mktemp("tiny_offload")), tokenizer, hidden_size=32,
                                 num_heads=4, num_kv_heads=2, intermediate_size=64)
    return model_dir, tokenizer


# ---------------------------------------------------------------------- the functions, one process

@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg_init", rank=0, world_size=1)
    yield "cpu"
    dist.destroy_process_group()


def trained(model_dir, device):
    """An FSDP2 model and its AdamW after one step: gradients and Adam moments exist."""
    module = shard_model(load_hf_model(model_dir), strategy="fsdp2", device=device, mixed_precision=False)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    train_step(module, optimizer, seed=0)
    return module, optimizer


def train_step(module, optimizer, seed: int) -> None:
    input_ids = torch.randint(4, 100, (2, 10), generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad()
    module(input_ids=input_ids).logits.float().pow(2).mean().backward()
    optimizer.step()


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def placement(module, optimizer) -> dict[str, set[str]]:
    """The device types of the parameters' local shards, their gradients, Adam's moments and step counters."""
    states = [optimizer.state[parameter] for parameter in module.parameters()]
    return {"params": {local(p).device.type for p in module.parameters()},
            "grads": {local(p.grad).device.type for p in module.parameters()},
            "moments": {local(s[key]).device.type for s in states for key in ("exp_avg", "exp_avg_sq")},
            "steps": {s["step"].device.type for s in states}}


def test_a_round_trip_keeps_the_parameter_objects_and_a_step_after_it_equals_one_without(one_rank, tiny):
    moved, moved_optimizer = trained(tiny[0], one_rank)
    kept, kept_optimizer = trained(tiny[0], one_rank)
    parameters = list(moved.parameters())
    assert all(p.grad is not None for p in parameters) and len(moved_optimizer.state) == len(parameters)

    offload_fsdp_params(moved)
    offload_optimizer_state(moved_optimizer)
    assert placement(moved, moved_optimizer) == {"params": {"cpu"}, "grads": {"cpu"}, "moments": {"cpu"},
                                                 "steps": {"cpu"}}
    load_fsdp_params(moved, one_rank)
    load_optimizer_state(moved_optimizer, one_rank)
    assert placement(moved, moved_optimizer) == {"params": {one_rank}, "grads": {one_rank}, "moments": {one_rank},
                                                 "steps": {"cpu"}}  # AdamW's counters stay where torch keeps them

    # The optimizer still steps the very Parameter objects the module computes with.
    assert all(a is b for a, b in zip(moved.parameters(), parameters))
    assert all(a is b for a, b in zip(moved_optimizer.param_groups[0]["params"], parameters))
    before = [p.detach().full_tensor().clone() for p in parameters]
    train_step(moved, moved_optimizer, seed=1)
    train_step(kept, kept_optimizer, seed=1)
    for after, start, reference in zip(moved.parameters(), before, kept.parameters()):
        assert torch.equal(after.full_tensor(), reference.full_tensor())
    assert max((p.full_tensor() - b).abs().max().item() for p, b in zip(moved.parameters(), before)) > 1e-4


def test_a_phase_loads_what_it_needs_and_parks_it_again_even_when_it_raises(one_rank, tiny):
    module, optimizer = trained(tiny[0], one_rank)
    offload = FSDPOffload(module, optimizer, param_offload=True, optimizer_offload=True, device=one_rank)
    offload.park()
    assert all(p.grad is None for p in module.parameters())  # parked parameters leave their gradients behind
    with offload.loaded(optimizer=True):
        train_step(module, optimizer, seed=1)
        assert all(p.grad is not None for p in module.parameters())
    assert all(p.grad is None for p in module.parameters())
    with pytest.raises(RuntimeError, match="a phase failed"):
        with offload.loaded(optimizer=True):
            train_step(module, optimizer, seed=2)
            raise RuntimeError("a phase failed")
    assert all(p.grad is None for p in module.parameters())

    without = FSDPOffload(module, optimizer, param_offload=False, optimizer_offload=True, device=one_rank)
    with without.loaded(optimizer=True):
        train_step(module, optimizer, seed=3)
    assert all(p.grad is not None for p in module.parameters())  # without param_offload gradients stay


def test_offload_needs_the_optimizer_and_refuses_fsdp1(one_rank, tiny):
    fsdp2 = shard_model(load_hf_model(tiny[0]), strategy="fsdp2", device=one_rank, mixed_precision=False)
    with pytest.raises(ValueError, match="optimizer_offload=True needs the model's optimizer"):
        FSDPOffload(fsdp2, None, param_offload=False, optimizer_offload=True, device=one_rank)
    fsdp1 = shard_model(load_hf_model(tiny[0]), strategy="fsdp", device=one_rank, mixed_precision=False)
    with pytest.raises(TypeError, match=r"FSDP2 \(strategy=fsdp2\) only.*set fsdp_config.offload_policy=true"):
        FSDPOffload(fsdp1, None, param_offload=True, optimizer_offload=False, device=one_rank)
    FSDPOffload(fsdp1, None, param_offload=False, optimizer_offload=False, device=one_rank).park()  # nothing to do


# ---------------------------------------------------------------------- real workers, 2 ranks

class ActorProbe(ActorRolloutRefWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights(self) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() for name, tensor in iter_full_state_dict(self.actor_module, torch.float32)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def holds_gradients(self) -> bool:
        return any(p.grad is not None for p in self.actor_module.parameters())


class CriticProbe(CriticWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights(self) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() for name, tensor in iter_full_state_dict(self.critic_module, torch.float32)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def holds_gradients(self) -> bool:
        return any(p.grad is not None for p in self.critic_module.parameters())


def make_config(model_dir: str, *overrides: str):
    return validate_config(compose_config([
        f"actor_rollout_ref.model.path={model_dir}", "data.train_files=unused.parquet", "data.val_files=unused.parquet",
        f"data.max_prompt_length={PROMPT_LENGTH}", f"data.max_response_length={RESPONSE_LENGTH}",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.rollout.n=1", "trainer.n_gpus_per_node=2",
        "algorithm=gae", "critic.optim.lr=1e-2", "critic.ppo_mini_batch_size=2", *overrides]))


@pytest.fixture(scope="module")
def groups(ray_local, tiny):
    model_dir, tokenizer = tiny
    plain, offload = make_config(model_dir), make_config(model_dir, *OFFLOAD)
    assert offload.actor_rollout_ref.actor.fsdp_config.param_offload and offload.critic.model.fsdp_config.param_offload
    common = {"seed": 1, "device": "cpu"}
    roles = {"plain": RayClassWithInitArgs(ActorProbe, plain.actor_rollout_ref, policy_model_spec(plain), role="actor_rollout_ref", **common),
             "offload": RayClassWithInitArgs(ActorProbe, offload.actor_rollout_ref, policy_model_spec(offload), role="actor_rollout_ref",
                                             tokenizer=tokenizer, **common),
             "critic_plain": RayClassWithInitArgs(CriticProbe, plain.critic, critic_model_spec(plain), rollout_n=1, **common),
             "critic_offload": RayClassWithInitArgs(CriticProbe, offload.critic, critic_model_spec(offload), rollout_n=1, **common)}
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, name_prefix="test_offload")
    spawned = RayWorkerGroup(pool, create_colocated_worker_cls(roles)).spawn(prefix_set=set(roles))
    for group in spawned.values():
        group.init_model()
    yield spawned
    pool.remove()


def prompts(tokenizer) -> DataProto:
    encoded = tokenizer([t[:20] for t in TEXTS], padding="max_length", max_length=PROMPT_LENGTH, truncation=True,
                        return_tensors="pt")
    mask = encoded["attention_mask"]
    return DataProto.from_dict({"input_ids": encoded["input_ids"], "attention_mask": mask,
                                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
                               meta_info={"eos_token_id": tokenizer.eos_token_id,
                                          "pad_token_id": tokenizer.pad_token_id, "validate": True})


def generate(group, batch: DataProto) -> DataProto:
    """One generation inside a rollout-mode window, as the trainer runs it."""
    group.rollout_mode()
    output = group.generate_sequences(batch)
    group.trainer_mode()
    return output


def assert_same_weights(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(first[name], second[name], atol=1e-6, rtol=0, msg=name)


def test_an_offloaded_run_computes_what_the_plain_run_does(groups, tiny, tmp_path):
    _, tokenizer = tiny
    plain, offload = groups["plain"], groups["offload"]
    # greedy generation: the same responses, whether the parameters came from the CPU or not
    generated = generate(offload, prompts(tokenizer))
    assert torch.equal(generated.batch["responses"], generate(plain, prompts(tokenizer)).batch["responses"])
    batch = DataProto.from_dict(dict(generated.batch))
    log_probs = offload.compute_log_prob(batch)
    torch.testing.assert_close(log_probs.batch["old_log_probs"], plain.compute_log_prob(batch).batch["old_log_probs"],
                               atol=1e-6, rtol=0)
    ref_log_prob = offload.compute_ref_log_prob(batch).batch["ref_log_prob"]
    torch.testing.assert_close(ref_log_prob, plain.compute_ref_log_prob(batch).batch["ref_log_prob"],
                               atol=1e-6, rtol=0)
    batch.batch["old_log_probs"] = log_probs.batch["old_log_probs"]
    batch.batch["ref_log_prob"] = ref_log_prob
    batch.batch["advantages"] = torch.linspace(-1, 1, len(batch)).unsqueeze(-1) * batch.batch["response_mask"]
    start = plain.weights()[0]

    # two updates; the offloaded actor saves a checkpoint (its state parked) between them
    for group in (plain, offload):
        group.update_actor(batch)
    offload.save_checkpoint(str(tmp_path / "actor"))
    metrics = {name: group.update_actor(batch).meta_info["metrics"] for name, group in groups.items()
               if name in ("plain", "offload")}
    assert metrics["offload"]["actor/pg_loss"] == pytest.approx(metrics["plain"]["actor/pg_loss"], abs=1e-6)
    after_two = offload.weights()[0]
    assert_same_weights(after_two, plain.weights()[0])
    assert max((after_two[name] - start[name]).abs().max().item() for name in start) > 1e-3
    torch.testing.assert_close(offload.compute_log_prob(batch).batch["old_log_probs"],
                               plain.compute_log_prob(batch).batch["old_log_probs"], atol=1e-6, rtol=0)
    # parking dropped the offloaded actor's gradients; the plain one keeps them between phases
    assert offload.holds_gradients() == [False, False] and plain.holds_gradients() == [True, True]

    # resuming from the checkpoint and repeating the second update lands on the same weights
    offload.load_checkpoint(str(tmp_path / "actor"), 1)  # saved after one update: version 1
    offload.update_actor(batch)
    assert_same_weights(offload.weights()[0], after_two)


def test_an_offloaded_critic_computes_what_the_plain_critic_does(groups, tiny, tmp_path):
    _, tokenizer = tiny
    plain, offload = groups["critic_plain"], groups["critic_offload"]
    batch = DataProto.from_dict(dict(generate(groups["plain"], prompts(tokenizer)).batch))
    values = offload.compute_values(batch).batch["values"]
    torch.testing.assert_close(values, plain.compute_values(batch).batch["values"], atol=1e-6, rtol=0)
    batch.batch["values"] = values
    batch.batch["returns"] = batch.batch["response_mask"].float()
    for group in (plain, offload):
        group.update_critic(batch)
    offload.save_checkpoint(str(tmp_path / "critic"))
    losses = [group.update_critic(batch).meta_info["metrics"]["critic/vf_loss"] for group in (plain, offload)]
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)
    after_two = offload.weights()[0]
    assert_same_weights(after_two, plain.weights()[0])
    torch.testing.assert_close(offload.compute_values(batch).batch["values"],
                               plain.compute_values(batch).batch["values"], atol=1e-6, rtol=0)
    assert offload.holds_gradients() == [False, False] and plain.holds_gradients() == [True, True]
    offload.load_checkpoint(str(tmp_path / "critic"))
    offload.update_critic(batch)
    assert_same_weights(offload.weights()[0], after_two)


# ---------------------------------------------------------------------- config checks

def problems_for(*overrides):
    with pytest.raises(ConfigError) as caught:
        validate_config(compose_config(["data.train_files=x.parquet", "data.val_files=x.parquet", *overrides]))
    return caught.value.problems


def test_fsdp1_and_offload_policy_refuse_parking_with_a_pointer_to_what_works():
    assert problems_for("actor_rollout_ref.actor.strategy=fsdp",
                        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                        "actor_rollout_ref.ref.fsdp_config.param_offload=true") == [
        "actor_rollout_ref.actor.fsdp_config.param_offload: expected False with actor_rollout_ref.actor.strategy="
        "'fsdp' (parking state on the CPU between phases is implemented for fsdp2 only; set "
        "actor_rollout_ref.actor.fsdp_config.offload_policy=true (FSDP1's own CPUOffload: parameters, gradients and "
        "optimizer state on the CPU all the time) or actor_rollout_ref.actor.strategy=fsdp2), got True",
        "actor_rollout_ref.ref.fsdp_config.param_offload: expected False with actor_rollout_ref.ref.strategy='fsdp' "
        "(parking state on the CPU between phases is implemented for fsdp2 only; set "
        "actor_rollout_ref.ref.strategy=fsdp2), got True",
    ]
    assert problems_for("algorithm=gae", "critic.model.fsdp_config.offload_policy=true",
                        "critic.model.fsdp_config.optimizer_offload=true") == [
        "critic.model.fsdp_config.optimizer_offload: expected False with critic.model.fsdp_config.offload_policy=true "
        "(that keeps parameters, gradients and optimizer state on the CPU all the time; optimizer_offload parks them "
        "there between phases only: choose one), got True",
    ]
    assert problems_for("actor_rollout_ref.model.lora_rank=8",
                        "actor_rollout_ref.ref.fsdp_config.param_offload=true") == [
        "actor_rollout_ref.ref.fsdp_config.param_offload: expected False when "
        "actor_rollout_ref.actor.fsdp_config.param_offload=false and actor_rollout_ref.model.lora_rank > 0 (the LoRA "
        "reference is the actor's own module with its adapters disabled, so it is parked exactly when the actor is), "
        "got True",
    ]


def test_fsdp2_accepts_the_flags_and_a_disabled_critic_is_not_checked():
    config = validate_config(compose_config(["data.train_files=x.parquet", "data.val_files=x.parquet", *OFFLOAD,
                                             "critic.strategy=fsdp"]))  # GRPO: no critic
    fsdp_config = config.actor_rollout_ref.actor.fsdp_config
    assert fsdp_config.param_offload and fsdp_config.optimizer_offload
    assert config.actor_rollout_ref.ref.fsdp_config.param_offload and not config.critic.enable
