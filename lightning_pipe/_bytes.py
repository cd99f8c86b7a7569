"""Sizes in bytes as people write them (``"16GiB"``, ``"5GB"``) and as the package prints them: one reading for
``max_memory``, the planner and ``max_shard_size``."""

from __future__ import annotations

import re
from typing import Union

__all__ = ["format_bytes", "parse_bytes"]


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_bytes(text: Union[str, float, int]) -> int:
    """``"16GiB"`` -> 17179869184. Units: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB and K/M/G/T (of 1024)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"Cannot read {text!r} as a size in bytes; write e.g. '16GiB', '512MB' or '1e9'.")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
    """``17179869184`` -> ``"16.00 GiB"``."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
