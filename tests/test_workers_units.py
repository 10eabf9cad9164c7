"""Worker building blocks that need no process group: rollout registry and user classes, EOS masks,
LR schedules, and the global loss normalisation that makes gradient accumulation and data parallelism exact."""
import textwrap

import pytest
import torch

from hybridrl.algorithms.core_algos import agg_loss
from hybridrl.config.compose import compose_config
from hybridrl.config.validation import ConfigError, validate_config
from hybridrl.models.fsdp_utils import build_lr_scheduler, warmup_steps
from hybridrl.workers.rollout import (BaseRollout, HFRollout, build_rollout, get_rollout_class, load_rollout_class,
                                      register_rollout)
from hybridrl.workers.rollout.hf_rollout import mask_through_first_eos


def rollout_config(*overrides):
    return validate_config(compose_config(["data.train_files=x.parquet", "data.val_files=x.parquet",
                                           *overrides])).actor_rollout_ref.rollout


# ---------------------------------------------------------------------- rollout registry

def test_hf_is_registered_and_unknown_names_list_the_known_ones():
    assert get_rollout_class("hf") is HFRollout
    with pytest.raises(ValueError, match=r"rollout.name='nope'.*'hf'.*'sglang'"):
        get_rollout_class("nope")


def test_register_rollout_refuses_a_second_class_under_a_taken_name():
    @register_rollout("test_units_echo")
    class Echo(BaseRollout):
        def generate_sequences(self, prompts):
            return prompts

    assert get_rollout_class("test_units_echo") is Echo
    with pytest.raises(ValueError, match="already registered"):
        register_rollout("test_units_echo")(type("Other", (Echo,), {}))


def test_custom_cls_is_loaded_from_a_file_and_built_with_the_standard_keywords(tmp_path):
    path = tmp_path / "my_rollout.py"
    path.write_text(textwrap.dedent("""
        class ConstantRollout:
            def __init__(self, config, model_config=None, module=None):
                self.config, self.module = config, module

            def resume(self, tags):
                pass

            def update_weights(self, named_tensors):
                pass

            def release(self, tags):
                pass

            def generate_sequences(self, prompts):
                return prompts
    """))
    config = rollout_config(f"actor_rollout_ref.rollout.custom_cls.path={path}",
                            "actor_rollout_ref.rollout.custom_cls.name=ConstantRollout")
    rollout = build_rollout(config, model_config=None, module="the-module")
    assert type(rollout).__name__ == "ConstantRollout" and rollout.module == "the-module"
    assert rollout.config.response_length == config.response_length

    path.write_text("class NotARollout:\n    def generate_sequences(self, prompts):\n        return prompts\n")
    with pytest.raises(TypeError, match=r"missing \['resume', 'update_weights', 'release'\]"):
        load_rollout_class(rollout_config(f"actor_rollout_ref.rollout.custom_cls.path={path}",
                                          "actor_rollout_ref.rollout.custom_cls.name=NotARollout"))


def test_hf_rollout_refuses_ignore_eos_and_a_missing_module():
    with pytest.raises(NotImplementedError, match="ignore_eos"):
        HFRollout(rollout_config("actor_rollout_ref.rollout.ignore_eos=true"), module=torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="needs module"):
        HFRollout(rollout_config(), module=None)


# ---------------------------------------------------------------------- EOS mask

def test_mask_runs_through_the_first_eos_of_any_eos_id():
    responses = torch.tensor([[5, 6, 2, 7, 2],    # EOS 2 at position 2
                              [5, 3, 6, 6, 6],    # the other EOS id, 3, at position 1
                              [5, 6, 7, 8, 9],    # no EOS: everything counts
                              [2, 0, 0, 0, 0]])   # EOS first
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert mask_through_first_eos(responses, [2, 3]).equal(expected)
    # pad == eos (models without a pad token): the padding after the first EOS is masked out
    assert mask_through_first_eos(torch.tensor([[4, 0, 0]]), [0]).tolist() == [[1, 1, 0]]


# ---------------------------------------------------------------------- LR schedules

def optim_config(*overrides):
    cfg = validate_config(compose_config(["data.train_files=x.parquet", "data.val_files=x.parquet",
                                          "actor_rollout_ref.actor.optim.lr=0.1",
                                          *[f"actor_rollout_ref.actor.optim.{o}" for o in overrides]]))
    return cfg.actor_rollout_ref.actor.optim


def lrs(optim, steps, total_training_steps=None):
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    scheduler = build_lr_scheduler(optimizer, optim, total_training_steps)
    values = []
    for _ in range(steps):
        values.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return values


def test_constant_schedule_warms_up_linearly_then_holds():
    assert lrs(optim_config("lr_warmup_steps=2"), 4) == pytest.approx([0.0, 0.05, 0.1, 0.1])
    assert lrs(optim_config(), 2) == pytest.approx([0.1, 0.1])


def test_warmup_steps_win_over_the_ratio_and_the_ratio_needs_a_run_length():
    assert warmup_steps(optim_config("lr_warmup_steps=3", "lr_warmup_steps_ratio=0.5"), 10) == 3
    assert warmup_steps(optim_config("lr_warmup_steps_ratio=0.25"), 10) == 2
    with pytest.raises(ValueError, match="total_training_steps"):
        warmup_steps(optim_config("lr_warmup_steps_ratio=0.25"), None)


def test_cosine_schedule_decays_to_min_lr_ratio():
    values = lrs(optim_config("warmup_style=cosine", "lr_warmup_steps=1", "min_lr_ratio=0.1"), 6,
                 total_training_steps=5)
    # warmup step 0 -> 0; then cosine from 0.1 down to 0.01 over steps 1..5 (half a cycle)
    cosine = [0.01 + 0.09 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * k / 4)).item()) for k in range(5)]
    assert values == pytest.approx([0.0] + cosine)
    with pytest.raises(ValueError, match="total_training_steps"):
        lrs(optim_config("warmup_style=cosine"), 1)


def test_the_run_length_reaches_the_workers_as_an_argument_never_through_the_config():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.optim.total_training_steps: expected -1 "
                                          r"\(set trainer.total_training_steps instead\), got 10"):
        optim_config("total_training_steps=10")
    assert optim_config().total_training_steps == -1


# ---------------------------------------------------------------------- exact gradient accumulation

@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_micro_losses_with_global_counts_add_up_to_the_mini_batch_loss(mode):
    """The rule update_policy relies on: split the mini-batch over R ranks, each rank into micro-batches,
    aggregate each micro-batch with the global counts and dp_size=R, sum per rank, average over the ranks
    (what FSDP does to the gradients): that is agg_loss of the whole mini-batch, for unequal token counts
    and a fully-masked row."""
    generator = torch.Generator().manual_seed(0)
    losses = torch.randn(8, 5, generator=generator)
    mask = (torch.arange(5) < torch.tensor([1, 5, 0, 3, 2, 4, 5, 1]).unsqueeze(-1)).long()
    whole = agg_loss(losses, mask, mode)
    info = {"batch_num_tokens": float(mask.sum()), "global_batch_size": float((mask.sum(-1) > 0).sum())}
    for ranks, micro_size in ((1, 1), (1, 8), (2, 1), (2, 3), (4, 2)):
        rank_rows = torch.arange(8).chunk(ranks)
        rank_sums = [sum(agg_loss(losses[rows[i:i + micro_size]], mask[rows[i:i + micro_size]], mode,
                                  dp_size=ranks, **info) for i in range(0, len(rows), micro_size))
                     for rows in rank_rows]
        assert (sum(rank_sums) / ranks).item() == pytest.approx(whole.item(), rel=1e-6)
