"""Value checks for the ``__post_init__`` of config sections.

Each raises :class:`~configkit.errors.ConfigError` keyed by the field name alone; the builder
(:func:`configkit.typed.build`) moves the key under the section's path.
"""

from __future__ import annotations

import re
from fractions import Fraction

from configkit.errors import ConfigError


def check(ok: bool, key: str, reason: str) -> None:
    """Raise ``ConfigError(reason, key=key)`` unless ``ok``."""
    # Written as `not ok` so that NaN, which fails every comparison, is rejected too.
    if not ok:
        raise ConfigError(reason, key=key)


def check_min(value: int | float | None, key: str, minimum: int) -> None:
    """``value`` (when not None) is at least ``minimum``."""
    if value is not None:
        check(value >= minimum, key, f"must be >= {minimum}, got {value!r}")


def check_ladder(values: tuple[int, ...] | None, key: str) -> None:
    """``values`` (when not None) is a non-empty, strictly increasing sequence of positive ints."""
    if values is not None:
        ok = len(values) > 0 and values[0] >= 1 and all(a < b for a, b in zip(values, values[1:]))
        check(ok, key, f"must be a non-empty, strictly increasing list of positive integers, got {list(values)}")


_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}
_BYTES_RE = re.compile(r"\s*((?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(value: int | str) -> int:
    """Parse a byte size: ``4GiB``, ``512MB``, ``1.5 gib``, ``1048576`` (or an int) -> bytes.

    Units are case-insensitive; KB/MB/GB/TB (and K/M/G/T) are powers of 1000, KiB/MiB/GiB/TiB
    (and Ki/Mi/Gi/Ti) powers of 1024. Fractions of a byte are truncated. Raises ``ValueError``.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"byte size must be >= 0, got {value}")
        return value
    match = _BYTES_RE.fullmatch(value) if isinstance(value, str) else None
    if match is None or match[2].lower() not in _BYTE_UNITS:
        raise ValueError(f"invalid byte size {value!r}; expected e.g. 4GiB, 512MB or 1048576")
    return int(Fraction(match[1]) * _BYTE_UNITS[match[2].lower()])
