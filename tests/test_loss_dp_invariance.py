"""The PPO losses are invariant to the data-parallel size and the micro-batching (issue #12, point 8).

The same 8-row mini-batch goes through the real update path (DataParallelPPOActor.update_policy and
DataParallelPPOCritic.update_critic on a tiny random Qwen2 sharded with FSDP2) once on 1 rank with one
micro-batch and once on 2 real gloo ranks with micro-batches of 1 row. The ranks hold very unequal
token counts (rank 0: 31 response tokens, rank 1: 5, one row fully masked), so a per-rank
normalisation followed by FSDP's average over the ranks would weigh rank 1's tokens about 6 times as
much as rank 0's; the gradients must instead agree to 1e-5, for every loss_agg_mode.
"""
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import pytest

import hybridrl.checks  # noqa: F401  the spawned ranks validate configs: register the subsystems' checks
from hybridrl.config import compose_config, validate_config
from hybridrl.protocol import DataProto
from hybridrl.models.fsdp_utils import build_optimizer, load_hf_model, shard_model
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.workers.actor.dp_actor import DataParallelPPOActor
from hybridrl.workers.critic.dp_critic import DataParallelPPOCritic

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
         "seq-mean-token-sum-norm@4"]  # MODE@F: with actor.loss_scale_factor=F (the critic takes the actor's)
PROMPT, RESPONSE, TEMPERATURE = 4, 8, 0.9
# response lengths: rows 0-3 go to rank 0 (31 tokens), rows 4-7 to rank 1 (5 tokens, one row empty)
LENGTHS = [8, 7, 8, 8, 0, 1, 2, 2]


def update_batch(vocab_size: int) -> DataProto:
    generator = torch.Generator().manual_seed(0)
    rows = len(LENGTHS)
    response_mask = (torch.arange(RESPONSE) < torch.tensor(LENGTHS).unsqueeze(-1)).long()
    prompt_ids = torch.randint(4, vocab_size, (rows, PROMPT), generator=generator)
    responses = torch.randint(4, vocab_size, (rows, RESPONSE), generator=generator)
    attention_mask = torch.cat([torch.ones(rows, PROMPT, dtype=torch.long), response_mask], dim=1)
    return DataProto.from_dict({
        "input_ids": torch.cat([prompt_ids, responses], dim=1), "attention_mask": attention_mask,
        "position_ids": torch.arange(PROMPT + RESPONSE).expand(rows, -1).clone(), "responses": responses,
        "response_mask": response_mask,
        # log-ratios of up to +-0.5 put some tokens in the clipped region of the PPO surrogate
        "old_log_probs": -3.0 + torch.rand(rows, RESPONSE, generator=generator) - 0.5,
        "advantages": torch.randn(rows, RESPONSE, generator=generator) * response_mask,
        "values": torch.randn(rows, RESPONSE, generator=generator) * response_mask,
        "returns": torch.randn(rows, RESPONSE, generator=generator) * response_mask,
    }, meta_info={"temperature": TEMPERATURE})


def configs(model_dir: str, mode_at: str, world_size: int, micro_batch: int):
    mode, _, factor = mode_at.partition("@")
    overrides = [f"actor_rollout_ref.actor.loss_scale_factor={factor or 'null'}",f"trainer.n_gpus_per_node={world_size}", f"actor_rollout_ref.model.path={model_dir}",
                 "data.train_files=x.parquet", "data.val_files=x.parquet",
                 "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                 f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch}",
                 f"actor_rollout_ref.actor.loss_agg_mode={mode}", "actor_rollout_ref.actor.entropy_coeff=0.01",
                 "actor_rollout_ref.actor.grad_clip=1e6", "algorithm=gae", "critic.ppo_mini_batch_size=8",
                 f"critic.ppo_micro_batch_size_per_gpu={micro_batch}", f"critic.loss_agg_mode={mode}",
                 "critic.grad_clip=1e6", "actor_rollout_ref.actor.shuffle=false", "critic.shuffle=false",
                 "actor_rollout_ref.actor.optim.lr=0", "critic.optim.lr=0"]
    config = validate_config(compose_config(overrides))
    return config.actor_rollout_ref.actor, config.critic


def full_gradients(module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (a collective under FSDP2: all ranks call it)."""
    return {name: (param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad).clone()
            for name, param in module.named_parameters()}


def _rank_main(rank: int, world_size: int, model_dir: str, micro_batch: int, work_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{work_dir}/pg_{world_size}", rank=rank,
                            world_size=world_size)
    try:
        # One model of each kind for all modes: with lr=0 the optimizer steps leave the weights as they are.
        policy = shard_model(load_hf_model(model_dir), strategy="fsdp2", device="cpu", mixed_precision=False)
        critic_module = shard_model(load_hf_model(model_dir, value_head=True), strategy="fsdp2", device="cpu",
                                    mixed_precision=False)
        batch = update_batch(policy.config.vocab_size).chunk(world_size)[rank]
        results = {}
        for mode in MODES:
            actor_config, critic_config = configs(model_dir, mode, world_size, micro_batch)
            actor = DataParallelPPOActor(actor_config, policy, build_optimizer(policy, actor_config.optim),
                                         rollout_n=1, device="cpu")
            actor_metrics = actor.update_policy(batch)
            critic = DataParallelPPOCritic(critic_config, critic_module,
                                           build_optimizer(critic_module, critic_config.optim), rollout_n=1,
                                           device="cpu")
            critic_metrics = critic.update_critic(batch)
            results[mode] = {"actor": full_gradients(policy), "critic": full_gradients(critic_module),
                             "actor_metrics": actor_metrics, "critic_metrics": critic_metrics}
        if rank == 0:
            torch.save(results, f"{work_dir}/world{world_size}.pt")
    finally:
        dist.destroy_process_group()


# The runs compared, started together as the processes of one spawn: (world size, rank, micro-batch size).
RUNS = [(1, 0, 8), (2, 0, 1), (2, 1, 1)]


def _process_main(index: int, model_dir: str, work_dir: str) -> None:
    world_size, rank, micro_batch = RUNS[index]
    _rank_main(rank, world_size, model_dir, micro_batch, work_dir)


@pytest.fixture(scope="module")
def gradients(tmp_path_factory):
    """{world_size: {mode: gradients and metrics}} from 1 rank (one micro-batch of 8) and 2 ranks (micro 1), run at
    the same time (each world has its own process group)."""
    work_dir = tmp_path_factory.mktemp("dp_invariance")
    texts = ["the cat sat on the mat", "one two three four five", "hello world again"]
    model_dir = build_tiny_model(str(work_dir / "model"), build_tokenizer(texts * 20, vocab_size=96),
                                 hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
    mp.spawn(_process_main, args=(model_dir, str(work_dir)), nprocs=len(RUNS), join=True)
    return {world_size: torch.load(work_dir / f"world{world_size}.pt") for world_size in (1, 2)}


def test_the_ranks_hold_unequal_token_counts():
    mask = update_batch(96).batch["response_mask"]
    assert [int(mask[:4].sum()), int(mask[4:].sum())] == [31, 5]
    assert int((mask.sum(-1) == 0).sum()) == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_one_rank_and_two_ranks_give_the_same_gradient(gradients, mode, role):
    one, two = gradients[1][mode][role], gradients[2][mode][role]
    assert set(one) == set(two)
    assert max(float(g.abs().max()) for g in one.values()) > 1e-3  # a real gradient, not zeros on both sides
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-5, msg=lambda m: f"{role} {name}: {m}")


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_loss_scale_factor_divides_seq_mean_token_sum_norm_instead_of_the_padded_width(gradients, role):
    """verl's loss_scale_factor: 4 instead of the padded response width (8) doubles the loss, so the gradient."""
    default, by_four = gradients[1]["seq-mean-token-sum-norm"][role], gradients[1]["seq-mean-token-sum-norm@4"][role]
    for name in default:
        torch.testing.assert_close(by_four[name], 2 * default[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", MODES)
def test_one_rank_and_two_ranks_report_the_same_losses(gradients, mode):
    """The reported losses are those of the global mini-batch too (summed shares, then the mean over ranks)."""
    one, two = gradients[1][mode], gradients[2][mode]
    for role, keys in (("actor_metrics", ["actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"]),
                       ("critic_metrics", ["critic/vf_loss", "critic/grad_norm", "critic/vpred_mean"])):
        for key in keys:
            assert two[role][key] == pytest.approx(one[role][key], rel=1e-5, abs=1e-7), (role, key)
