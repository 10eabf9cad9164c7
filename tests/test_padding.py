"""Remove padding: the packed forward of real tiny Qwen2 / Llama models equals the padded forward (fp32, CPU).

The batches use the actor's real layout: input_ids = left-padded prompt + right-padded response,
position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0).
"""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from hybridrl.models.padding import (pad_output, response_log_probs_packed, response_values_packed, unpad_input)
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.algorithms.torch_functional import entropy_from_logits, logprobs_from_logits

PROMPT_LENGTHS = [3, 7, 1, 5]    # attended prompt tokens per row, left-padded to 7
RESPONSE_LENGTHS = [4, 6, 0, 2]  # attended response tokens per row, right-padded to 6 (row 2: empty answer)
PROMPT_WIDTH, RESPONSE_WIDTH = 7, 6
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("padding_models")
    tokenizer = build_tokenizer(["what is 12 + 30 ? the answer is 42 so"] * 10, vocab_size=300)
    return {arch: build_tiny_model(str(root / arch), tokenizer, arch=arch, hidden_size=32, num_layers=2,
                                   num_heads=4, num_kv_heads=2, intermediate_size=64)
            for arch in ("qwen2", "llama")}


def actor_batch(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Prompts left-padded, responses right-padded, with the attention mask and position_ids the trainer builds."""
    generator = torch.Generator().manual_seed(seed)
    rows = len(PROMPT_LENGTHS)
    prompt_mask = torch.zeros(rows, PROMPT_WIDTH, dtype=torch.long)
    response_mask = torch.zeros(rows, RESPONSE_WIDTH, dtype=torch.long)
    for row, (prompt_len, response_len) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)):
        prompt_mask[row, PROMPT_WIDTH - prompt_len:] = 1
        response_mask[row, :response_len] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    input_ids = torch.randint(4, vocab_size, attention_mask.shape, generator=generator) * attention_mask
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, PROMPT_WIDTH:], "response_mask": response_mask}


def padded_response_outputs(model, batch):
    """The padded path, as the actor and critic run it without use_remove_padding."""
    output = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False)
    return output.logits[:, -RESPONSE_WIDTH - 1:-1]


def test_unpad_input_and_pad_output_on_a_hand_example():
    input_ids = torch.tensor([[0, 0, 11, 12], [21, 22, 23, 0]])
    attention_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])
    position_ids = torch.tensor([[0, 0, 0, 1], [0, 1, 2, 2]])
    packed = unpad_input(input_ids, attention_mask, position_ids)
    assert packed.input_ids.tolist() == [[11, 12, 21, 22, 23]]
    assert packed.position_ids.tolist() == [[0, 1, 0, 1, 2]]
    assert packed.indices.tolist() == [2, 3, 4, 5, 6]
    assert packed.cu_seqlens.tolist() == [0, 2, 5] and packed.cu_seqlens.dtype == torch.int32
    assert packed.max_seqlen == 3
    ids, positions, indices, cu_seqlens, max_seqlen = packed  # also a plain tuple, in the brief's order
    assert max_seqlen == 3
    features = torch.stack([ids[0], ids[0] * 10], dim=-1).float()  # (nnz, 2): repad keeps trailing dims
    repadded = pad_output(features, indices, batch_size=2, seqlen=4)
    assert repadded[..., 0].tolist() == (input_ids * attention_mask).float().tolist()
    assert repadded[..., 1].tolist() == (input_ids * attention_mask * 10).float().tolist()


def test_pad_output_passes_gradients_to_the_packed_rows():
    packed = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    pad_output(packed, torch.tensor([1, 2, 4]), batch_size=2, seqlen=3).pow(2).sum().backward()
    assert packed.grad.tolist() == [2.0, 4.0, 6.0]


def test_unpad_input_rejects_positions_that_would_merge_sequences():
    input_ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    attention_mask = torch.ones(2, 3, dtype=torch.long)
    continuing = torch.tensor([[0, 1, 2], [3, 4, 5]])  # row 1 continues row 0's numbering: no boundary seen
    with pytest.raises(ValueError, match=r"row 1's position_ids at its attended tokens are \[3, 4, 5\], expected"):
        unpad_input(input_ids, attention_mask, continuing)


def test_response_after_a_padding_gap_is_refused():
    attention_mask = torch.tensor([[1, 1, 0, 1, 0]])  # prompt ends in padding, then a response token
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with pytest.raises(ValueError, match="row 0: response token 0 follows a padding position"):
        response_log_probs_packed(lambda **_: None, torch.zeros_like(attention_mask), attention_mask, position_ids,
                                  torch.zeros(1, 2, dtype=torch.long), temperature=1.0)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_log_probs_and_entropy_equal_the_padded_forward(model_dirs, arch, attn_implementation):
    model = AutoModelForCausalLM.from_pretrained(model_dirs[arch], attn_implementation=attn_implementation,
                                                 dtype=torch.float32).eval()
    batch = actor_batch(model.config.vocab_size)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        logits = padded_response_outputs(model, batch) / TEMPERATURE
        expected_log_probs = logprobs_from_logits(logits, batch["responses"])
        expected_entropy = entropy_from_logits(logits)
        log_probs, entropy = response_log_probs_packed(
            model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["responses"],
            TEMPERATURE, calculate_entropy=True)
    assert log_probs.shape == entropy.shape == (len(PROMPT_LENGTHS), RESPONSE_WIDTH)
    assert mask.sum() == sum(RESPONSE_LENGTHS)
    torch.testing.assert_close(log_probs[mask], expected_log_probs[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy[mask], expected_entropy[mask], rtol=0, atol=1e-5)
    assert log_probs[~mask].abs().sum() == 0 and entropy[~mask].abs().sum() == 0  # padding answers 0
    assert log_probs[mask].max() < 0  # real log-probs of a random model, not zeros


def test_packed_gradients_equal_the_padded_forward(model_dirs):
    """Training through the packed path moves the weights exactly as the padded path would."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"], dtype=torch.float32)
    batch = actor_batch(model.config.vocab_size, seed=1)
    mask = batch["response_mask"].bool()

    def gradients(log_probs):
        model.zero_grad()
        log_probs[mask].mean().backward()
        return {name: param.grad.clone() for name, param in model.named_parameters()}

    padded = gradients(logprobs_from_logits(padded_response_outputs(model, batch) / TEMPERATURE, batch["responses"]))
    packed = gradients(response_log_probs_packed(model, batch["input_ids"], batch["attention_mask"],
                                                 batch["position_ids"], batch["responses"], TEMPERATURE)[0])
    assert sum(grad.abs().sum() for grad in padded.values()) > 0
    for name in padded:
        torch.testing.assert_close(packed[name], padded[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_values_equal_the_padded_forward(model_dirs, arch):
    config = AutoConfig.from_pretrained(model_dirs[arch], num_labels=1)
    torch.manual_seed(0)  # the value head is freshly initialised
    critic = AutoModelForTokenClassification.from_pretrained(model_dirs[arch], config=config,
                                                             attn_implementation="sdpa", dtype=torch.float32).eval()
    batch = actor_batch(config.vocab_size, seed=2)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        expected = padded_response_outputs(critic, batch)[..., 0]
        values = response_values_packed(critic, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                        RESPONSE_WIDTH)
    assert values.shape == (len(PROMPT_LENGTHS), RESPONSE_WIDTH)
    torch.testing.assert_close(values[mask], expected[mask], rtol=0, atol=1e-5)
    assert values[~mask].abs().sum() == 0
    assert values[mask].std() > 0
