"""Byte sizes as people write them: `16GiB`, `16GB`, `16G`, `17179869184`."""
from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """`16GiB` -> 17179869184. Bare K/M/G/T are binary (as nvidia-smi means them); KB/MB/GB/TB are
    decimal (as GPU datasheets mean them). Raises ValueError naming the text when it is not a size."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = _SIZE.match(str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{text!r} is not a size; write e.g. 16GiB, 16GB or 17179869184")
        value, unit = float(match.group(1)), match.group(2).lower()
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return size


def format_bytes(n: float | None) -> str:
    """1536 -> '1.50 KiB'; None -> '-'."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
