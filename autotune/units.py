"""Byte sizes: parse a user's budget, print sizes for people."""

from __future__ import annotations

import math
import re

from autotune.errors import UserError

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
#: sane bounds for a per-device budget: below one MiB nothing trains (and a budget that rounds
#: to zero bytes divides by zero), above one PiB it is a typo
MIN_BUDGET = 2**20
MAX_BUDGET = 2**50
#: ASCII only: ``\d`` would take full-width and other scripts' digits, which float() reads
_PATTERN = re.compile(
    r"^\s*([-+]?\d+(?:\.\d+)?|[-+]?\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE | re.ASCII
)


def parse_size(text: str) -> int:
    """``24GB`` is 24*10^9 bytes, ``24GiB`` 24*2^30; case-insensitive; must be positive."""
    match = _PATTERN.match(str(text))
    unit = match.group(2).upper() if match else ""
    if not match or not unit or unit not in _UNITS:
        raise UserError(
            f"invalid budget '{text}': use a number and a unit, e.g. 24GB, 24GiB, 500MB, 1.5GiB"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise UserError(f"invalid budget '{text}': it must be greater than zero")
    if not math.isfinite(value) or value > MAX_BUDGET:
        raise UserError(f"invalid budget '{text}': more than {format_size(MAX_BUDGET)} per device")
    if value < MIN_BUDGET:
        raise UserError(
            f"invalid budget '{text}': under {format_size(MIN_BUDGET)}, no model trains in it"
        )
    return int(value)


def format_size(n: float | None) -> str:
    """Binary units, three significant digits: ``1.50 GiB``, ``300 MiB``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(value)} B"
            # three significant digits, never scientific notation (1010 MiB, not 1.01e+03)
            return f"{value:.0f} {unit}" if abs(value) >= 1000 else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def budget_label(text: str) -> str:
    """A budget as typed, normalised for a study name: ``24gb`` -> ``24GB``."""
    match = _PATTERN.match(text)
    assert match
    unit = match.group(2).upper().replace("IB", "iB")
    return f"{match.group(1)}{unit}"
