"""Ulysses sequence parallelism (verl's ulysses_sequence_parallel_size; models/sequence_parallel.py) gives the
log-probs, entropies and gradients of the plain packed path.

The same 8-row batch goes through the real DataParallelPPOActor (a tiny random Qwen2, 4 attention heads and 2
key/value heads, sharded with FSDP2, use_remove_padding) once on 1 rank and once on 2 real gloo ranks forming one
sequence-parallel group of 2: each micro-batch's packed row is split between the two ranks, whose attention swaps
heads for sequence with all-to-alls. The rows have very different lengths, so the split falls inside sequences and
the ranks hold unequal token counts.
"""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from transformers import AutoTokenizer

import hybridrl.checks  # noqa: F401  the spawned ranks validate configs: register the subsystems' checks
from hybridrl.config import ConfigError, check_before_start, compose_config, validate_config
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.models.config_checks import _sequence_parallel_fits_the_model
from hybridrl.models.fsdp_utils import build_optimizer, load_hf_model, shard_model
from hybridrl.models.padding import response_log_probs_packed
from hybridrl.protocol import DataProto
from hybridrl.workers.actor.dp_actor import FORWARD_KEYS, DataParallelPPOActor
from test_async_rollout import fit_keeping_update_batches
from test_e2e_training import make_config, read_metrics
from test_loss_dp_invariance import full_gradients
from test_scale_features import padded_rows

PROMPT, RESPONSE, TEMPERATURE = 5, 8, 0.9
PROMPT_LENGTHS = [5, 2, 4, 1, 3, 5, 2, 4]
RESPONSE_LENGTHS = [8, 7, 3, 8, 1, 2, 6, 5]


def update_batch(vocab_size: int) -> DataProto:
    generator = torch.Generator().manual_seed(0)
    rows = len(PROMPT_LENGTHS)
    padded = padded_rows(PROMPT_LENGTHS, RESPONSE_LENGTHS, PROMPT, RESPONSE, vocab_size, generator)
    response_mask = padded["response_mask"]
    return DataProto.from_dict({
        **padded,
        "old_log_probs": -3.0 + torch.rand(rows, RESPONSE, generator=generator) - 0.5,
        "advantages": torch.randn(rows, RESPONSE, generator=generator) * response_mask,
    }, meta_info={"temperature": TEMPERATURE})


def actor_config(model_dir: str, world_size: int, sequence_parallel: int):
    return validate_config(compose_config([
        f"trainer.n_gpus_per_node={world_size}", f"actor_rollout_ref.model.path={model_dir}",
        "data.train_files=x.parquet", "data.val_files=x.parquet", "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.entropy_coeff=0.1",
        f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sequence_parallel}",
        "actor_rollout_ref.actor.grad_clip=1e6", "actor_rollout_ref.actor.optim.lr=0"])).actor_rollout_ref.actor


def _rank_main(rank: int, world_size: int, model_dir: str, work_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{work_dir}/pg_{world_size}", rank=rank,
                            world_size=world_size)
    try:
        policy = shard_model(load_hf_model(model_dir), strategy="fsdp2", device="cpu", mixed_precision=False)
        config = actor_config(model_dir, world_size, sequence_parallel=world_size)
        actor = DataParallelPPOActor(config, policy, build_optimizer(policy, config.optim), rollout_n=1,
                                     log_prob_micro_batch_size=2, use_remove_padding=True, device="cpu")
        batch = update_batch(policy.config.vocab_size).chunk(world_size)[rank]
        log_probs, entropy = actor.compute_log_prob(batch, calculate_entropy=True)
        metrics = actor.update_policy(batch)
        result = {"log_probs": log_probs, "entropy": entropy, "gradients": full_gradients(policy),
                  "metrics": metrics}
        gathered = [None] * world_size
        dist.all_gather_object(gathered, result)
        if rank == 0:
            torch.save(gathered, f"{work_dir}/world{world_size}.pt")
    finally:
        dist.destroy_process_group()


RUNS = [(1, 0), (2, 0), (2, 1)]  # (world size = sequence-parallel size, rank), started together


def _process_main(index: int, model_dir: str, work_dir: str) -> None:
    _rank_main(RUNS[index][1], RUNS[index][0], model_dir, work_dir)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work_dir = tmp_path_factory.mktemp("sequence_parallel")
    texts = ["the cat sat on the mat", "one two three four five", "hello world again"]
    model_dir = build_tiny_model(str(work_dir / "model"), build_tokenizer(texts * 20, vocab_size=96),
                                 hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
    mp.spawn(_process_main, args=(model_dir, str(work_dir)), nprocs=len(RUNS), join=True)
    return {world_size: torch.load(work_dir / f"world{world_size}.pt") for world_size in (1, 2)}


def test_sequence_parallel_log_probs_and_entropy_equal_one_rank(results):
    mask = update_batch(96).batch["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        one = results[1][0][key]
        two = torch.cat([rank[key] for rank in results[2]])
        assert one[mask].abs().min() > 1e-3  # real numbers on every response token
        torch.testing.assert_close(two[mask], one[mask], rtol=0, atol=1e-5)
        assert not two[~mask].any()  # 0 at response padding, as the packed path


def test_sequence_parallel_gradient_equals_one_rank(results):
    one, two = results[1][0]["gradients"], results[2][0]["gradients"]
    assert set(one) == set(two)
    assert max(float(g.abs().max()) for g in one.values()) > 1e-3
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert results[2][0]["metrics"][key] == pytest.approx(results[1][0]["metrics"][key], abs=1e-6), key


# ---------------------------------------------------------------------- config checks

def problems_for(*overrides, preflight_model=None):
    """The config checks' problems (and with preflight_model, the model checks' against that directory)."""
    overrides = ["data.train_files=x.parquet", "data.val_files=x.parquet", *overrides]
    try:
        config = validate_config(compose_config(overrides))
    except ConfigError as error:
        return error.problems
    if preflight_model is None:
        return []
    problems = []
    _sequence_parallel_fits_the_model(config, problems)
    return problems


FROM_ACTOR = " (value from ${actor_rollout_ref.actor.ulysses_sequence_parallel_size})"


def test_sequence_parallel_needs_packed_rows_and_a_divisor_of_the_world():
    key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    assert problems_for(f"{key}=4", "trainer.n_gpus_per_node=2", "actor_rollout_ref.model.use_remove_padding=false",
                        "actor_rollout_ref.model.use_fused_kernels=true") == [
        f"{key}: expected a divisor of the world size trainer.nnodes * trainer.n_gpus_per_node = 1 * 2 = 2 (groups "
        f"of consecutive ranks), got 4",
        f"{key}: expected 1 with actor_rollout_ref.model.use_remove_padding=false (the ranks of a group split one "
        f"packed row; set use_remove_padding=true, as verl requires), got 4",
        f"{key}: expected 1 with actor_rollout_ref.model.use_fused_kernels=true (the fused log-prob forward has no "
        f"sequence-parallel form here), got 4",
        # the reference follows the actor's size unless set
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size: expected a divisor of the world size trainer.nnodes * "
        f"trainer.n_gpus_per_node = 1 * 2 = 2 (groups of consecutive ranks), got 4{FROM_ACTOR}",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size: expected 1 with "
        "actor_rollout_ref.model.use_remove_padding=false (the ranks of a group split one packed row; set "
        f"use_remove_padding=true, as verl requires), got 4{FROM_ACTOR}",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size: expected 1 with actor_rollout_ref.model."
        f"use_fused_kernels=true (the fused log-prob forward has no sequence-parallel form here), got 4{FROM_ACTOR}",
    ]
    assert problems_for(f"{key}=2", "trainer.n_gpus_per_node=4", "actor_rollout_ref.model.use_remove_padding=true") \
        == []


def test_sequence_parallel_must_split_the_heads_of_the_model(tmp_path):
    """The toy-sized model has 4 attention heads and 2 key/value heads: 2 splits both, 4 only the query heads."""
    texts = ["the cat sat on the mat"] * 20
    model_dir = build_tiny_model(str(tmp_path / "model"), build_tokenizer(texts, vocab_size=64), hidden_size=32,
                                 num_heads=4, num_kv_heads=2, intermediate_size=64)
    common = [f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.use_remove_padding=true",
              "trainer.n_gpus_per_node=8"]
    assert problems_for(*common, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                        preflight_model=model_dir) == []
    assert problems_for(*common, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4",
                        "actor_rollout_ref.ref.ulysses_sequence_parallel_size=8", preflight_model=model_dir) == [
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size: expected a divisor of the model's "
        "num_key_value_heads = 2 (actor_rollout_ref.model.path config.json), got 4",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size: expected a divisor of the model's num_attention_heads "
        "= 4 (actor_rollout_ref.model.path config.json), got 8",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size: expected a divisor of the model's "
        "num_key_value_heads = 2 (actor_rollout_ref.model.path config.json), got 8",
    ]


# ---------------------------------------------------------------------- a trainer run

def test_two_steps_with_sequence_parallel_size_2_on_2_ranks(ray_local, toy_task, tmp_path):
    """The toy task's 2-step run on 2 CPU ranks forming one sequence-parallel group (actor and reference, KL loss on):
    the first update's old log-probs, computed by the group before any update, equal the starting model's
    log-probs on one process with the plain packed path."""
    tokenizer = AutoTokenizer.from_pretrained(toy_task["model"])
    model_dir = build_tiny_model(str(tmp_path / "model"), tokenizer, hidden_size=32, num_heads=4, num_kv_heads=2,
                                 intermediate_size=64)
    config = make_config({**toy_task, "model": model_dir}, str(tmp_path / "run"),
                         "actor_rollout_ref.model.use_remove_padding=true",
                         "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                         "actor_rollout_ref.actor.use_kl_loss=true")
    assert config.actor_rollout_ref.ref.ulysses_sequence_parallel_size == 2
    check_before_start(config)
    _, batches = fit_keeping_update_batches(config)

    assert [step["training/global_step"] for step in read_metrics(str(tmp_path / "run"))
            if "training/global_step" in step] == [1, 2]
    first = batches[0]
    mask = first.batch["response_mask"].bool()
    model = load_hf_model(model_dir)
    with torch.no_grad():
        expected, _ = response_log_probs_packed(model, *(first.batch[key] for key in FORWARD_KEYS),
                                                config.actor_rollout_ref.rollout.temperature)
    assert mask.sum() > 0
    torch.testing.assert_close(first.batch["old_log_probs"][mask], expected[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(first.batch["ref_log_prob"][mask], expected[mask], rtol=0, atol=1e-5)
