"""to_batch_layout: ragged engine outputs -> the trainer's padded batch, checked against hand-made tensors."""
import pytest
import torch

from hybridrl.data.batch_layout import WEIGHT_VERSIONS_KEY, last_one, spans_versions, staleness, to_batch_layout

PAD = 0


def test_two_rows_padded_by_hand():
    out = to_batch_layout([[5, 6], [7, 8, 9]], [[11], [12, 13, 14]], prompt_length=4, response_length=3,
                          pad_token_id=PAD)
    b = out.batch
    assert torch.equal(b["prompts"], torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9]]))
    assert torch.equal(b["responses"], torch.tensor([[11, 0, 0], [12, 13, 14]]))
    assert torch.equal(b["input_ids"], torch.tensor([[0, 0, 5, 6, 11, 0, 0], [0, 7, 8, 9, 12, 13, 14]]))
    assert torch.equal(b["attention_mask"], torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]]))
    assert torch.equal(b["position_ids"], torch.tensor([[0, 0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 3, 4, 5]]))
    assert torch.equal(b["response_mask"], torch.tensor([[1, 0, 0], [1, 1, 1]]))
    assert "rollout_log_probs" not in b.keys()
    assert all(b[key].dtype == torch.long for key in b.keys())


def test_mask_holes_keep_attention_and_log_probs_are_zero_at_padding():
    out = to_batch_layout([[5]], [[21, 22, 23, 24]], prompt_length=2, response_length=6, pad_token_id=PAD,
                          response_mask=[[1, 0, 0, 1]], response_logprobs=[[-0.5, -1.0, -1.5, -2.0]])
    b = out.batch
    assert torch.equal(b["responses"], torch.tensor([[21, 22, 23, 24, 0, 0]]))
    assert torch.equal(b["response_mask"], torch.tensor([[1, 0, 0, 1, 0, 0]]))
    assert torch.equal(b["attention_mask"], torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0]]))
    assert torch.equal(b["position_ids"], torch.tensor([[0, 0, 1, 2, 3, 4, 5, 6]]))
    assert b["rollout_log_probs"].dtype == torch.float32
    assert torch.equal(b["rollout_log_probs"], torch.tensor([[-0.5, -1.0, -1.5, -2.0, 0.0, 0.0]]))


def test_empty_response_and_nonzero_pad_id():
    out = to_batch_layout([[5, 6]], [[]], prompt_length=3, response_length=2, pad_token_id=99)
    b = out.batch
    assert torch.equal(b["input_ids"], torch.tensor([[99, 5, 6, 99, 99]]))
    assert torch.equal(b["attention_mask"], torch.tensor([[0, 1, 1, 0, 0]]))
    assert torch.equal(b["response_mask"], torch.tensor([[0, 0]]))


@pytest.mark.parametrize("prompts, responses, message", [
    ([[1], [1, 2, 3, 4]], [[1], [1]], r"prompt of row 1 has 4 tokens, more than prompt_length=3"),
    ([[1], [1]], [[1, 2, 3], [1]], r"response of row 0 has 3 tokens, more than response_length=2"),
    ([[1], []], [[1], [1]], r"prompt of row 1 is empty"),
    ([[1], [1]], [[1]], r"response_ids has 1 rows, prompt_ids has 2"),
])
def test_too_long_rows_are_errors_naming_the_row(prompts, responses, message):
    with pytest.raises(ValueError, match=message):
        to_batch_layout(prompts, responses, prompt_length=3, response_length=2, pad_token_id=PAD)


def test_a_mask_row_must_match_its_response():
    with pytest.raises(ValueError, match=r"response_mask of row 0 has 1 entries, its response has 2 tokens"):
        to_batch_layout([[1]], [[3, 4]], prompt_length=2, response_length=2, pad_token_id=PAD,
                        response_mask=[[1]])


def test_weight_versions_column_and_the_staleness_measures_built_on_it():
    out = to_batch_layout([[5], [6], [7]], [[11, 12, 13], [14], [15, 16]], prompt_length=2, response_length=4,
                          pad_token_id=PAD, weight_versions=[[2, 2, 3], [3], [-1, -1]])  # row 2: no engine tokens
    versions = out.batch[WEIGHT_VERSIONS_KEY]
    assert versions.tolist() == [[2, 2, 3, -1], [3, -1, -1, -1], [-1, -1, -1, -1]]
    assert staleness(versions, current_version=4).tolist() == [2, 1]  # rows with generated tokens only
    assert spans_versions(versions).tolist() == [True, False, False]
    assert WEIGHT_VERSIONS_KEY not in to_batch_layout([[5]], [[11]], prompt_length=1, response_length=1,
                                                      pad_token_id=PAD).batch.keys()
    with pytest.raises(ValueError, match="weight_versions of row 0 has 1 entries, its response has 2 tokens"):
        to_batch_layout([[5]], [[11, 12]], prompt_length=1, response_length=2, pad_token_id=PAD,
                        weight_versions=[[0]])


def test_last_one_is_each_rows_last_set_position_or_minus_one():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert last_one(mask).tolist() == [1, 2, -1, 3]  # a hole does not end the row; an empty row has none
    assert last_one(mask.bool()).tolist() == [1, 2, -1, 3]
