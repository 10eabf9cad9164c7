"""Config checks of the training workers (actor, critic, reward model): batches that split evenly over ranks and
micro-batches, token budgets that hold a sequence, a reward model ready to score; registered with
hybridrl.config.checks. The rollout's are in rollout/config_checks.py."""
from __future__ import annotations

from hybridrl.config.checks import Values, critic_enabled, register_check, run_rule


@register_check()
def _batch_sizes_divide(values: Values, problems: list[str]) -> None:
    """The actor's (and an enabled critic's) batches must split evenly over prompts, ranks and micro-batches."""
    nnodes, gpus = values("trainer.nnodes"), values("trainer.n_gpus_per_node")
    world = nnodes * gpus
    world_words = f"the world size trainer.nnodes * trainer.n_gpus_per_node = {nnodes} * {gpus} = {world}"
    train_batch, n = values("data.train_batch_size"), values("actor_rollout_ref.rollout.n")
    if train_batch * n % world:
        problems.append(f"data.train_batch_size: expected train_batch_size * actor_rollout_ref.rollout.n "
                        f"divisible by {world_words}, got {train_batch} * {n} = {train_batch * n}")
    run_rule(lambda v, p: _role_batches_divide("actor_rollout_ref.actor", v, p, world_words, world),
              values, problems)
    if critic_enabled(values):
        run_rule(lambda v, p: _role_batches_divide("critic", v, p, world_words, world), values, problems)


def _role_batches_divide(role: str, values: Values, problems: list[str], world_words: str, world: int) -> None:
    train_batch, n = values("data.train_batch_size"), values("actor_rollout_ref.rollout.n")
    mini = values(f"{role}.ppo_mini_batch_size")
    if train_batch % mini:
        problems.append(f"data.train_batch_size: expected a multiple of {role}.ppo_mini_batch_size = {mini} "
                        f"(both count prompts), got {train_batch}")
    if mini * n % world:
        problems.append(f"{role}.ppo_mini_batch_size: expected ppo_mini_batch_size * actor_rollout_ref.rollout.n "
                        f"divisible by {world_words}, got {mini} * {n} = {mini * n}")
        return
    if values(f"{role}.use_dynamic_bsz"):
        return
    micro = values(f"{role}.ppo_micro_batch_size_per_gpu")
    per_gpu = mini * n // world
    if per_gpu % micro:
        problems.append(f"{role}.ppo_micro_batch_size_per_gpu: expected a divisor of the per-GPU mini-batch "
                        f"{role}.ppo_mini_batch_size * actor_rollout_ref.rollout.n / world size = "
                        f"{mini} * {n} / {world} = {per_gpu}, got {micro}")


@register_check()
def _reward_model_ready(values: Values, problems: list[str]) -> None:
    """An enabled reward model needs its checkpoint and a micro-batch size (rows, or a token budget with
    use_dynamic_bsz), and compares the policy's tokenizer with its own (input_tokenizer: null
    means the rows are the reward model's own tokens)."""
    if not values("reward_model.enable"):
        return
    if values("reward_model.model.path") is None:
        problems.append("reward_model.model.path: expected a sequence-classification model directory when "
                        "reward_model.enable=true, got None")
    if not values("reward_model.use_dynamic_bsz") and values("reward_model.micro_batch_size_per_gpu") is None:
        problems.append("reward_model.micro_batch_size_per_gpu: expected rows per reward-model forward when "
                        "reward_model.enable=true and reward_model.use_dynamic_bsz=false, got None")
    policy_tokenizers = {values("actor_rollout_ref.model.path"), values("data.tokenizer")} - {None}
    input_tokenizer = values("reward_model.model.input_tokenizer")
    if input_tokenizer is not None and input_tokenizer not in policy_tokenizers:
        problems.append(f"reward_model.model.input_tokenizer: expected null or the policy's tokenizer "
                        f"({' or '.join(sorted(policy_tokenizers))}: the controller hands the reward model the one "
                        f"tokenizer the run renders prompts with), got {input_tokenizer!r}")


# Token budgets of the dynamic batch size, each with the switch that puts it to use.
TOKEN_BUDGETS: dict[str, str] = {
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
    "critic.ppo_max_token_len_per_gpu": "critic.use_dynamic_bsz",
    "critic.forward_max_token_len_per_gpu": "critic.use_dynamic_bsz",
    "reward_model.forward_max_token_len_per_gpu": "reward_model.use_dynamic_bsz",
}


@register_check()
def _token_budgets_hold_a_sequence(values: Values, problems: list[str]) -> None:
    """A token budget in use must hold the longest possible row, max_prompt_length + max_response_length."""
    longest = values("data.max_prompt_length") + values("data.max_response_length")
    for budget_key, switch_key in TOKEN_BUDGETS.items():
        if budget_key.startswith("critic.") and not critic_enabled(values):
            continue
        if budget_key.startswith("reward_model.") and not values("reward_model.enable"):
            continue
        if values(switch_key) and values(budget_key) < longest:
            problems.append(f"{budget_key}: expected at least data.max_prompt_length + data.max_response_length = "
                            f"{longest} tokens (one whole sequence) with {switch_key}=true, got {values(budget_key)}")
