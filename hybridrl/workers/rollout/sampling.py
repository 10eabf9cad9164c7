"""Which sampling settings one generate call uses: the rollout's own, `val_kwargs` when validating, and over those
a named eval set's own settings (`meta_info["sampling_overrides"]`, trainer/ppo/evaluation.py).

The overrides may hold temperature, top_p, top_k and max_tokens (at most rollout.response_length: responses
keep the rollout's padded layout, they only stop earlier). Without overrides every engine samples exactly as
before. `do_sample` keeps coming from meta_info["do_sample"], as it always has.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

SAMPLING_OVERRIDES = "sampling_overrides"
OVERRIDABLE = ("temperature", "top_p", "top_k", "max_tokens")


def _overrides(meta_info: dict) -> dict[str, Any]:
    overrides = meta_info.get(SAMPLING_OVERRIDES) or {}
    unknown = sorted(set(overrides) - set(OVERRIDABLE))
    if unknown:
        raise ValueError(f"meta_info[{SAMPLING_OVERRIDES!r}] has unknown keys {unknown}; allowed: {list(OVERRIDABLE)}")
    return overrides


def sampling_source(config, meta_info: dict):
    """An object with temperature, top_p, top_k and do_sample: val_kwargs when validating, else the rollout
    config, with the call's overrides on top."""
    base = config.val_kwargs if meta_info.get("validate", False) else config
    overrides = _overrides(meta_info)
    if not overrides:
        return base
    return SimpleNamespace(temperature=overrides.get("temperature", base.temperature),
                           top_p=overrides.get("top_p", base.top_p), top_k=overrides.get("top_k", base.top_k),
                           do_sample=base.do_sample)


def max_new_tokens(config, meta_info: dict) -> int:
    """Tokens a response may have in this call: the override's max_tokens, else rollout.response_length."""
    limit = _overrides(meta_info).get("max_tokens")
    if limit is None:
        return config.response_length
    if not 0 < int(limit) <= config.response_length:
        raise ValueError(f"sampling override max_tokens={limit}: expected 1..rollout.response_length="
                         f"{config.response_length}")
    return int(limit)
