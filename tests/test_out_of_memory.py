"""A GPU out-of-memory in the actor's or critic's passes (workers/out_of_memory.py) fails with the micro-batch that
asked for the memory and the keys that shrink it, through the real DataParallelPPOActor / DataParallelPPOCritic on
a tiny random Qwen2 (CPU, world size 1).

The allocator's failure is the one boundary faked here: a CPU has no CUDA allocator to exhaust, so a forward
pre-hook raises torch's own OutOfMemoryError in the model's first forward. The expected micro-batch is worked out
with the same splitting the pass uses (micro_batches_of), its tokens counted by hand from the batch's lengths.
"""
import pickle

import pytest
import torch

from hybridrl.config.compose import compose_config
from hybridrl.config.validation import validate_config
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.models.fsdp_utils import load_hf_model
from hybridrl.protocol import DataProto
from hybridrl.workers.actor.dp_actor import DataParallelPPOActor
from hybridrl.workers.critic.dp_critic import DataParallelPPOCritic
from hybridrl.workers.out_of_memory import TrainingMemoryError, memory_remedies
from hybridrl.workers.ppo_update_loop import micro_batches_of

PROMPT_LENGTHS = [3, 7, 1, 5]    # attended prompt tokens per row, left-padded to 7
RESPONSE_LENGTHS = [4, 6, 1, 2]  # attended response tokens per row, right-padded to 6: rows of 7, 13, 2 and 7 tokens
PROMPT_WIDTH, RESPONSE_WIDTH, TOKEN_BUDGET = 7, 6, 14


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tokenizer = build_tokenizer(["what is 12 + 30 ? the answer is 42 so"] * 10, vocab_size=200)
    return build_tiny_model(str(tmp_path_factory.mktemp("oom")), tokenizer, hidden_size=32, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=64)


def config(model_dir, *overrides):
    return validate_config(compose_config([
        f"actor_rollout_ref.model.path={model_dir}", "data.train_files=unused.parquet", "data.val_files=unused.parquet",
        f"data.max_prompt_length={PROMPT_WIDTH}", f"data.max_response_length={RESPONSE_WIDTH}",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.shuffle=false",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={TOKEN_BUDGET}", "trainer.n_gpus_per_node=1",
        "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size_per_gpu=2", "critic.shuffle=false",
        "algorithm=gae", *overrides]))


def batch() -> DataProto:
    prompt_mask = (torch.arange(PROMPT_WIDTH) >= PROMPT_WIDTH - torch.tensor(PROMPT_LENGTHS).unsqueeze(-1)).long()
    response_mask = (torch.arange(RESPONSE_WIDTH) < torch.tensor(RESPONSE_LENGTHS).unsqueeze(-1)).long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    input_ids = torch.randint(4, 200, attention_mask.shape, generator=torch.Generator().manual_seed(0)) * attention_mask
    rows = len(PROMPT_LENGTHS)
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "responses": input_ids[:, PROMPT_WIDTH:],
        "response_mask": response_mask, "advantages": torch.ones(rows, 1) * response_mask,
        "old_log_probs": torch.zeros(rows, RESPONSE_WIDTH), "returns": torch.zeros(rows, RESPONSE_WIDTH),
        "values": torch.zeros(rows, RESPONSE_WIDTH)}, meta_info={"temperature": 1.0})


def out_of_memory_in_every_forward(module) -> list[torch.OutOfMemoryError]:
    """Make every forward of the module raise torch's OutOfMemoryError, as the CUDA allocator would; the raised
    error is appended to the returned list."""
    raised = []

    def hook(_module, _args):
        raised.append(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 270.00 MiB."))
        raise raised[-1]
    module.register_forward_pre_hook(hook)
    return raised


def first_micro_batch(micro_batch_size, max_token_len):
    """(rows, attended tokens) of the first micro-batch the pass forms from the whole batch (one mini-batch, in
    order: shuffle is off)."""
    first = micro_batches_of(batch().batch, micro_batch_size, max_token_len)[0][0]
    return len(first["input_ids"]), int(first["attention_mask"].sum())


def test_an_actor_update_names_the_micro_batch_its_token_budget_checkpointing_and_the_fused_kernel(model_dir):
    cfg = config(model_dir, "actor_rollout_ref.actor.use_dynamic_bsz=true")
    module = load_hf_model(model_dir)
    actor = DataParallelPPOActor(cfg.actor_rollout_ref.actor, module, torch.optim.SGD(module.parameters(), lr=0.1),
                                 rollout_n=2, log_prob_micro_batch_size=2, device="cpu")
    rows, tokens = first_micro_batch(2, TOKEN_BUDGET)
    assert (rows, tokens) == (1, 7)  # rows of 7, 13, 2, 7 tokens in a budget of 14: [7], [13], [2, 7]
    raised = out_of_memory_in_every_forward(module)
    with pytest.raises(TrainingMemoryError) as error:
        actor.update_policy(batch())
    message = str(error.value)
    assert message.startswith("actor update ran out of GPU memory in a micro-batch of 1 sequence and 7 tokens. "
                              "Make room: ")
    assert ("lower actor_rollout_ref.actor.ppo_max_token_len_per_gpu (now 14); or set "
            "actor_rollout_ref.model.enable_gradient_checkpointing=true") in message
    assert "set actor_rollout_ref.model.use_fused_kernels=true" in message
    assert isinstance(error.value, torch.OutOfMemoryError) and error.value.__cause__ is raised[0]


@pytest.mark.parametrize("role", ["actor", "ref"])
def test_a_log_prob_pass_names_its_own_section_and_no_checkpointing(model_dir, role):
    cfg = config(model_dir, "actor_rollout_ref.model.use_fused_kernels=true")
    module = load_hf_model(model_dir)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1) if role == "actor" else None
    section = cfg.actor_rollout_ref.actor if role == "actor" else cfg.actor_rollout_ref.ref
    policy = DataParallelPPOActor(section, module, optimizer, rollout_n=2, log_prob_micro_batch_size=2,
                                  use_fused_kernels=True, device="cpu")
    out_of_memory_in_every_forward(module)
    with pytest.raises(TrainingMemoryError) as error:
        policy.compute_log_prob(batch())
    keys = "rollout" if role == "actor" else "ref"
    assert str(error.value) == (
        "compute_log_prob ran out of GPU memory in a micro-batch of 2 sequences and 20 tokens. Make room: lower "  # rows 0, 1: 3+4 + 7+6
        f"actor_rollout_ref.{keys}.log_prob_micro_batch_size_per_gpu (now 2). torch's message is the cause above.")


def test_the_critic_names_its_keys_and_leaves_out_checkpointing_once_it_is_on(model_dir):
    cfg = config(model_dir, "critic.model.enable_gradient_checkpointing=true", "critic.use_dynamic_bsz=true",
                 f"critic.ppo_max_token_len_per_gpu={TOKEN_BUDGET}", "critic.forward_max_token_len_per_gpu=20")
    module = load_hf_model(model_dir, value_head=True)
    critic = DataParallelPPOCritic(cfg.critic, module, torch.optim.SGD(module.parameters(), lr=0.1), rollout_n=2,
                                   device="cpu")
    out_of_memory_in_every_forward(module)
    with pytest.raises(TrainingMemoryError) as error:
        critic.update_critic(batch())
    assert str(error.value) == (
        "critic update ran out of GPU memory in a micro-batch of 1 sequence and 7 tokens. Make room: "
        "lower critic.ppo_max_token_len_per_gpu (now 14). torch's message is the cause above.")
    with pytest.raises(TrainingMemoryError) as error:
        critic.compute_values(batch())
    assert first_micro_batch(2, 20) == (2, 14)  # a budget of 20: [7, 7], [13, 2]
    assert "lower critic.forward_max_token_len_per_gpu (now 20)." in str(error.value)
    assert "a micro-batch of 2 sequences and 14 tokens" in str(error.value)


def test_remedies_follow_the_settings_and_the_error_crosses_processes_whole():
    assert memory_remedies("critic", "critic.model", token_budget=("ppo_max_token_len_per_gpu", None),
                           row_budget=("ppo_micro_batch_size_per_gpu", 4), gradient_checkpointing=False) == (
        "lower critic.ppo_micro_batch_size_per_gpu (now 4)",
        "set critic.model.enable_gradient_checkpointing=true (activations recomputed in the backward instead of kept)")
    error = TrainingMemoryError("actor update ran out of GPU memory ...")
    copy = pickle.loads(pickle.dumps(error))  # Ray carries a worker's error to the driver pickled
    assert type(copy) is TrainingMemoryError and str(copy) == str(error)
