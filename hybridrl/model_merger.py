"""Turn a sharded actor checkpoint into a Hugging Face model directory.

    python -m hybridrl.model_merger --local_dir checkpoints/p/e/global_step_N/actor --target_dir out/

The checkpoint's ``model/`` directory (torch.distributed.checkpoint shards from any world size) is read into full
tensors on one CPU process, written as safetensors next to the config, tokenizer and generation config from
``actor/huggingface/``, so ``AutoModelForCausalLM.from_pretrained(out)`` loads it. Memory: one full copy of the
weights in CPU RAM; no torch.distributed group is needed.

Weights keep the dtype they were trained in (fp32 master weights under FSDP), so the exported model's logits
equal the trained model's; ``--dtype bfloat16`` casts them for a smaller export. LoRA checkpoints are not handled
yet (``--lora_mode merge|adapter`` is future work): they are refused with a message.
"""
from __future__ import annotations

import argparse
import os
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from huggingface_hub import save_torch_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hybridrl.models.checkpoint import HF_SUBDIR

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_full_model_state(model_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of a DCP model directory as full CPU tensors, keyed by parameter name."""
    metadata = dcp.FileSystemReader(model_dir).read_metadata()
    state: dict[str, torch.Tensor] = {}
    for name, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise ValueError(f"{model_dir}: entry {name!r} is not a tensor ({type(item).__name__}); "
                             "expected a model state dict written by save_sharded_model_state")
        state[name] = torch.empty(item.size, dtype=item.properties.dtype)
    with warnings.catch_warnings():  # DCP warns that no process group exists: here that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=model_dir, no_dist=True)
    return state


def merge_to_hf(local_dir: str, target_dir: str, dtype: str | None = None) -> None:
    """Write ``target_dir``: HF files from ``local_dir/huggingface`` plus the merged weights as safetensors."""
    hf_dir = os.path.join(local_dir, HF_SUBDIR)
    model_dir = os.path.join(local_dir, "model")
    for needed in (hf_dir, model_dir):
        if not os.path.isdir(needed):
            raise FileNotFoundError(f"{needed} is missing: --local_dir must be a global_step_N/actor directory "
                                    "saved with 'model' in checkpoint.save_contents and its huggingface/ files")
    state = load_full_model_state(model_dir)
    lora_keys = [name for name in state if "lora_" in name]
    if lora_keys:
        raise NotImplementedError(f"{model_dir} holds LoRA weights (e.g. {lora_keys[0]!r}); merging LoRA "
                                  "checkpoints (--lora_mode merge|adapter) is not implemented yet")
    if dtype is not None:
        state = {name: tensor.to(DTYPES[dtype]) for name, tensor in state.items()}
    shutil.copytree(hf_dir, target_dir, dirs_exist_ok=True)
    _set_config_dtype(target_dir, next(iter(state.values())).dtype)
    save_torch_state_dict(state, target_dir, safe_serialization=True)


def _set_config_dtype(target_dir: str, dtype: torch.dtype) -> None:
    """Make config.json name the dtype actually written, so dtype="auto" loading gives the exported weights."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(target_dir)
    config.dtype = dtype
    config.save_pretrained(target_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--local_dir", required=True, help="a checkpoint's global_step_N/actor directory")
    parser.add_argument("--target_dir", required=True, help="where to write the Hugging Face model")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="cast the weights (default: keep the dtype they were saved in)")
    args = parser.parse_args(argv)
    merge_to_hf(args.local_dir, args.target_dir, args.dtype)
    print(f"wrote a Hugging Face model to {args.target_dir}")


if __name__ == "__main__":
    main()
