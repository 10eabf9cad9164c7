"""use_fused_kernels: log-probs and entropy fused with the output layer (hybridrl/models/fused_logprob.py) give the
plain logits path's numbers and gradients (fp32, CPU, 1e-5) while never holding more than one chunk of logits.

  unit     linear_log_probs against logits -> logprobs_from_logits / entropy_from_logits, at several chunk sizes
  memory   a torch dispatch mode sees every tensor created, backward included: no logits beyond one chunk
  actor    DataParallelPPOActor in one process (Qwen2, Llama, LoRA; padded and packed), and what is refused
  workers  2 gloo ranks on a real local Ray (FSDP2, FSDP1): compute_log_prob, compute_ref_log_prob, one update
"""
import sys

import pytest
import ray
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, Gemma2Config

from hybridrl.config.compose import compose_config
from hybridrl.config.validation import validate_config
from hybridrl.protocol import DataProto
from hybridrl.single_controller import Dispatch, register
from hybridrl.single_controller.ray import (RayClassWithInitArgs, RayResourcePool, RayWorkerGroup,
                                            create_colocated_worker_cls)
from hybridrl.models import fused_logprob
from hybridrl.models.fsdp_utils import apply_lora, iter_full_state_dict, load_hf_model
from hybridrl.models.fused_logprob import linear_log_probs, response_log_probs_fused
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.algorithms.torch_functional import entropy_from_logits, logprobs_from_logits
from hybridrl.workers.actor.dp_actor import DataParallelPPOActor
from hybridrl.models.spec import policy_model_spec
from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import this module by name

TEMPERATURE = 0.7
PROMPT_LENGTHS = [3, 7, 1, 5, 6, 2, 7, 4]    # attended prompt tokens per row, left-padded to 7
RESPONSE_LENGTHS = [4, 6, 1, 2, 6, 5, 3, 1]  # attended response tokens per row, right-padded to 6
PROMPT_WIDTH, RESPONSE_WIDTH = 7, 6


class LogitsWatch(TorchDispatchMode):
    """Every tensor any op allocates (forward and backward): the most rows a logits-shaped tensor (last dimension
    `vocab_size`) held, and the largest tensor in bytes. Views (e.g. the output weight transposed) allocate nothing."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size, self.max_logit_rows, self.max_bytes = vocab_size, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        if func.is_view:
            return output
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor):
                self.max_bytes = max(self.max_bytes, tensor.numel() * tensor.element_size())
                if tensor.dim() and tensor.shape[-1] == self.vocab_size:
                    self.max_logit_rows = max(self.max_logit_rows, tensor.numel() // self.vocab_size)
        return output


# ---------------------------------------------------------------------- unit

def plain_log_probs(hidden, weight, labels, temperature):
    logits = hidden @ weight.T / temperature
    return logprobs_from_logits(logits, labels), entropy_from_logits(logits)


def inputs(tokens=37, hidden_size=16, vocab_size=50, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    weight = torch.randn(vocab_size, hidden_size, generator=generator) * 0.5
    labels = torch.randint(0, vocab_size, (tokens,), generator=generator)
    upstream = torch.randn(2, tokens, generator=generator)  # the loss's gradients w.r.t. log-probs and entropy
    return hidden, weight, labels, upstream


def gradients(compute, hidden, weight, labels, upstream, entropy_in_loss=True):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    log_probs, entropy = compute(hidden, weight, labels)
    loss = (upstream[0] * log_probs).sum() + (upstream[1] * entropy).sum() * entropy_in_loss
    loss.backward()
    return log_probs.detach(), entropy.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk_tokens", [1, 7, 16, 37, 100], ids=lambda c: f"chunk{c}")
def test_log_probs_entropy_and_gradients_equal_the_plain_logits_path(chunk_tokens):
    """37 tokens: chunks of 7 and 16 leave a shorter last chunk; 37 and 100 are one chunk; temperature 0.7."""
    hidden, weight, labels, upstream = inputs()
    expected = gradients(lambda h, w, y: plain_log_probs(h, w, y, TEMPERATURE), hidden, weight, labels, upstream)
    fused = gradients(lambda h, w, y: linear_log_probs(h, w, y, TEMPERATURE, calculate_entropy=True,
                                                       chunk_tokens=chunk_tokens), hidden, weight, labels, upstream)
    for name, value, reference in zip(["log_probs", "entropy", "grad hidden", "grad weight"], fused, expected):
        torch.testing.assert_close(value, reference, atol=1e-5, rtol=1e-5, msg=name)
    assert expected[0].max() < 0 and expected[1].min() > 0.1 and expected[3].abs().max() > 0.1  # not trivial


def test_a_detached_entropy_and_a_frozen_weight_leave_only_the_log_prob_gradient():
    """The entropy as a metric (detached), the output layer frozen (LoRA): d loss / d hidden is the log-prob part."""
    hidden, weight, labels, upstream = inputs()
    _, _, expected_grad, _ = gradients(lambda h, w, y: plain_log_probs(h, w, y, TEMPERATURE), hidden, weight, labels,
                                       upstream, entropy_in_loss=False)
    hidden = hidden.clone().requires_grad_()
    log_probs, entropy = linear_log_probs(hidden, weight, labels, TEMPERATURE, calculate_entropy=True,
                                          chunk_tokens=8)
    (upstream[0] * log_probs).sum().backward()
    torch.testing.assert_close(hidden.grad, expected_grad, atol=1e-5, rtol=1e-5)
    assert weight.grad is None
    assert linear_log_probs(hidden, weight, labels, TEMPERATURE)[1] is None


def test_no_tensor_of_the_forward_and_backward_holds_more_than_one_chunk_of_logits():
    tokens, vocab_size, chunk_tokens = 300, 1000, 32
    hidden, weight, labels, upstream = inputs(tokens=tokens, hidden_size=8, vocab_size=vocab_size)

    with LogitsWatch(vocab_size) as plain:
        gradients(lambda h, w, y: plain_log_probs(h, w, y, TEMPERATURE), hidden, weight, labels, upstream)
    with LogitsWatch(vocab_size) as fused:
        gradients(lambda h, w, y: linear_log_probs(h, w, y, TEMPERATURE, calculate_entropy=True,
                                                   chunk_tokens=chunk_tokens), hidden, weight, labels, upstream)

    all_logits_fp32 = tokens * vocab_size * 4
    assert plain.max_logit_rows == tokens and plain.max_bytes >= all_logits_fp32  # the watch does see logits
    assert fused.max_logit_rows == chunk_tokens
    assert fused.max_bytes <= chunk_tokens * vocab_size * 4 < all_logits_fp32 / 9


def test_malformed_inputs_are_refused():
    hidden, weight, labels, _ = inputs()
    with pytest.raises(ValueError, match=r"hidden \(37, 8\) must be \(tokens, H\) and weight \(50, 16\)"):
        linear_log_probs(hidden[:, :8], weight, labels, 1.0)
    with pytest.raises(ValueError, match=r"labels \(36,\) must hold one token id per hidden row \(37\)"):
        linear_log_probs(hidden, weight, labels[1:], 1.0)


# ---------------------------------------------------------------------- actor, one process

@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["what is 12 + 30 ? the answer is 42 so"] * 10, vocab_size=200)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer):
    return {arch: build_tiny_model(str(tmp_path_factory.mktemp(arch)), tokenizer, arch=arch, hidden_size=32,
                                   num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                                   tie_word_embeddings=arch == "qwen2")
            for arch in ("qwen2", "llama")}


def actor_config(model_dir, *overrides):
    return validate_config(compose_config([
        f"actor_rollout_ref.model.path={model_dir}", "data.train_files=x.parquet", "data.val_files=x.parquet",
        f"data.max_prompt_length={PROMPT_WIDTH}", f"data.max_response_length={RESPONSE_WIDTH}",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.n_gpus_per_node=1", *overrides]))


def actor_batch(vocab_size: int) -> DataProto:
    """The actor's layout: left-padded prompts, right-padded responses, very different lengths."""
    generator = torch.Generator().manual_seed(0)
    prompt_mask = (torch.arange(PROMPT_WIDTH) >= PROMPT_WIDTH - torch.tensor(PROMPT_LENGTHS).unsqueeze(-1)).long()
    response_mask = (torch.arange(RESPONSE_WIDTH) < torch.tensor(RESPONSE_LENGTHS).unsqueeze(-1)).long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    input_ids = torch.randint(4, vocab_size, attention_mask.shape, generator=generator) * attention_mask
    rows = len(PROMPT_LENGTHS)
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "responses": input_ids[:, PROMPT_WIDTH:],
        "response_mask": response_mask, "advantages": torch.randn(rows, 1, generator=generator) * response_mask,
    }, meta_info={"temperature": TEMPERATURE})


def make_actor(model_dir, module, *overrides):
    cfg = actor_config(model_dir, *overrides)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.5)
    return DataParallelPPOActor(cfg.actor_rollout_ref.actor, module, optimizer, rollout_n=2,
                                log_prob_micro_batch_size=2, device="cpu",
                                use_remove_padding=cfg.actor_rollout_ref.model.use_remove_padding,
                                use_fused_kernels=cfg.actor_rollout_ref.model.use_fused_kernels)


def lora(module):
    torch.manual_seed(0)  # peft draws A at random: both actors get the same adapters
    return apply_lora(module, lora_rank=4, lora_alpha=8, target_modules="all-linear")


@pytest.mark.parametrize("arch,remove_padding,with_lora,entropy_coeff", [
    ("qwen2", False, False, 0.01), ("qwen2", True, False, 0.01), ("llama", False, False, 0.0),
    ("llama", True, True, 0.01),
], ids=["qwen2_padded", "qwen2_packed", "llama_padded_entropy_metric", "llama_packed_lora"])
def test_the_fused_actor_gives_the_plain_actors_log_probs_gradients_and_update(model_dirs, tokenizer, arch,
                                                                               remove_padding, with_lora,
                                                                               entropy_coeff):
    model_dir = model_dirs[arch]
    data = actor_batch(len(tokenizer))
    mask = data.batch["response_mask"].bool()
    common = [f"actor_rollout_ref.actor.entropy_coeff={entropy_coeff}", "actor_rollout_ref.actor.use_kl_loss=true"]
    wrap = lora if with_lora else (lambda module: module)
    plain = make_actor(model_dir, wrap(load_hf_model(model_dir)), *common)
    fused = make_actor(model_dir, wrap(load_hf_model(model_dir)), *common,
                       f"actor_rollout_ref.model.use_remove_padding={remove_padding}",
                       "actor_rollout_ref.model.use_fused_kernels=true")
    assert fused.use_fused_kernels and fused.use_remove_padding == remove_padding

    log_probs, entropy = plain.compute_log_prob(data, calculate_entropy=True)
    fused_log_probs, fused_entropy = fused.compute_log_prob(data, calculate_entropy=True)
    torch.testing.assert_close(fused_log_probs[mask], log_probs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(fused_entropy[mask], entropy[mask], atol=1e-5, rtol=0)
    if not remove_padding:  # the padded layout scores padding positions too, with the same numbers
        torch.testing.assert_close(fused_log_probs, log_probs, atol=1e-5, rtol=0)

    data.batch["old_log_probs"] = log_probs - 0.05 * mask  # ratios != 1
    data.batch["ref_log_prob"] = log_probs + 0.1 * mask
    plain_metrics, fused_metrics = plain.update_policy(data), fused.update_policy(data)
    fused_params = dict(fused.actor_module.named_parameters())
    trained = [name for name, param in plain.actor_module.named_parameters() if param.requires_grad]
    assert all("lora_" in name for name in trained) == with_lora
    for name in trained:
        torch.testing.assert_close(fused_params[name].grad, dict(plain.actor_module.named_parameters())[name].grad,
                                   atol=1e-5, rtol=1e-4, msg=name)
    for name, param in plain.actor_module.named_parameters():
        torch.testing.assert_close(fused_params[name], param, atol=1e-5, rtol=0, msg=name)
    assert plain_metrics["actor/grad_norm"][0] > 1e-3
    for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm", "actor/pg_clipfrac"):
        assert fused_metrics[key] == pytest.approx(plain_metrics[key], abs=1e-5), key


@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_the_fused_actor_never_holds_more_than_one_chunk_of_logits(model_dirs, tokenizer, monkeypatch,
                                                                   remove_padding):
    """Log-probs and a full update step under the watch; chunks of 3 tokens (CHUNK_LOGITS = 3 x vocab)."""
    model_dir, vocab_size = model_dirs["qwen2"], len(tokenizer)
    monkeypatch.setattr(fused_logprob, "CHUNK_LOGITS", 3 * vocab_size)
    data = actor_batch(vocab_size)
    overrides = [f"actor_rollout_ref.model.use_remove_padding={remove_padding}",
                 "actor_rollout_ref.actor.entropy_coeff=0.01"]
    watches = {}
    for fused in (False, True):
        actor = make_actor(model_dir, load_hf_model(model_dir), *overrides,
                           f"actor_rollout_ref.model.use_fused_kernels={fused}")
        with LogitsWatch(vocab_size) as watches[fused]:
            data.batch["old_log_probs"], _ = actor.compute_log_prob(data, calculate_entropy=True)
            actor.update_policy(data)
    micro_batch_tokens = 2 * (PROMPT_WIDTH + RESPONSE_WIDTH)
    assert watches[False].max_logit_rows >= (sum(PROMPT_LENGTHS[:2]) + sum(RESPONSE_LENGTHS[:2]) if remove_padding
                                             else micro_batch_tokens)
    assert watches[True].max_logit_rows == 3


def test_models_the_fused_path_cannot_reproduce_are_refused(model_dirs, tokenizer):
    data = actor_batch(len(tokenizer)).batch
    args = [data[key] for key in ("input_ids", "attention_mask", "position_ids", "responses")]
    lora_head = apply_lora(load_hf_model(model_dirs["llama"]), lora_rank=4, lora_alpha=8,
                           target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="expected the output layer of PeftModelForCausalLM to be a bias-free "
                                         "torch.nn.Linear .*got peft.tuners.lora.layer.Linear"):
        response_log_probs_fused(lora_head, *args, TEMPERATURE)
    softcapped = AutoModelForCausalLM.from_config(Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, head_dim=8, final_logit_softcapping=30.0))
    with pytest.raises(ValueError, match="Gemma2ForCausalLM's forward transforms its output layer's result"):
        response_log_probs_fused(softcapped, *args, TEMPERATURE)
    hooked = load_hf_model(model_dirs["qwen2"])
    hooked.lm_head.forward = lambda hidden: hooked.lm_head.weight.new_zeros(0)  # as accelerate's hooks do
    with pytest.raises(ValueError, match="output layer of Qwen2ForCausalLM already has its forward replaced"):
        response_log_probs_fused(hooked, *args, TEMPERATURE)


# ---------------------------------------------------------------------- workers, 2 gloo ranks

class WeightsProbe(ActorRolloutRefWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def actor_weights(self) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() for name, tensor in iter_full_state_dict(self.actor_module, torch.float32)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fused_kernels_in_use(self) -> dict[str, bool]:
        """Whether the actor (and the reference policy) got model.use_fused_kernels from the worker."""
        policies = {"actor": self.actor, "ref": getattr(self, "ref_policy", None)}
        return {name: policy.use_fused_kernels for name, policy in policies.items() if policy is not None}


PACKED, FUSED = "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.model.use_fused_kernels=true"
WORKER_ROLES = {  # name: (role, overrides)
    "plain": ("actor", []),
    "plain_packed": ("actor", [PACKED]),
    "fused": ("actor_rollout_ref", [FUSED]),
    "fused_packed": ("actor", [FUSED, PACKED]),
    "fused_fsdp1": ("actor", [FUSED, "actor_rollout_ref.actor.strategy=fsdp"]),
}


@pytest.fixture(scope="module")
def worker_groups(ray_local, model_dirs):
    model_dir = model_dirs["qwen2"]
    common = [f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", "trainer.n_gpus_per_node=2",
              "data.train_batch_size=8", "actor_rollout_ref.rollout.n=1",
              "actor_rollout_ref.actor.ppo_mini_batch_size=8",
              "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01",
              "actor_rollout_ref.actor.optim.lr=1e-3"]
    configs = {name: actor_config(model_dir, *common, *overrides) for name, (_, overrides) in WORKER_ROLES.items()}
    roles = {name: RayClassWithInitArgs(WeightsProbe, configs[name].actor_rollout_ref, policy_model_spec(configs[name]),
                                        role=role, seed=1, device="cpu")
             for name, (role, _) in WORKER_ROLES.items()}
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, name_prefix="test_fused_logprob")
    groups = RayWorkerGroup(pool, create_colocated_worker_cls(roles)).spawn(prefix_set=set(roles))
    for group in groups.values():
        group.init_model()
    yield groups
    pool.remove()


def test_fused_workers_give_the_plain_workers_log_probs_and_update(worker_groups, tokenizer):
    """Each fused worker against the plain worker of its layout (FSDP2 and FSDP1 alike). The weights are compared
    after one AdamW step, whose first step is about lr * sign(grad): gradients of ~1e-9 (the packed and padded
    layouts differ at that level) would show there, so a packed worker is compared with a packed one."""
    batch = actor_batch(len(tokenizer))
    mask = batch.batch["response_mask"].bool()
    baseline_of = {"fused": "plain", "fused_fsdp1": "plain", "fused_packed": "plain_packed"}
    assert worker_groups["fused"].fused_kernels_in_use() == [{"actor": True, "ref": True}] * 2
    assert worker_groups["fused_packed"].fused_kernels_in_use()[0] == {"actor": True}
    assert worker_groups["plain"].fused_kernels_in_use()[0] == {"actor": False}
    start = worker_groups["plain"].actor_weights()[0]
    plain = worker_groups["plain"].compute_log_prob(batch)
    log_probs, entropy = plain.batch["old_log_probs"], plain.batch["entropys"]
    for name in baseline_of:
        fused = worker_groups[name].compute_log_prob(batch)
        torch.testing.assert_close(fused.batch["old_log_probs"][mask], log_probs[mask], atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(fused.batch["entropys"][mask], entropy[mask], atol=1e-5, rtol=0, msg=name)
    ref_log_probs = worker_groups["fused"].compute_ref_log_prob(batch).batch["ref_log_prob"]
    torch.testing.assert_close(ref_log_probs[mask], log_probs[mask], atol=1e-5, rtol=0)

    batch.batch["old_log_probs"] = log_probs - 0.05 * mask
    batch.batch["ref_log_prob"] = log_probs + 0.1 * mask
    metrics, weights = {}, {}
    for name in ["plain", "plain_packed", *baseline_of]:
        metrics[name] = worker_groups[name].update_actor(batch).meta_info["metrics"]
        weights[name] = worker_groups[name].actor_weights()[0]
    assert max((weights["plain"][key] - start[key]).abs().max().item() for key in start) > 1e-4
    for name, baseline in baseline_of.items():
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
            assert metrics[name][key] == pytest.approx(metrics[baseline][key], rel=1e-5, abs=1e-6), (name, key)
        for key in start:
            torch.testing.assert_close(weights[name][key], weights[baseline][key], atol=1e-5, rtol=0, msg=(name, key))
