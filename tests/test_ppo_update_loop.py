"""PPOUpdateLoop (workers/ppo_update_loop.py), the epoch / mini-batch / micro-batch loop the actor and the critic
share, driven here by a toy loss on a one-parameter module: the steps it takes, how it adds up metrics, and the
skipped step on a non-finite gradient. The actor's and critic's own numbers are in test_workers*.py,
test_scale_features.py and test_loss_dp_invariance.py."""
import pytest
import torch
from torch import nn

from hybridrl.workers.ppo_update_loop import MicroBatchLoss, PPOUpdateLoop


def toy_loop(module, **overrides):
    settings = dict(role="toy", module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                    device=torch.device("cpu"), ppo_epochs=2, shuffle=False, grad_clip=1e9, mini_batch_size=4,
                    micro_batch_size=2, max_token_len=None)
    return PPOUpdateLoop(**{**settings, **overrides})


def rows(num_rows=8, tokens_per_row=(1, 3)):
    mask = torch.zeros(num_rows, 3)
    for row in range(num_rows):
        mask[row, :tokens_per_row[row % 2]] = 1
    return {"input_ids": torch.arange(num_rows, dtype=torch.float32)[:, None], "response_mask": mask}


def test_one_step_per_mini_batch_per_epoch_with_summed_terms_and_token_weighted_means():
    module = nn.Linear(1, 1, bias=False)
    calls = []

    def loss(micro_batch, batch_info):
        calls.append(micro_batch["input_ids"].flatten().tolist())
        value = (module(micro_batch["input_ids"]) ** 2).sum() / batch_info["batch_num_tokens"]
        return MicroBatchLoss(value, loss_terms={"toy/loss": value.detach()},
                              token_metrics={"toy/first_row": micro_batch["input_ids"][0, 0]})

    metrics = toy_loop(module).run(rows(), loss, "toy_update", fixed_metrics={"toy/coef": 0.5})
    assert calls == [[0, 1], [2, 3], [4, 5], [6, 7]] * 2  # 2 epochs x 2 mini-batches x 2 micro-batches, in order
    assert sorted(metrics) == ["toy/coef", "toy/first_row", "toy/grad_norm", "toy/loss"]
    assert all(len(values) == 4 for values in metrics.values())  # one value per optimizer step
    assert metrics["toy/coef"] == [0.5] * 4
    # rows 0/1 hold 1 and 3 response tokens, so each micro-batch has 4 of the mini-batch's 8 tokens: weight 1/2
    assert metrics["toy/first_row"][:2] == pytest.approx([(0 + 2) / 2, (4 + 6) / 2])


def test_a_non_finite_gradient_norm_skips_the_step():
    module = nn.Linear(1, 1, bias=False)
    before = module.weight.detach().clone()
    metrics = toy_loop(module, ppo_epochs=1, mini_batch_size=8).run(
        rows(), lambda micro_batch, _: MicroBatchLoss(module.weight.sum() * float("nan")), "toy_update")
    assert torch.isnan(torch.tensor(metrics["toy/grad_norm"][0]))
    assert torch.equal(module.weight, before) and module.weight.grad is None


def test_rows_that_do_not_fill_whole_mini_batches_are_refused():
    with pytest.raises(ValueError, match=r"toy_update: this rank got 6 rows, not a multiple of its mini-batch of 4 "
                                         r"rows \(toy.ppo_mini_batch_size x rollout.n / world size\)"):
        toy_loop(nn.Linear(1, 1)).run(rows(6), lambda *_: None, "toy_update")
