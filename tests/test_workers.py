"""Workers on a real local Ray: 2 CPU ranks over gloo, a tiny random Qwen2 saved to disk, FSDP2 and FSDP1.

One colocated worker group (one process per rank) holds every role under test, so the model
processes start once for the whole module:
  main    actor_rollout_ref, FSDP2, KL loss, rollout log-probs on  (generation, log-probs, update)
  mb1     actor, FSDP2, micro-batch 1  \\  the gradient-accumulation test: same batch, same start,
  mb4     actor, FSDP2, micro-batch 4  /   the weights after one update must agree
  fsdp1   actor_rollout, FSDP1 (strategy=fsdp), which torch 2.13 runs on CPU/gloo
  critic  CriticWorker
"""
import sys

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from hybridrl.config.compose import compose_config
from hybridrl.config.validation import validate_config
from hybridrl.protocol import DataProto
from hybridrl.single_controller import Dispatch, register
from hybridrl.single_controller.ray import (RayClassWithInitArgs, RayResourcePool, RayWorkerGroup,
                                            create_colocated_worker_cls)
from hybridrl.algorithms.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
from hybridrl.models.fsdp_utils import iter_full_state_dict, iter_hf_weights, iter_unsharded_parameters
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.algorithms.torch_functional import entropy_from_logits, logprobs_from_logits
from hybridrl.models.spec import critic_model_spec, policy_model_spec
from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybridrl.workers.critic import CriticWorker

# Ray workers cannot import this test module by name; ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROMPT_LENGTH, RESPONSE_LENGTH, TEMPERATURE = 6, 8, 0.7
TEXTS = ["what is 12 plus 7 ? the answer is 19", "count to five : 1 2 3 4 5", "the cat sat on the mat",
         "seven times six is 42", "hello world , hello again", "a b c d e f g"]


class ProbeActor(ActorRolloutRefWorker):
    """The worker under test plus one read-only probe: the full actor weights, as HF names."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def actor_weights(self) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() for name, tensor in iter_full_state_dict(self.actor_module, torch.float32)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def unsharded_parameters(self) -> dict[str, torch.Tensor]:
        """What the SGLang weight sync reads (one FSDP2 unit gathered at a time), copied as it streams by."""
        return {name: tensor.clone() for name, tensor in iter_unsharded_parameters(self.actor_module)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hf_weights(self) -> dict[str, torch.Tensor]:
        """What the SGLang weight sync sends: HF names, LoRA adapters merged into their base weights."""
        return {name: tensor.clone() for name, tensor in iter_hf_weights(self.actor_module)}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def count_all_gathers(self, prompts: DataProto, in_rollout_mode: bool) -> DataProto:
        """FSDP2 all-gathers run by one generation, in rollout mode (the hf engine's resume gathers once) or
        straight from trainer mode (counted at torch's internal foreach_all_gather, which every FSDP2 unshard
        goes through)."""
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group

        original, calls = _fsdp_param_group.foreach_all_gather, []
        _fsdp_param_group.foreach_all_gather = lambda *a, **k: calls.append(1) or original(*a, **k)
        try:
            if in_rollout_mode:
                self.rollout_mode()
                self.generate_sequences(prompts)
                self.trainer_mode()
            else:
                with torch.no_grad():
                    self.rollout.generate_sequences(prompts)
        finally:
            _fsdp_param_group.foreach_all_gather = original
        return DataProto(meta_info={"metrics": {"all_gathers": len(calls)}})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tokenizer = build_tokenizer(TEXTS * 20, vocab_size=128)
    model_dir = build_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen2")), tokenizer, hidden_size=32,
                                 num_heads=4, num_kv_heads=2, intermediate_size=64)
    return model_dir, tokenizer


def make_config(model_dir: str, *overrides: str):
    base = [f"actor_rollout_ref.model.path={model_dir}", "data.train_files=unused.parquet",
            "data.val_files=unused.parquet", f"data.max_prompt_length={PROMPT_LENGTH}",
            f"data.max_response_length={RESPONSE_LENGTH}", "data.train_batch_size=8",
            f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.rollout.n=1", "trainer.n_gpus_per_node=2"]
    return validate_config(compose_config(base + list(overrides)))


@pytest.fixture(scope="module")
def groups(ray_local, tiny):
    model_dir, _ = tiny
    main = make_config(model_dir, "actor_rollout_ref.actor.use_kl_loss=true",
                       "actor_rollout_ref.rollout.calculate_log_probs=true")
    exact = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
             "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01"]
    mb1 = make_config(model_dir, *exact, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
    mb4 = make_config(model_dir, *exact, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    fsdp1 = make_config(model_dir, "actor_rollout_ref.actor.strategy=fsdp")
    gae = make_config(model_dir, "algorithm=gae", "critic.optim.lr=3e-3", "critic.ppo_micro_batch_size_per_gpu=1")
    lora = make_config(model_dir, "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
                       "actor_rollout_ref.actor.optim.lr=1e-2")
    common = {"seed": 1, "device": "cpu"}
    roles = {
        "main": RayClassWithInitArgs(ProbeActor, main.actor_rollout_ref, policy_model_spec(main), role="actor_rollout_ref", **common),
        "mb1": RayClassWithInitArgs(ProbeActor, mb1.actor_rollout_ref, policy_model_spec(mb1), role="actor", **common),
        "mb4": RayClassWithInitArgs(ProbeActor, mb4.actor_rollout_ref, policy_model_spec(mb4), role="actor", **common),
        "fsdp1": RayClassWithInitArgs(ProbeActor, fsdp1.actor_rollout_ref, policy_model_spec(fsdp1), role="actor_rollout", **common),
        "critic": RayClassWithInitArgs(CriticWorker, gae.critic, critic_model_spec(gae), rollout_n=1, **common),
        "lora": RayClassWithInitArgs(ProbeActor, lora.actor_rollout_ref, policy_model_spec(lora), role="actor", **common),
    }
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, name_prefix="test_workers")
    spawned = RayWorkerGroup(pool, create_colocated_worker_cls(roles)).spawn(prefix_set=set(roles))
    for group in spawned.values():
        group.init_model()
    yield spawned
    pool.remove()


def generate(group, prompts: DataProto) -> DataProto:
    """One generation inside a rollout-mode window, as the trainer runs it."""
    group.rollout_mode()
    output = group.generate_sequences(prompts)
    group.trainer_mode()
    return output


def make_prompts(tokenizer, texts, **meta) -> DataProto:
    encoded = tokenizer([t[:20] for t in texts], padding="max_length", max_length=PROMPT_LENGTH, truncation=True,
                        return_tensors="pt")
    mask = encoded["attention_mask"]
    meta = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, **meta}
    return DataProto.from_dict({"input_ids": encoded["input_ids"], "attention_mask": mask,
                                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}, meta_info=meta)


def hf_log_probs(model_dir, weights, batch: DataProto, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process reference: HF forward of `weights` on the batch's tokens -> response log-probs, entropy."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(weights)
    with torch.no_grad():
        logits = model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                       position_ids=batch.batch["position_ids"]).logits
    logits = logits[:, -RESPONSE_LENGTH - 1:-1] / temperature
    return logprobs_from_logits(logits, batch.batch["responses"]), entropy_from_logits(logits)


# ---------------------------------------------------------------------- rollout

def test_generate_shapes_padding_and_positions(groups, tiny):
    _, tokenizer = tiny
    prompts = make_prompts(tokenizer, TEXTS[:4] + ["hi", "a b"] + TEXTS[4:], validate=False)
    out = generate(groups["main"], prompts)
    rows = len(prompts)
    assert out.batch["prompts"].equal(prompts.batch["input_ids"])  # left-padded prompts come back as given
    assert out.batch["responses"].shape == (rows, RESPONSE_LENGTH)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert out.batch[key].shape == (rows, PROMPT_LENGTH + RESPONSE_LENGTH)
    assert out.batch["input_ids"].equal(torch.cat([prompts.batch["input_ids"], out.batch["responses"]], dim=1))
    mask = out.batch["response_mask"]
    assert out.batch["attention_mask"][:, PROMPT_LENGTH:].equal(mask)
    assert out.batch["attention_mask"][:, :PROMPT_LENGTH].equal(prompts.batch["attention_mask"])
    # right padding: after the mask ends, only pad ids
    assert (out.batch["responses"][mask == 0] == tokenizer.pad_token_id).all()
    # positions continue the prompt's last position one by one
    last = prompts.batch["position_ids"][:, -1:]
    assert out.batch["position_ids"][:, PROMPT_LENGTH:].equal(last + torch.arange(1, RESPONSE_LENGTH + 1))
    assert out.batch["rollout_log_probs"].shape == (rows, RESPONSE_LENGTH)
    assert (out.batch["rollout_log_probs"][mask == 1] < 0).all()


def test_greedy_validation_is_deterministic_and_stops_at_the_first_eos(groups, tiny):
    _, tokenizer = tiny
    prompts = make_prompts(tokenizer, TEXTS[:4], validate=True)
    first = generate(groups["main"], prompts).batch["responses"]
    assert first.equal(generate(groups["main"], prompts).batch["responses"])
    sampled = generate(groups["main"], make_prompts(tokenizer, TEXTS[:4], validate=False))
    assert not sampled.batch["responses"].equal(first)  # temperature 0.7 on a random model: not the greedy path
    # The same prompt on both ranks (one row each): each rank samples with its own seed.
    twice = generate(groups["main"], make_prompts(tokenizer, TEXTS[:1] * 2, validate=False))
    assert not twice.batch["responses"][0].equal(twice.batch["responses"][1])

    # Declare as EOS a token that greedy decoding of row 0 emits mid-way: generation must stop right there.
    eos_position = 3
    eos = int(first[0, eos_position])
    stopped = generate(groups["main"], make_prompts(tokenizer, TEXTS[:4], validate=True, eos_token_id=eos))
    responses, mask = stopped.batch["responses"], stopped.batch["response_mask"]
    for row in range(len(first)):
        hits = (first[row] == eos).nonzero().flatten().tolist()
        end = hits[0] + 1 if hits else RESPONSE_LENGTH  # up to and including the first EOS
        assert mask[row].tolist() == [1] * end + [0] * (RESPONSE_LENGTH - end)
        assert responses[row, :end].equal(first[row, :end])
        assert (responses[row, end:] == tokenizer.pad_token_id).all()
    assert mask[0].sum() <= eos_position + 1


def test_fsdp2_generation_gathers_each_layer_once_not_once_per_token(groups, tiny):
    _, tokenizer = tiny
    # An EOS id outside the vocabulary: every row runs all RESPONSE_LENGTH steps on both ranks.
    prompts = make_prompts(tokenizer, TEXTS[:4], validate=True, eos_token_id=len(tokenizer) + 7)
    with_manager = groups["main"].count_all_gathers(prompts, in_rollout_mode=True).meta_info["metrics"]
    without = groups["main"].count_all_gathers(prompts, in_rollout_mode=False).meta_info["metrics"]
    fsdp_units = 2 + 1  # two decoder layers and the root
    assert all(1 <= count <= fsdp_units for count in with_manager["all_gathers"])
    assert all(count >= RESPONSE_LENGTH * 2 for count in without["all_gathers"])


def test_fsdp1_runs_on_cpu_generation_log_probs_and_update(groups, tiny):
    model_dir, tokenizer = tiny
    group = groups["fsdp1"]
    weights = group.actor_weights()[0]
    greedy = make_prompts(tokenizer, TEXTS[:4], validate=True)
    first = generate(group, greedy).batch["responses"]
    # Ranks stop at different steps (EOS = a token row 0 emits early): no collective may hang.
    eos = int(first[0, 1])
    out = generate(group, make_prompts(tokenizer, TEXTS[:4], validate=True, eos_token_id=eos))
    assert out.batch["response_mask"][0].sum() <= 2

    batch = DataProto.from_dict(dict(out.batch))
    log_probs = group.compute_log_prob(batch).batch["old_log_probs"]
    expected, _ = hf_log_probs(model_dir, weights, batch, TEMPERATURE)
    torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=0)

    batch.batch["old_log_probs"] = log_probs
    batch.batch["advantages"] = torch.linspace(-1, 1, len(batch)).unsqueeze(-1) * batch.batch["response_mask"]
    metrics = group.update_actor(batch).meta_info["metrics"]
    assert all(torch.isfinite(torch.tensor(v)).all() for v in metrics.values())
    after = group.actor_weights()[0]
    assert max((after[k] - weights[k]).abs().max().item() for k in weights) > 1e-4


# ---------------------------------------------------------------------- actor

def test_compute_log_prob_equals_a_single_process_hf_forward(groups, tiny):
    model_dir, tokenizer = tiny
    group = groups["main"]
    out = generate(group, make_prompts(tokenizer, TEXTS[:4], validate=False))
    batch = DataProto.from_dict(dict(out.batch))
    result = group.compute_log_prob(batch)
    expected_log_probs, expected_entropy = hf_log_probs(model_dir, group.actor_weights()[0], batch, TEMPERATURE)
    torch.testing.assert_close(result.batch["old_log_probs"], expected_log_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(result.batch["entropys"], expected_entropy, atol=1e-5, rtol=0)
    # The rollout's own log-probs (sampling-time logits / temperature) score the same tokens.
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(batch.batch["rollout_log_probs"][mask], expected_log_probs[mask], atol=1e-4, rtol=0)


def test_update_actor_changes_the_weights_and_reports_finite_metrics(groups, tiny):
    _, tokenizer = tiny
    group = groups["main"]
    out = generate(group, make_prompts(tokenizer, TEXTS[:4] * 2, validate=False))
    batch = DataProto.from_dict(dict(out.batch), meta_info={"temperature": TEMPERATURE})
    batch.union(group.compute_log_prob(batch))
    batch.union(group.compute_ref_log_prob(batch))
    batch.batch["advantages"] = torch.linspace(-1, 1, len(batch)).unsqueeze(-1) * batch.batch["response_mask"]
    before = group.actor_weights()[0]

    metrics = group.update_actor(batch).meta_info["metrics"]

    expected = {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/entropy",
                "actor/kl_loss", "actor/kl_coef", "actor/grad_norm", "actor/lr"}
    assert expected <= set(metrics)
    assert all(torch.isfinite(torch.tensor(v)).all() for v in metrics.values())
    # 8 rows, mini-batch 4 prompts -> 2 rows per rank, 2 steps; both ranks reported each step's global mean
    assert len(metrics["actor/pg_loss"]) == 2 * 2 and metrics["actor/pg_loss"][0] == metrics["actor/pg_loss"][2]
    assert metrics["actor/lr"] == [1e-3, 1e-3]
    # the first step starts on-policy: ratio 1, no clipping, no KL to the (identical) reference
    assert metrics["actor/ppo_kl"][0] == pytest.approx(0.0, abs=1e-6)
    assert metrics["actor/kl_loss"][0] == pytest.approx(0.0, abs=1e-6)
    after = group.actor_weights()[0]
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-4
    new_log_probs = group.compute_log_prob(batch).batch["old_log_probs"]
    assert not torch.allclose(new_log_probs, batch.batch["old_log_probs"], atol=1e-4)


def fixed_update_batch(model_dir, tokenizer, weights) -> DataProto:
    """16 rows whose responses end at different lengths, so micro-batches hold different token counts."""
    prompts = make_prompts(tokenizer, (TEXTS * 3)[:16])
    generator = torch.Generator().manual_seed(0)
    responses = torch.randint(4, len(tokenizer), (16, RESPONSE_LENGTH), generator=generator)
    lengths = torch.tensor([1, 8, 2, 7, 3, 6, 4, 5, 2, 1, 3, 2, 1, 3, 2, 4])  # rank 0: 36 tokens, rank 1: 18
    response_mask = (torch.arange(RESPONSE_LENGTH) < lengths.unsqueeze(-1)).long()
    attention_mask = torch.cat([prompts.batch["attention_mask"], response_mask], dim=1)
    last = prompts.batch["position_ids"][:, -1:]
    batch = DataProto.from_dict({
        "input_ids": torch.cat([prompts.batch["input_ids"], responses], dim=1), "attention_mask": attention_mask,
        "position_ids": torch.cat([prompts.batch["position_ids"], last + torch.arange(1, RESPONSE_LENGTH + 1)], 1),
        "responses": responses, "response_mask": response_mask,
        "advantages": torch.randn(16, RESPONSE_LENGTH, generator=generator) * response_mask,
    })
    old_log_probs, _ = hf_log_probs(model_dir, weights, batch, TEMPERATURE)
    batch.batch["old_log_probs"] = old_log_probs
    batch.batch["ref_log_prob"] = old_log_probs + 0.1 * torch.randn(16, RESPONSE_LENGTH, generator=generator)
    return batch


def expected_grad_norm(model_dir, weights, batch: DataProto, config) -> float:
    """By hand, in one process: the loss of all 16 rows at once (token-mean over the response tokens of both
    ranks' rows together), then the L2 norm of its gradient. The 2 ranks hold unequal token counts, so this
    is what the globally normalised update must give, not the mean of the ranks' own token means."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(weights)
    rows = batch.batch
    logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"],
                   position_ids=rows["position_ids"]).logits[:, -RESPONSE_LENGTH - 1:-1] / TEMPERATURE
    log_prob = logprobs_from_logits(logits, rows["responses"])
    mask = rows["response_mask"]
    pg_loss, _ = get_policy_loss_fn("vanilla")(rows["old_log_probs"], log_prob, rows["advantages"], mask,
                                               "token-mean", config)
    loss = (pg_loss - config.entropy_coeff * agg_loss(entropy_from_logits(logits), mask, "token-mean")
            + config.kl_loss_coef * agg_loss(kl_penalty(log_prob, rows["ref_log_prob"], "low_var_kl"), mask,
                                             "token-mean"))
    loss.backward()
    return torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None)).item()


def test_micro_batch_1_and_4_give_the_same_update(groups, tiny):
    """THE numeric test: one mini-batch step per rank (8 rows; rank 0 holds 36 response tokens, rank 1 18),
    micro-batches of 1 vs 4 rows with unequal token counts; the gradient (its norm, checked against the
    by-hand gradient of the global token mean) and the new weights must agree."""
    model_dir, tokenizer = tiny
    start = groups["mb1"].actor_weights()[0]
    batch = fixed_update_batch(model_dir, tokenizer, start)

    metrics_1 = groups["mb1"].update_actor(batch).meta_info["metrics"]
    metrics_4 = groups["mb4"].update_actor(batch).meta_info["metrics"]
    weights_1, weights_4 = groups["mb1"].actor_weights()[0], groups["mb4"].actor_weights()[0]

    config = make_config(model_dir, "actor_rollout_ref.actor.entropy_coeff=0.01").actor_rollout_ref.actor
    by_hand = expected_grad_norm(model_dir, start, batch, config)
    assert metrics_1["actor/grad_norm"][0] == pytest.approx(by_hand, rel=1e-5)
    assert metrics_4["actor/grad_norm"][0] == pytest.approx(by_hand, rel=1e-5)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac"):
        assert metrics_1[key][0] == pytest.approx(metrics_4[key][0], rel=1e-5, abs=1e-7)
    assert max((weights_1[k] - start[k]).abs().max().item() for k in start) > 1e-4
    for name in start:
        torch.testing.assert_close(weights_1[name], weights_4[name], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- critic

def test_critic_values_and_update(groups, tiny):
    _, tokenizer = tiny
    out = generate(groups["main"], make_prompts(tokenizer, TEXTS[:4], validate=True, eos_token_id=5))
    batch = DataProto.from_dict(dict(out.batch))
    critic = groups["critic"]
    values = critic.compute_values(batch).batch["values"]
    mask = batch.batch["response_mask"]
    assert values.shape == (4, RESPONSE_LENGTH) and (values[mask == 0] == 0).all()
    assert critic.compute_values(batch).batch["values"].equal(values)

    batch.batch["values"] = values
    batch.batch["returns"] = torch.ones(4, RESPONSE_LENGTH) * mask
    losses = []
    for _ in range(3):
        metrics = critic.update_critic(batch).meta_info["metrics"]
        assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm",
                "critic/lr"} <= set(metrics)
        assert all(torch.isfinite(torch.tensor(v)).all() for v in metrics.values())
        losses.append(metrics["critic/vf_loss"][0])
    assert losses[2] < losses[0]
    new_values = critic.compute_values(batch).batch["values"]
    assert (new_values - 1).abs()[mask == 1].mean() < (values - 1).abs()[mask == 1].mean()


def test_unit_by_unit_gather_for_weight_sync_equals_the_full_state_dict(groups):
    """iter_unsharded_parameters (FSDP2 unshard per unit; the sync's fast path) and iter_full_state_dict yield
    the same names and values on both ranks, tied head included, and leave the model resharded and usable."""
    for name in ("main", "fsdp1"):
        full = groups[name].actor_weights()
        streamed = groups[name].unsharded_parameters()
        after = groups[name].actor_weights()  # gathering again after the stream: the model was resharded intact
        for rank in range(2):
            assert streamed[rank].keys() == full[rank].keys() == after[rank].keys()
            assert "lm_head.weight" in streamed[rank]
            for key, value in full[rank].items():
                assert torch.equal(streamed[rank][key], value) and torch.equal(after[rank][key], value), (name, key)


def test_lora_weights_for_an_engine_are_merged_under_hf_names(groups, tiny):
    """After an update (B != 0) the stream an inference engine loads (iter_hf_weights) has exactly the base
    model's HF names, and a plain HF model loaded with it computes the LoRA policy's log-probs."""
    model_dir, tokenizer = tiny
    group = groups["lora"]
    out = generate(groups["main"], make_prompts(tokenizer, TEXTS[:4] * 2, validate=False))
    batch = DataProto.from_dict(dict(out.batch), meta_info={"temperature": TEMPERATURE})
    batch.union(group.compute_log_prob(batch))
    batch.batch["advantages"] = torch.linspace(-1, 1, len(batch)).unsqueeze(-1) * batch.batch["response_mask"]
    batch.batch["ref_log_prob"] = batch.batch["old_log_probs"]
    group.update_actor(batch)

    merged = group.hf_weights()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert merged[0].keys() == base.keys() and merged[1].keys() == base.keys()
    changed = [name for name in base if not torch.equal(merged[0][name], base[name])]
    assert changed and all(name.endswith("proj.weight") for name in changed)  # only adapted linear layers moved
    policy_log_probs = group.compute_log_prob(batch).batch["old_log_probs"]
    engine_log_probs, _ = hf_log_probs(model_dir, merged[0], batch, TEMPERATURE)
    torch.testing.assert_close(engine_log_probs, policy_log_probs, atol=1e-5, rtol=0)
