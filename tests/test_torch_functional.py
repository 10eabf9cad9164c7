"""hybridrl.algorithms.torch_functional against float64 references written element by element."""
import math

import pytest
import torch

from hybridrl.algorithms import torch_functional as F


def _random_mask(generator, batch_size=6, length=7):
    """Right-padded mask with varied lengths, one fully-masked row and one full row."""
    lengths = torch.randint(1, length + 1, (batch_size,), generator=generator)
    lengths[0], lengths[1] = 0, length
    return (torch.arange(length)[None, :] < lengths[:, None]).long()


def _masked_elements(values, mask):
    return [float(v) for v, m in zip(values.flatten().tolist(), mask.flatten().tolist()) if m]


def test_masked_mean_over_all_and_per_row_matches_elementwise_reference():
    g = torch.Generator().manual_seed(0)
    values, mask = torch.randn(6, 7, generator=g), _random_mask(g)
    kept = _masked_elements(values, mask)
    assert F.masked_mean(values, mask).item() == pytest.approx(math.fsum(kept) / len(kept), rel=1e-6)
    per_row = F.masked_mean(values, mask, axis=-1)
    for row in range(6):
        row_kept = _masked_elements(values[row], mask[row])
        expected = math.fsum(row_kept) / len(row_kept) if row_kept else 0.0
        assert per_row[row].item() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert per_row[0].item() == 0.0  # the fully-masked row gives 0, not NaN


def test_masked_mean_accepts_bool_masks_and_is_zero_when_nothing_is_masked_in():
    values = torch.tensor([[1.0, 2.0, 30.0]])
    assert F.masked_mean(values, torch.tensor([[True, True, False]])).item() == pytest.approx(1.5)
    assert F.masked_mean(values, torch.zeros(1, 3)).item() == 0.0


def test_masked_var_unbiased_and_biased_match_reference():
    g = torch.Generator().manual_seed(1)
    values, mask = torch.randn(6, 7, generator=g, dtype=torch.float64), _random_mask(g)
    kept = _masked_elements(values, mask)
    mean = math.fsum(kept) / len(kept)
    squares = math.fsum((v - mean) ** 2 for v in kept)
    assert F.masked_var(values, mask).item() == pytest.approx(squares / (len(kept) - 1), rel=1e-10)
    assert F.masked_var(values, mask, unbiased=False).item() == pytest.approx(squares / len(kept), rel=1e-10)


def test_masked_var_literal_and_too_few_elements_raise():
    assert F.masked_var(torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1, 1, 1, 0])).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="at least 2"):
        F.masked_var(torch.tensor([1.0, 2.0]), torch.tensor([1, 0]))


def test_masked_whiten_matches_reference_and_keeps_mean_on_request():
    g = torch.Generator().manual_seed(2)
    values, mask = torch.randn(6, 7, generator=g, dtype=torch.float64) * 3 + 1, _random_mask(g)
    kept = _masked_elements(values, mask)
    mean = math.fsum(kept) / len(kept)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in kept) / (len(kept) - 1) + 1e-8)
    whitened = F.masked_whiten(values, mask)
    unshifted = F.masked_whiten(values, mask, shift_mean=False)
    for row in range(6):
        for t in range(7):
            if mask[row, t]:
                assert whitened[row, t].item() == pytest.approx((values[row, t].item() - mean) / std, rel=1e-8)
                assert unshifted[row, t].item() == pytest.approx((values[row, t].item() - mean) / std + mean, rel=1e-8)


def test_masked_whiten_of_a_constant_is_zero_not_nan():
    whitened = F.masked_whiten(torch.full((2, 3), 4.0), torch.ones(2, 3))
    assert torch.equal(whitened, torch.zeros(2, 3))


def test_clip_by_value_uses_elementwise_bounds():
    lower, upper = torch.tensor([1.0, 1.0, 1.0]), torch.tensor([3.0, 4.0, 3.0])
    clipped = F.clip_by_value(torch.tensor([0.0, 5.0, 2.0]), lower, upper)
    assert clipped.tolist() == [1.0, 4.0, 2.0]


def _reference_log_softmax(row):
    """log softmax of one row of python floats, shifted by the max."""
    top = max(row)
    log_normalizer = top + math.log(math.fsum(math.exp(z - top) for z in row))
    return [z - log_normalizer for z in row]


@pytest.mark.parametrize("chunk_elements", [2**26, 11])  # one chunk, and many chunks of 2 rows
def test_logprobs_from_logits_matches_reference_in_float32_and_bf16(monkeypatch, chunk_elements):
    monkeypatch.setattr(F, "_CHUNK_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, 5, generator=g) * 4
    labels = torch.randint(0, 5, (3, 4), generator=g)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        cast = logits.to(dtype)
        result = F.logprobs_from_logits(cast, labels)
        assert result.shape == (3, 4) and result.dtype == torch.float32
        for i in range(3):
            for j in range(4):
                row = [float(z) for z in cast[i, j].double().tolist()]
                assert result[i, j].item() == pytest.approx(_reference_log_softmax(row)[labels[i, j]], abs=tolerance)


def test_logprobs_from_logits_is_stable_for_huge_logits_and_gives_the_right_gradient():
    logits = torch.tensor([[1e3, 1e3 - 1.0, -1e3]], requires_grad=True)  # exp() would overflow
    result = F.logprobs_from_logits(logits, torch.tensor([1]))
    expected = -1.0 - math.log(1.0 + math.exp(-1.0))
    assert result.item() == pytest.approx(expected, abs=1e-4)  # float32 spacing near 1000 is 6e-5
    result.sum().backward()
    p0, p1 = 1 / (1 + math.exp(-1.0)), math.exp(-1.0) / (1 + math.exp(-1.0))
    assert logits.grad[0].tolist() == pytest.approx([-p0, 1 - p1, 0.0], abs=1e-4)


@pytest.mark.parametrize("chunk_elements", [2**26, 7])
def test_entropy_from_logits_matches_reference(monkeypatch, chunk_elements):
    monkeypatch.setattr(F, "_CHUNK_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 6, generator=g) * 3
    entropy = F.entropy_from_logits(logits)
    assert entropy.shape == (2, 3) and entropy.dtype == torch.float32
    for i in range(2):
        for j in range(3):
            log_probs = _reference_log_softmax([float(z) for z in logits[i, j].double().tolist()])
            expected = -math.fsum(math.exp(lp) * lp for lp in log_probs)
            assert entropy[i, j].item() == pytest.approx(expected, abs=1e-5)


def test_entropy_literals_uniform_is_log_vocab_and_one_hot_is_zero():
    entropy = F.entropy_from_logits(torch.tensor([[0.0, 0.0, 0.0, 0.0], [1e4, 0.0, 0.0, 0.0]], dtype=torch.bfloat16))
    assert entropy.tolist() == pytest.approx([math.log(4), 0.0], abs=1e-6)


def _entropy_and_gradient(entropy_fn, logits, weights):
    """The entropy of `logits` and the gradient of sum(weights * entropy) with respect to them."""
    leaf = logits.detach().clone().requires_grad_(True)
    entropy = entropy_fn(leaf)
    (entropy * weights).sum().backward()
    return entropy.detach(), leaf.grad


@pytest.mark.parametrize("chunk_size", [None, 1, 4])  # one chunk; one row a chunk; chunks of 4 rows and a last of 3
def test_chunked_entropy_equals_the_unchunked_entropy_and_its_gradient(chunk_size):
    """verl's entropy_from_logits_with_chunking: same numbers, forward and backward, as the one-pass formula in
    float64 (dH/dz = p * (E_p[z] - z), by autograd of H = logsumexp(z) - sum(softmax(z) * z))."""
    g = torch.Generator().manual_seed(5)
    logits, weights = torch.randn(3, 5, 11, generator=g) * 3, torch.randn(3, 5, generator=g)
    entropy, gradient = _entropy_and_gradient(lambda z: F.entropy_from_logits_with_chunking(z, chunk_size),
                                              logits, weights)
    expected, expected_gradient = _entropy_and_gradient(
        lambda z: z.logsumexp(-1) - (torch.softmax(z, -1) * z).sum(-1), logits.double(), weights.double())
    assert entropy.dtype == torch.float32 and gradient.dtype == torch.float32
    assert torch.allclose(entropy.double(), expected, atol=1e-6)
    assert torch.allclose(gradient.double(), expected_gradient, atol=1e-6)
    assert expected_gradient.abs().max() > 0.1  # a gradient that is there to get wrong


def _saved_for_backward(entropy_fn, logits):
    """Shapes of the tensors the autograd graph of entropy_fn(logits) keeps for backward."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tuple(tensor.shape)) or tensor,
                                                  lambda tensor: tensor):
        entropy_fn(logits.clone().requires_grad_(True))
    return saved


@pytest.mark.parametrize("with_chunking", [False, True])
def test_entropy_checkpointing_gives_the_same_gradient(with_chunking):
    """verl's entropy_checkpointing: the graph between the logits and the entropy is recomputed in backward; the
    gradient is the same, and so are the numbers without a gradient (nothing is checkpointed then)."""
    g = torch.Generator().manual_seed(6)
    logits, weights = torch.randn(4, 7, 13, generator=g) * 2, torch.randn(4, 7, generator=g)
    plain = F.entropy_function(with_chunking=with_chunking, checkpointing=False)
    checkpointed = F.entropy_function(with_chunking=with_chunking, checkpointing=True)
    entropy, gradient = _entropy_and_gradient(plain, logits, weights)
    checkpointed_entropy, checkpointed_gradient = _entropy_and_gradient(checkpointed, logits, weights)
    assert torch.allclose(checkpointed_entropy, entropy, atol=1e-6)
    assert torch.allclose(checkpointed_gradient, gradient, atol=1e-6)
    assert gradient.abs().max() > 0.1
    with torch.no_grad():
        assert torch.allclose(checkpointed(logits), entropy, atol=1e-6)


def test_only_the_plain_entropy_keeps_a_softmax_of_every_row_for_backward():
    """What each setting's graph holds: the plain entropy keeps the softmax and its product with the logits (28 rows
    of 13); chunking and checkpointing each keep only the logits themselves."""
    logits = torch.randn(4, 7, 13)
    saved = {(chunking, checkpointing): _saved_for_backward(F.entropy_function(chunking, checkpointing), logits)
             for chunking in (False, True) for checkpointing in (False, True)}
    assert saved[False, False].count((28, 13)) >= 3
    assert saved[True, False] == saved[False, True] == saved[True, True] == [(4, 7, 13)]
