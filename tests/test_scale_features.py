"""Scale features through the real DataParallelPPOActor / DataParallelPPOCritic in one process (world size 1,
fp32, CPU, a tiny random Qwen2): token-budget micro-batches (use_dynamic_bsz) and packed forwards
(use_remove_padding) must give the same log-probs, values, gradients and weights as the plain padded path.

The batch has the actor's real layout (left-padded prompts, right-padded responses) with very different
lengths, so a token budget cuts it into micro-batches of different row counts and in a different row order.
"""
import pytest
import torch

from hybridrl.config.compose import compose_config
from hybridrl.config.validation import ConfigError, validate_config
from hybridrl.protocol import DataProto
from hybridrl.models.fsdp_utils import apply_lora, build_optimizer, load_hf_model
from hybridrl.models.spec import critic_model_spec
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.workers.actor.dp_actor import DataParallelPPOActor
from hybridrl.workers.ppo_update_loop import micro_batches_of
from hybridrl.workers.critic.dp_critic import DataParallelPPOCritic

PROMPT_LENGTHS = [3, 7, 1, 5, 6, 2, 7, 4]    # attended prompt tokens per row, left-padded to 7
RESPONSE_LENGTHS = [4, 6, 1, 2, 6, 5, 3, 1]  # attended response tokens per row, right-padded to 6
PROMPT_WIDTH, RESPONSE_WIDTH, TEMPERATURE = 7, 6, 0.7
TOKEN_BUDGET = 14  # the longest row has 13 tokens; the 63 tokens of the batch make 5 micro-batches of 1 or 2 rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tokenizer = build_tokenizer(["what is 12 + 30 ? the answer is 42 so"] * 10, vocab_size=200)
    return build_tiny_model(str(tmp_path_factory.mktemp("scale")), tokenizer, hidden_size=32, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=64)


def config(model_dir, *overrides):
    return validate_config(compose_config([
        f"actor_rollout_ref.model.path={model_dir}", "data.train_files=unused.parquet", "data.val_files=unused.parquet",
        f"data.max_prompt_length={PROMPT_WIDTH}", f"data.max_response_length={RESPONSE_WIDTH}",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.n_gpus_per_node=1",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={TOKEN_BUDGET}", "critic.ppo_mini_batch_size=4",
        f"critic.ppo_max_token_len_per_gpu={TOKEN_BUDGET}", "algorithm=gae", *overrides]))


def padded_rows(prompt_lengths: list[int], response_lengths: list[int], prompt_width: int, response_width: int,
                vocab_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Rows of random token ids in the trainer's layout: each prompt left-padded to prompt_width, each response
    right-padded to response_width, positions counting the attended tokens."""
    prompt_mask = (torch.arange(prompt_width) >= prompt_width - torch.tensor(prompt_lengths).unsqueeze(-1)).long()
    response_mask = (torch.arange(response_width) < torch.tensor(response_lengths).unsqueeze(-1)).long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    input_ids = torch.randint(4, vocab_size, attention_mask.shape, generator=generator) * attention_mask
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "responses": input_ids[:, prompt_width:],
            "response_mask": response_mask}


def batch(vocab_size: int) -> DataProto:
    generator = torch.Generator().manual_seed(0)
    rows = len(PROMPT_LENGTHS)
    padded = padded_rows(PROMPT_LENGTHS, RESPONSE_LENGTHS, PROMPT_WIDTH, RESPONSE_WIDTH, vocab_size, generator)
    response_mask = padded["response_mask"]
    return DataProto.from_dict({
        **padded, "advantages": torch.randn(rows, 1, generator=generator) * response_mask,
        "returns": torch.randn(rows, RESPONSE_WIDTH, generator=generator) * response_mask,
        "values": torch.randn(rows, RESPONSE_WIDTH, generator=generator) * response_mask,
    }, meta_info={"temperature": TEMPERATURE})


def make_actor(model_dir, module, *overrides):
    cfg = config(model_dir, *overrides)
    actor = cfg.actor_rollout_ref.actor
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)  # SGD: the step is proportional to the gradient
    return DataParallelPPOActor(actor, module, optimizer, rollout_n=2, log_prob_micro_batch_size=2,
                                log_prob_max_token_len=TOKEN_BUDGET if actor.use_dynamic_bsz else None,
                                use_remove_padding=cfg.actor_rollout_ref.model.use_remove_padding, device="cpu")


def test_the_token_budget_really_cuts_the_batch_differently(model_dir):
    data = batch(200)
    groups, order = micro_batches_of(data.batch, 2, TOKEN_BUDGET)
    sizes = [len(group["input_ids"]) for group in groups]
    assert sorted(sizes) == [1, 1, 2, 2, 2], sizes
    assert order != list(range(len(data))) and sorted(order) == list(range(len(data)))
    assert all(int(group["attention_mask"].sum()) <= TOKEN_BUDGET for group in groups)


def masked(tensor, data):
    return tensor * data.batch["response_mask"]


@pytest.mark.parametrize("overrides", [
    ["actor_rollout_ref.actor.use_dynamic_bsz=true"],
    ["actor_rollout_ref.model.use_remove_padding=true"],
    ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.model.use_remove_padding=true",
     "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "actor_rollout_ref.actor.entropy_coeff=0.01"],
    ["actor_rollout_ref.model.enable_gradient_checkpointing=true"],
    ["actor_rollout_ref.actor.entropy_coeff=0.5", "actor_rollout_ref.actor.entropy_from_logits_with_chunking=true",
     "actor_rollout_ref.actor.entropy_checkpointing=true"],
    ["actor_rollout_ref.actor.entropy_coeff=0.5", "actor_rollout_ref.actor.entropy_from_logits_with_chunking=true",
     "actor_rollout_ref.model.use_remove_padding=true"],
    ["actor_rollout_ref.actor.entropy_coeff=0.5", "actor_rollout_ref.actor.entropy_checkpointing=true",
     "actor_rollout_ref.model.use_remove_padding=true"],
], ids=["dynamic_bsz", "remove_padding", "both_seq_mean_with_entropy", "gradient_checkpointing",
        "entropy_chunking_and_checkpointing", "entropy_chunking_packed", "entropy_checkpointing_packed"])
def test_actor_log_probs_gradients_and_update_equal_the_fixed_padded_path(model_dir, overrides):
    """Each case against the plain padded path with the same loss (its loss_agg_mode and entropy_coeff): verl's
    entropy keys change what autograd keeps, not the entropy term's gradient."""
    data = batch(200)
    base_overrides = [o for o in overrides if "loss_agg_mode" in o or "entropy_coeff" in o]
    plain = make_actor(model_dir, load_hf_model(model_dir), *base_overrides)
    checkpointing = config(model_dir, *overrides).actor_rollout_ref.model.enable_gradient_checkpointing
    tested = make_actor(model_dir, load_hf_model(model_dir, gradient_checkpointing=checkpointing), *overrides)
    # what transformers' is_activation_checkpointing reads (is_gradient_checkpointing is deprecated for it in 5.x;
    # reading the modules' flag works across the versions pyproject allows)
    assert any(getattr(m, "gradient_checkpointing", False) for m in tested.actor_module.modules()) == checkpointing

    log_probs, entropy = plain.compute_log_prob(data, calculate_entropy=True)
    tested_log_probs, tested_entropy = tested.compute_log_prob(data, calculate_entropy=True)
    assert torch.allclose(masked(tested_log_probs, data), masked(log_probs, data), atol=1e-5)
    assert torch.allclose(masked(tested_entropy, data), masked(entropy, data), atol=1e-5)

    data.batch["old_log_probs"] = log_probs.detach() - 0.05 * data.batch["response_mask"]  # ratios != 1
    plain_metrics = plain.update_policy(data)
    tested_metrics = tested.update_policy(data)
    for name, param in plain.actor_module.named_parameters():
        tested_param = dict(tested.actor_module.named_parameters())[name]
        assert torch.allclose(tested_param.grad, param.grad, atol=1e-5, rtol=1e-4), name
        assert torch.allclose(tested_param, param, atol=1e-5), name
    assert plain_metrics["actor/grad_norm"][0] > 1e-3
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
        assert tested_metrics[key] == pytest.approx(plain_metrics[key], abs=1e-5), key


def make_critic(model_dir, module, *overrides):
    full = config(model_dir, *overrides)
    return DataParallelPPOCritic(full.critic, module, torch.optim.SGD(module.parameters(), lr=0.5), rollout_n=2,
                                 device="cpu", use_remove_padding=critic_model_spec(full).use_remove_padding)


@pytest.mark.parametrize("overrides", [
    ["critic.use_dynamic_bsz=true"], ["critic.model.use_remove_padding=true"],
    ["critic.use_dynamic_bsz=true", "critic.model.use_remove_padding=true"]],
    ids=["dynamic_bsz", "remove_padding", "both"])
def test_critic_values_and_update_equal_the_fixed_padded_path(model_dir, overrides):
    data = batch(200)
    plain = make_critic(model_dir, load_hf_model(model_dir, value_head=True))
    tested = make_critic(model_dir, load_hf_model(model_dir, value_head=True), *overrides)
    assert tested.max_token_len == (TOKEN_BUDGET if "critic.use_dynamic_bsz=true" in overrides else None)

    values = plain.compute_values(data)
    assert torch.allclose(tested.compute_values(data), values, atol=1e-5)
    assert values.abs().sum() > 0 and torch.equal(values, masked(values, data))

    plain_metrics, tested_metrics = plain.update_critic(data), tested.update_critic(data)
    for name, param in plain.critic_module.named_parameters():
        tested_param = dict(tested.critic_module.named_parameters())[name]
        assert torch.allclose(tested_param.grad, param.grad, atol=1e-5, rtol=1e-4), name
        assert torch.allclose(tested_param, param, atol=1e-5), name
    for key in ("critic/vf_loss", "critic/vpred_mean", "critic/grad_norm"):
        assert tested_metrics[key] == pytest.approx(plain_metrics[key], abs=1e-5), key


def test_lora_starts_as_the_base_model_and_an_update_changes_only_the_adapters(model_dir):
    """Rank-4 adapters with B = 0: the same log-probs as the plain model; after an update the base weights are
    bit-for-bit unchanged, so with the adapters disabled (the reference policy) the base log-probs come back."""
    data = batch(200)
    base = make_actor(model_dir, load_hf_model(model_dir))
    base_log_probs, _ = base.compute_log_prob(data)
    cfg = config(model_dir, "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
                 "actor_rollout_ref.actor.optim.lr=0.05")
    model = cfg.actor_rollout_ref.model
    module = apply_lora(load_hf_model(model_dir), lora_rank=model.lora_rank, lora_alpha=model.lora_alpha,
                        target_modules=model.target_modules, exclude_modules=model.exclude_modules)
    optimizer = build_optimizer(module, cfg.actor_rollout_ref.actor.optim)
    adapter_names = {name for name, param in module.named_parameters() if param.requires_grad}
    assert adapter_names and all("lora_" in name for name in adapter_names)
    actor = DataParallelPPOActor(cfg.actor_rollout_ref.actor, module, optimizer, rollout_n=2,
                                 log_prob_micro_batch_size=2, device="cpu")

    lora_log_probs, _ = actor.compute_log_prob(data)
    assert torch.allclose(masked(lora_log_probs, data), masked(base_log_probs, data), atol=1e-6)

    before = {name: param.detach().clone() for name, param in module.named_parameters()}
    data.batch["old_log_probs"] = lora_log_probs
    actor.update_policy(data)
    changed = {name for name, param in module.named_parameters() if not torch.equal(param, before[name])}
    assert changed and changed <= adapter_names, sorted(changed - adapter_names)
    trained_log_probs, _ = actor.compute_log_prob(data)
    assert (masked(trained_log_probs - base_log_probs, data)).abs().max() > 1e-4
    with module.disable_adapter():
        reference_log_probs, _ = actor.compute_log_prob(data)
    assert torch.allclose(masked(reference_log_probs, data), masked(base_log_probs, data), atol=1e-6)


def test_lora_adapter_path_loads_a_trained_adapter_of_the_configured_rank(model_dir, tmp_path):
    data = batch(200)
    trained = apply_lora(load_hf_model(model_dir), lora_rank=4, lora_alpha=8, target_modules="all-linear")
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)  # a trained adapter: B != 0
    trained.save_pretrained(str(tmp_path / "adapter"))
    expected, _ = make_actor(model_dir, trained).compute_log_prob(data)

    loaded = apply_lora(load_hf_model(model_dir), lora_rank=4, lora_alpha=8, target_modules="all-linear",
                        adapter_path=str(tmp_path / "adapter"))
    assert any(param.requires_grad for name, param in loaded.named_parameters() if "lora_B" in name)
    log_probs, _ = make_actor(model_dir, loaded).compute_log_prob(data)
    assert torch.allclose(log_probs, expected, atol=1e-6)
    with pytest.raises(ValueError, match="holds a rank-4 adapter, but model.lora_rank=8"):
        apply_lora(load_hf_model(model_dir), lora_rank=8, lora_alpha=8, target_modules="all-linear",
                   adapter_path=str(tmp_path / "adapter"))


def test_critic_lora_starts_as_the_base_critic_and_trains_adapters_and_value_head(model_dir):
    data = batch(200)
    plain = make_critic(model_dir, load_hf_model(model_dir, value_head=True))
    module = apply_lora(load_hf_model(model_dir, value_head=True), lora_rank=4, lora_alpha=8,
                        target_modules="all-linear", value_head=True)
    trainable = {name for name, param in module.named_parameters() if param.requires_grad}
    head = "base_model.model.score.modules_to_save.default"
    assert {name for name in trainable if "lora_" not in name} == {f"{head}.weight", f"{head}.bias"}
    critic = make_critic(model_dir, module, "critic.model.lora_rank=4")
    assert torch.allclose(critic.compute_values(data), plain.compute_values(data), atol=1e-6)

    before = {name: param.detach().clone() for name, param in module.named_parameters()}
    critic.update_critic(data)
    changed = {name for name, param in module.named_parameters() if not torch.equal(param, before[name])}
    assert f"{head}.weight" in changed and changed <= trainable


# ---------------------------------------------------------------------- config checks of the scale features

def problems_for(*overrides):
    with pytest.raises(ConfigError) as caught:
        validate_config(compose_config(["data.train_files=x.parquet", "data.val_files=x.parquet", *overrides]))
    return caught.value.problems


def test_reward_model_needs_its_model_and_micro_batch_and_refuses_what_it_cannot_do():
    assert problems_for("reward_model.enable=true", "reward_model.use_dynamic_bsz=false") == [
        "reward_model.model.path: expected a sequence-classification model directory when reward_model.enable=true, "
        "got None",
        "reward_model.micro_batch_size_per_gpu: expected rows per reward-model forward when reward_model.enable=true "
        "and reward_model.use_dynamic_bsz=false, got None",
    ]
    assert problems_for("reward_model.enable=true", "reward_model.model.path=/rm",
                        "reward_model.model.use_remove_padding=true", "reward_model.model.input_tokenizer=/other",
                        "actor_rollout_ref.model.path=/policy", "data.tokenizer=/policy_tok",
                        "actor_rollout_ref.actor.use_dynamic_bsz=true", "data.max_prompt_length=100",
                        "data.max_response_length=50", "reward_model.forward_max_token_len_per_gpu=149") == [
        "reward_model.model.use_remove_padding: expected False (other values are not implemented yet), got True",
        "reward_model.model.input_tokenizer: expected null or the policy's tokenizer (/policy or /policy_tok: the "
        "controller hands the reward model the one tokenizer the run renders prompts with), got '/other'",
        "reward_model.forward_max_token_len_per_gpu: expected at least data.max_prompt_length + "
        "data.max_response_length = 150 tokens (one whole sequence) with reward_model.use_dynamic_bsz=true, got 149",
    ]
    dynamic = validate_config(compose_config(["data.train_files=x.parquet", "data.val_files=x.parquet",
                                              "reward_model.enable=true", "reward_model.model.path=/rm",
                                              "actor_rollout_ref.actor.use_dynamic_bsz=true"]))
    assert dynamic.reward_model.use_dynamic_bsz and dynamic.reward_model.micro_batch_size_per_gpu is None
    rows = validate_config(compose_config(["data.train_files=x.parquet", "data.val_files=x.parquet",
                                           "reward_model.enable=true", "reward_model.model.path=/rm",
                                           "reward_model.micro_batch_size_per_gpu=2",
                                           "actor_rollout_ref.actor.use_dynamic_bsz=true",
                                           "reward_model.use_dynamic_bsz=false", "reward_model.model.input_tokenizer=null"]))
    assert rows.reward_model.enable and rows.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz


def test_token_budgets_must_hold_one_whole_sequence():
    assert problems_for("data.max_prompt_length=100", "data.max_response_length=50", "algorithm=gae",
                        "actor_rollout_ref.actor.use_dynamic_bsz=true",
                        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=200",
                        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=149",
                        "critic.forward_max_token_len_per_gpu=120") == [
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu: expected at least data.max_prompt_length + "
        "data.max_response_length = 150 tokens (one whole sequence) with "
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true, got 149",
        "critic.forward_max_token_len_per_gpu: expected at least data.max_prompt_length + data.max_response_length = "
        "150 tokens (one whole sequence) with critic.use_dynamic_bsz=true, got 120",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_lora_and_liger_settings_that_cannot_work_are_refused():
    problems = problems_for("actor_rollout_ref.model.lora_adapter_path=/adapter",
                            "actor_rollout_ref.model.use_liger=true", "trainer.device=cpu")
    assert problems == [
        "actor_rollout_ref.model.use_liger: expected false without a GPU (liger's kernels run only on CUDA; "
        "trainer.device='cpu', CUDA available: False), got True",
        "actor_rollout_ref.model.lora_adapter_path: expected null when actor_rollout_ref.model.lora_rank=0 (no LoRA "
        "to load the adapter into), got '/adapter'",
    ]
    # LoRA with the sglang rollout is allowed (merged weights are synced): only sglang's own needs remain
    assert not [p for p in problems_for("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.rollout.name=sglang")
                if "lora" in p]
