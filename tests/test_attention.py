"""models/attention.py on the CPU: the NaN-safe padded mask and the varlen routing of packed rows (fp32, tiny Qwen2).

The varlen kernel itself is PyTorch's flash kernel, CUDA only: here it is replaced by a reference
that runs causal sdpa on each sequence separately, which checks everything around the kernel (the
sequence boundaries from forward_packed and from position_ids, the layout, the fall-through to sdpa).
tests/gpu/test_attention_gpu.py runs the real kernel against the padded forward.
"""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.masking_utils import sdpa_mask

from hybridrl.models import attention
from hybridrl.models.attention import (VARLEN, attention_implementation, cu_seqlens_from_positions,
                                       padded_attention_mask)
from hybridrl.models.padding import response_log_probs_packed
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.algorithms.torch_functional import logprobs_from_logits
from test_padding import RESPONSE_WIDTH, actor_batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tokenizer = build_tokenizer(["what is 12 + 30 ? the answer is 42 so"] * 10, vocab_size=300)
    return build_tiny_model(str(tmp_path_factory.mktemp("attn") / "qwen2"), tokenizer, arch="qwen2", hidden_size=32,
                            num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def test_padded_mask_gives_every_row_a_key_and_keeps_real_rows():
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    mask = padded_attention_mask(attention_mask)
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    assert mask.any(dim=-1).all()  # no query row is empty: the cause of the NaN backward
    # the left-padding queries (row 0, positions 0 and 1) attend to themselves only
    assert mask[0, 0, 0].tolist() == [True, False, False, False, False, False]
    assert mask[0, 0, 1].tolist() == [False, True, False, False, False, False]
    # a real token attends to the real tokens up to itself, exactly as transformers' own mask says
    reference = sdpa_mask(batch_size=2, q_length=6, kv_length=6, attention_mask=attention_mask.bool(),
                          allow_is_causal_skip=False)
    empty = ~reference[:, 0].any(dim=-1)
    assert empty.tolist() == [[True, True, False, False, False, False], [False] * 6]
    assert torch.equal(mask[:, 0][~empty], reference[:, 0][~empty])  # every other row is transformers' own


def test_padded_mask_forward_equals_the_two_d_mask_forward(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    batch = actor_batch(model.config.vocab_size)
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    with torch.no_grad():
        two_d = model(attention_mask=batch["attention_mask"], **inputs).logits
        four_d = model(attention_mask=padded_attention_mask(batch["attention_mask"]), **inputs).logits
    has_key = batch["attention_mask"].cumsum(-1) > 0  # all but the left padding
    torch.testing.assert_close(four_d[has_key], two_d[has_key], atol=1e-5, rtol=0)


def reference_kernel(calls):
    """Causal sdpa per sequence: what the flash varlen kernel computes. Records the boundaries it was given."""
    def kernel(query, key, value, cu_seqlens, max_seqlen, scale):
        calls.append((cu_seqlens.tolist(), max_seqlen))
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        outputs = []
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            q, k, v = (tensor[start:end].transpose(0, 1) for tensor in (query, key, value))
            outputs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1))
        return torch.cat(outputs)
    return kernel


@pytest.fixture
def varlen_model(model_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "varlen_kernel", lambda: reference_kernel(calls))
    attention.register()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=VARLEN)
    return model, calls


def test_packed_rows_go_to_the_varlen_kernel_with_their_boundaries(model_dir, varlen_model):
    model, calls = varlen_model
    sdpa_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    batch = actor_batch(model.config.vocab_size)
    inputs = [batch[key] for key in ("input_ids", "attention_mask", "position_ids", "responses")]
    with torch.no_grad():
        packed, _ = response_log_probs_packed(model, *inputs, 0.7)
        padded_logits = sdpa_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                   position_ids=batch["position_ids"], use_cache=False).logits
    padded = logprobs_from_logits(padded_logits[:, -RESPONSE_WIDTH - 1:-1] / 0.7, batch["responses"])
    lengths = batch["attention_mask"].sum(-1).tolist()  # [7, 13, 1, 7]
    expected_cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    assert calls == [(expected_cu, max(lengths))] * model.config.num_hidden_layers
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)


def test_varlen_reads_boundaries_from_position_ids_and_passes_padded_calls_to_sdpa(model_dir, varlen_model):
    model, calls = varlen_model
    sdpa_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits  # no cu_seq_lens given
        first = sdpa_model(input_ids=ids[:, :3], use_cache=False).logits
        second = sdpa_model(input_ids=ids[:, 3:], use_cache=False).logits
    assert calls[0] == ([0, 3, 6], 3)
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), atol=1e-5, rtol=0)

    calls.clear()
    batch = actor_batch(model.config.vocab_size)
    with torch.no_grad():
        through_varlen_model = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                     position_ids=batch["position_ids"], use_cache=False).logits
        plain = sdpa_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"], use_cache=False).logits
    assert calls == []  # a padded batch never reaches the varlen kernel
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(through_varlen_model[real], plain[real], atol=1e-6, rtol=0)


def test_cu_seqlens_and_the_implementation_choice():
    assert cu_seqlens_from_positions(torch.tensor([0, 1, 2, 0, 1, 0])).tolist() == [0, 3, 5, 6]
    assert attention_implementation("cpu", packed=True) == "sdpa"
    assert attention_implementation("cuda", packed=False) == "sdpa"
    assert attention_implementation("cuda", packed=True) in (VARLEN, "flash_attention_2")
