"""Cut a tool's text to a length, verl's way (multi_turn.tool_response_truncate_side).

side "left" keeps the start, "right" keeps the end, "middle" keeps both ends (half each) — for
code output, middle keeps the first lines and the final traceback. A marker says text was cut.
"""
from __future__ import annotations

TRUNCATE_SIDES = ("left", "middle", "right")


def truncate_text(text: str, max_length: int, side: str = "middle") -> str:
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate side must be one of {list(TRUNCATE_SIDES)}, got {side!r}")
    if max_length <= 0:
        raise ValueError(f"max_length must be positive, got {max_length}")
    if len(text) <= max_length:
        return text
    if side == "left":
        return text[:max_length] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-max_length:]
    half = max_length // 2
    return text[:half] + "...(truncated)..." + text[len(text) - (max_length - half):]
