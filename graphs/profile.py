"""Traffic profiles: histograms of the live batch shapes a worker actually ran.

A :class:`BatchProfile` counts live decode batch sizes and live prefill ``(tokens, requests)``
pairs, whichever path (replay or eager) ran them; :mod:`graphs.planner` turns it into bucket
ladders. It is plain dict counters, cheap enough to record on every step, and saves as JSON::

    {"version": 1, "decode": {"3": 120, "37": 80}, "prefill": {"512,2": 10}}

Decode keys are batch sizes; prefill keys are ``"tokens,requests"``; values are step counts.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

VERSION = 1
_INT = re.compile(r"[0-9]+")


class ProfileError(ValueError):
    """A profile document is malformed; the message names the offending field."""


def _count(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProfileError(f"profile field {field}: count must be an int >= 0, got {value!r}")
    return value


def _size(key: Any, field: str) -> int:
    if isinstance(key, int) and not isinstance(key, bool):
        n = key
    elif isinstance(key, str) and _INT.fullmatch(key.strip()):
        n = int(key)
    else:
        raise ProfileError(f"profile field {field}: key is not an integer")
    if n < 1:
        raise ProfileError(f"profile field {field}: key must be >= 1, got {n}")
    return n


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an int >= 1, got {value!r}")
    return value


class BatchProfile:
    """Histograms of live decode batch sizes and live prefill ``(tokens, requests)`` pairs."""

    def __init__(self, decode: Mapping[int, int] | None = None,
                 prefill: Mapping[tuple[int, int], int] | None = None) -> None:
        self.decode: dict[int, int] = {}
        self.prefill: dict[tuple[int, int], int] = {}
        for n, c in (decode or {}).items():
            self.record_decode(n, c)
        for (t, r), c in (prefill or {}).items():
            self.record_prefill(t, r, c)

    def record_decode(self, n: int, count: int = 1) -> None:
        """Count ``count`` decode steps whose live batch had ``n`` rows (before padding)."""
        _positive(n, "decode batch size")
        self.decode[n] = self.decode.get(n, 0) + _count(count, "count")

    def record_prefill(self, tokens: int, requests: int, count: int = 1) -> None:
        """Count ``count`` prefill steps of ``tokens`` live tokens from ``requests`` requests."""
        key = (_positive(tokens, "prefill tokens"), _positive(requests, "prefill requests"))
        self.prefill[key] = self.prefill.get(key, 0) + _count(count, "count")

    @property
    def decode_steps(self) -> int:
        """Decode steps recorded."""
        return sum(self.decode.values())

    @property
    def prefill_steps(self) -> int:
        """Prefill steps recorded."""
        return sum(self.prefill.values())

    def merge(self, other: BatchProfile) -> BatchProfile:
        """A new profile with the counts of ``self`` and ``other`` added (e.g. across workers)."""
        merged = BatchProfile(self.decode, self.prefill)
        for n, c in other.decode.items():
            merged.record_decode(n, c)
        for (t, r), c in other.prefill.items():
            merged.record_prefill(t, r, c)
        return merged

    def to_json(self) -> dict:
        """The JSON document (string keys, sorted), ``version`` first."""
        return {
            "version": VERSION,
            "decode": {str(n): self.decode[n] for n in sorted(self.decode)},
            "prefill": {f"{t},{r}": self.prefill[(t, r)] for t, r in sorted(self.prefill)},
        }

    @classmethod
    def from_json(cls, doc: Any) -> BatchProfile:
        """Parse :meth:`to_json` output; :class:`ProfileError` names the first bad field."""
        if not isinstance(doc, Mapping):
            raise ProfileError(f"profile must be a JSON object, got {type(doc).__name__}")
        unknown = sorted(set(doc) - {"version", "decode", "prefill"})
        if unknown:
            raise ProfileError(f"profile field {unknown[0]!r}: unknown field")
        if doc.get("version") != VERSION or isinstance(doc.get("version"), bool):
            raise ProfileError(f"profile field 'version': expected {VERSION}, got {doc.get('version')!r}")
        profile = cls()
        for name in ("decode", "prefill"):
            if not isinstance(doc.get(name, {}), Mapping):
                raise ProfileError(f"profile field {name!r}: expected an object of counts")
        for key, value in doc.get("decode", {}).items():
            field = f"decode[{key!r}]"
            n = _size(key, field)
            profile.decode[n] = profile.decode.get(n, 0) + _count(value, field)
        for key, value in doc.get("prefill", {}).items():
            field = f"prefill[{key!r}]"
            parts = key.split(",") if isinstance(key, str) else None
            if not parts or len(parts) != 2:
                raise ProfileError(f"profile field {field}: key must be 'tokens,requests'")
            pair = (_size(parts[0], field), _size(parts[1], field))
            profile.prefill[pair] = profile.prefill.get(pair, 0) + _count(value, field)
        return profile

    def save(self, path: str | os.PathLike) -> None:
        """Write the JSON document atomically (a temporary file renamed over ``path``)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> BatchProfile:
        """Read a profile written by :meth:`save`; errors name the file and the field."""
        try:
            doc = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ProfileError(f"{path}: not JSON: {e}") from e
        try:
            return cls.from_json(doc)
        except ProfileError as e:
            raise ProfileError(f"{path}: {e}") from e

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BatchProfile):
            return NotImplemented
        return self.decode == other.decode and self.prefill == other.prefill

    def __repr__(self) -> str:
        return f"BatchProfile(decode_steps={self.decode_steps}, prefill_steps={self.prefill_steps})"
