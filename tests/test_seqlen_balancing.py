"""Sequence balancing: Karmarkar–Karp partitions, token-budget micro-batches, balance_batch, and the proof that
dynamic micro-batches (with packed forwards) give the fixed-size path's gradients when losses are scaled by share."""
import itertools
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridrl.protocol import DataProto
from hybridrl.algorithms.core_algos import agg_loss
from hybridrl.models.padding import response_log_probs_packed
from hybridrl.data.seqlen_balancing import (balance_batch, get_reverse_idx, get_seqlen_balanced_partitions,
                                             karmarkar_karp, rearrange_micro_batches)
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.algorithms.torch_functional import logprobs_from_logits


def batch_of_lengths(seqlens: list[int], width: int | None = None) -> DataProto:
    """Right-padded rows whose attention masks sum to `seqlens`; input_ids hold the row number (to track rows)."""
    width = width or max(seqlens)
    attention_mask = torch.zeros(len(seqlens), width, dtype=torch.long)
    for row, length in enumerate(seqlens):
        attention_mask[row, :length] = 1
    input_ids = torch.arange(len(seqlens)).unsqueeze(1).expand(-1, width).clone()
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": attention_mask},
                               {"uid": [f"row{row}" for row in range(len(seqlens))]})


def group_sums(seqlens, groups):
    return [sum(seqlens[item] for item in group) for group in groups]


def optimal_largest_sum(seqlens: list[int], k: int, equal_size: bool) -> int:
    """Brute force over every assignment of items to groups."""
    best = None
    for assignment in itertools.product(range(k), repeat=len(seqlens)):
        if equal_size and len({assignment.count(group) for group in range(k)}) > 1:
            continue
        sums = [0] * k
        for item, group in enumerate(assignment):
            sums[group] += seqlens[item]
        best = max(sums) if best is None else min(best, max(sums))
    return best


# ------------------------------------------------------------------------------------------------ the algorithm

def test_karmarkar_karp_on_the_textbook_example():
    # 8,7 -> 1; 6,5 -> 1; 4,1 -> 3; 3,1 -> 2: differencing ends 16 vs 14, while 8+7 = 6+5+4 = 15 is optimal.
    groups = karmarkar_karp([8, 7, 6, 5, 4], k=2, equal_size=False)
    assert [sorted(group) for group in groups] == [[1, 3, 4], [0, 2]]
    assert group_sums([8, 7, 6, 5, 4], groups) == [16, 14]


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("equal_size", [False, True])
def test_karmarkar_karp_is_within_its_worst_case_ratio_of_the_optimum(k, equal_size):
    """Bounds: 4/3 - 1/(3k) without size constraint (Michiels et al. 2007), 2 - 1/k with equal sizes (2003)."""
    bound = 4 / 3 - 1 / (3 * k) if not equal_size else 2 - 1 / k
    rng = random.Random(k * 10 + equal_size)
    optimal_hits, trials = 0, 40
    for _ in range(trials):
        n = rng.choice([2 * k, 3 * k]) if k == 2 else 2 * k
        seqlens = [rng.randint(1, 60) for _ in range(n)]
        groups = karmarkar_karp(seqlens, k, equal_size)
        assert sorted(itertools.chain(*groups)) == list(range(n))  # every item placed exactly once
        if equal_size:
            assert [len(group) for group in groups] == [n // k] * k
        largest, optimum = max(group_sums(seqlens, groups)), optimal_largest_sum(seqlens, k, equal_size)
        assert optimum <= largest <= bound * optimum
        optimal_hits += largest == optimum
    assert optimal_hits >= trials // 3  # typically optimal, not merely within the worst case


def test_partitions_are_never_empty_even_with_zero_length_rows():
    partitions = get_seqlen_balanced_partitions([0, 0, 0, 5], k_partitions=3, equal_size=False)
    assert all(partitions) and sorted(itertools.chain(*partitions)) == [0, 1, 2, 3]
    assert partitions == sorted(partitions, key=lambda group: group[0])  # ordered by first row


def test_partition_errors_name_the_numbers():
    with pytest.raises(ValueError, match="cannot make 4 non-empty partitions of 3 rows"):
        get_seqlen_balanced_partitions([1, 2, 3], 4, equal_size=False)
    with pytest.raises(ValueError, match="got 5 items and k=2"):
        karmarkar_karp([1, 2, 3, 4, 5], 2, equal_size=True)


# ------------------------------------------------------------------------------------------------ micro-batches

def test_rearrange_micro_batches_fills_the_budget_and_reverse_index_restores_order():
    seqlens = [3, 5, 2, 7, 1]
    data = batch_of_lengths(seqlens, width=9)
    micro_batches, indices = rearrange_micro_batches(data, max_token_len=10, same_micro_num_in_dp=False)
    assert indices == [[0, 1, 4], [2, 3]]  # ceil(18 / 10) = 2 micro-batches of 9 tokens each
    assert [int(micro.batch["attention_mask"].sum()) for micro in micro_batches] == [9, 9]
    assert micro_batches[1].non_tensor_batch["uid"].tolist() == ["row2", "row3"]
    outputs = torch.cat([micro.batch["input_ids"] * 100 for micro in micro_batches])  # some per-row result
    restored = outputs[get_reverse_idx(list(itertools.chain(*indices)))]
    assert torch.equal(restored, data.batch["input_ids"] * 100)


def test_rearrange_adds_micro_batches_until_each_fits():
    # ceil(18 / 10) = 2, but two sixes never fit 10 tokens: three micro-batches of one row each.
    micro_batches, indices = rearrange_micro_batches(batch_of_lengths([6, 6, 6]), max_token_len=10,
                                                     same_micro_num_in_dp=False)
    assert sorted(indices) == [[0], [1], [2]]
    rng = random.Random(0)
    seqlens = [rng.randint(1, 50) for _ in range(40)]
    micro_batches, indices = rearrange_micro_batches(batch_of_lengths(seqlens), max_token_len=120)
    token_counts = [int(micro.batch["attention_mask"].sum()) for micro in micro_batches]
    assert max(token_counts) <= 120 and sum(token_counts) == sum(seqlens)
    assert len(micro_batches) >= -(-sum(seqlens) // 120)
    assert sorted(itertools.chain(*indices)) == list(range(40))


def test_a_sequence_over_the_budget_is_an_error_naming_both_numbers():
    message = r"a sequence of 12 tokens \(row 1\) exceeds the token budget max_token_len=10"
    with pytest.raises(ValueError, match=message):
        rearrange_micro_batches(batch_of_lengths([3, 12, 4]), max_token_len=10)


def test_get_reverse_idx_rejects_a_non_permutation():
    assert get_reverse_idx([2, 0, 1]) == [1, 2, 0]
    with pytest.raises(ValueError, match="must be a permutation of 0..2"):
        get_reverse_idx([0, 0, 1])


# ------------------------------------------------------------------------------------------------ balance_batch

def test_balance_batch_equalises_the_ranks_tokens():
    data = batch_of_lengths([10, 9, 1, 2])  # arrival order: rank 0 gets 19 tokens, rank 1 gets 3
    metrics = balance_batch(data, world_size=2)
    assert data.non_tensor_batch["uid"].tolist() == ["row0", "row2", "row1", "row3"]  # rows moved whole
    assert data.batch["input_ids"][:, 0].tolist() == [0, 2, 1, 3]
    assert [int(chunk.batch["attention_mask"].sum()) for chunk in data.chunk(2)] == [11, 11]
    assert metrics == {"seqlen_balance/min_partition": 11.0, "seqlen_balance/max_partition": 11.0,
                       "seqlen_balance/imbalance_before": pytest.approx(19 / 11 - 1),
                       "seqlen_balance/imbalance_after": 0.0}


def test_balance_batch_keeps_an_order_that_is_already_balanced():
    data = batch_of_lengths([5, 1, 4, 2])  # 6 and 6 already; balancing cannot do better
    metrics = balance_batch(data, world_size=2)
    assert data.batch["input_ids"][:, 0].tolist() == [0, 1, 2, 3]
    assert metrics["seqlen_balance/imbalance_before"] == metrics["seqlen_balance/imbalance_after"] == 0.0


def test_balance_batch_needs_equal_chunks():
    with pytest.raises(ValueError, match="3 rows do not split into 2 equal data-parallel chunks"):
        balance_batch(batch_of_lengths([1, 2, 3]), world_size=2)


# ------------------------------------------------------------------------------------------------ gradients

PROMPT_WIDTH, RESPONSE_WIDTH, TEMPERATURE = 6, 6, 0.9


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    tokenizer = build_tokenizer(["what is 12 + 30 ? the answer is 42 so"] * 10, vocab_size=300)
    path = build_tiny_model(str(tmp_path_factory.mktemp("policy")), tokenizer, hidden_size=32, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=64)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)


def mini_batch(vocab_size: int) -> DataProto:
    """8 rows of the actor's layout (left-padded prompts, right-padded responses; row 5 answered nothing)."""
    generator = torch.Generator().manual_seed(3)
    prompt_lengths, response_lengths = [6, 2, 4, 1, 5, 3, 6, 2], [6, 1, 3, 5, 2, 0, 4, 6]
    rows = len(prompt_lengths)
    attention_mask = torch.zeros(rows, PROMPT_WIDTH + RESPONSE_WIDTH, dtype=torch.long)
    for row, (prompt_len, response_len) in enumerate(zip(prompt_lengths, response_lengths)):
        attention_mask[row, PROMPT_WIDTH - prompt_len:PROMPT_WIDTH + response_len] = 1
    input_ids = torch.randint(4, vocab_size, attention_mask.shape, generator=generator) * attention_mask
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "responses": input_ids[:, PROMPT_WIDTH:],
        "response_mask": attention_mask[:, PROMPT_WIDTH:], "advantages": torch.randn(rows, RESPONSE_WIDTH,
                                                                                     generator=generator)})


def padded_log_probs(model, batch: dict) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False).logits
    return logprobs_from_logits(logits[:, -RESPONSE_WIDTH - 1:-1] / TEMPERATURE, batch["responses"])


def packed_log_probs(model, batch: dict) -> torch.Tensor:
    return response_log_probs_packed(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                     batch["responses"], TEMPERATURE)[0]


def surrogate_loss(log_probs: torch.Tensor, batch: dict, mode: str) -> torch.Tensor:
    return agg_loss(-log_probs * batch["advantages"], batch["response_mask"], mode)


def aggregation_weight(batch: dict, mode: str) -> torch.Tensor:
    """What agg_loss divides by: response tokens (token-mean) or rows that have a response (seq-mean-token-mean)."""
    if mode == "token-mean":
        return batch["response_mask"].sum()
    return (batch["response_mask"].sum(-1) > 0).sum()


def accumulated_gradients(model, micro_batches: list[DataProto], forward, mode: str, scaling: str) -> dict:
    model.zero_grad()
    whole = sum(aggregation_weight(micro.batch, mode) for micro in micro_batches)
    for micro in micro_batches:
        share = aggregation_weight(micro.batch, mode) / whole if scaling == "share" else 1 / len(micro_batches)
        (surrogate_loss(forward(model, micro.batch), micro.batch, mode) * share).backward()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_dynamic_micro_batches_give_the_fixed_size_gradients(policy, mode):
    data = mini_batch(policy.config.vocab_size)
    whole_batch = accumulated_gradients(policy, [data], padded_log_probs, mode, "share")
    fixed = accumulated_gradients(policy, data.split(2), padded_log_probs, mode, "share")
    dynamic_batches, indices = rearrange_micro_batches(data, max_token_len=24)
    assert sorted(len(rows) for rows in indices) != [2, 2, 2, 2] and len(indices) >= 3  # a different cut
    dynamic = accumulated_gradients(policy, dynamic_batches, packed_log_probs, mode, "share")
    naive = accumulated_gradients(policy, dynamic_batches, packed_log_probs, mode, "mean of micro-batch losses")
    largest_gap = 0.0
    for name, expected in whole_batch.items():
        torch.testing.assert_close(fixed[name], expected, rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(dynamic[name], expected, rtol=0, atol=1e-5, msg=name)
        largest_gap = max(largest_gap, float((naive[name] - expected).abs().max()))
    assert largest_gap > 1e-3  # averaging micro-batch losses unweighted would change the update
