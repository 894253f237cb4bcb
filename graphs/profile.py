"""The measured inputs of the ladder planner (:mod:`graphs.planner`): traffic, step costs, memory.

Traffic: a :class:`BatchProfile` counts live decode batch sizes and live prefill ``(tokens, requests)``
pairs, whichever path (replay or eager) ran them; :mod:`graphs.planner` turns it into bucket
ladders. It is plain dict counters, cheap enough to record on every step, and saves as JSON::

    {"version": 1, "decode": {"3": 120, "37": 80}, "prefill": {"512,2": 10}}

Decode keys are batch sizes; prefill keys are ``"tokens,requests"``; values are step counts.

Step costs: :class:`StepCosts`, seconds of an eager forward and of a replay as functions of size.
Memory: :class:`MemoryModel`, the bytes a ladder keeps resident in the shared graph pool.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
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

    def copy(self) -> BatchProfile:
        """An independent copy (counts as of now)."""
        out = BatchProfile()
        out.decode, out.prefill = dict(self.decode), dict(self.prefill)
        return out

    def since(self, earlier: BatchProfile) -> BatchProfile:
        """The steps recorded after ``earlier`` (a :meth:`copy` of this profile taken before)."""
        out = BatchProfile()
        out.decode = {n: c - earlier.decode.get(n, 0) for n, c in self.decode.items() if c > earlier.decode.get(n, 0)}
        out.prefill = {k: c - earlier.prefill.get(k, 0) for k, c in self.prefill.items()
                       if c > earlier.prefill.get(k, 0)}
        return out

    @property
    def decode_steps(self) -> int:
        """Decode steps recorded."""
        return sum(self.decode.values())

    @property
    def prefill_steps(self) -> int:
        """Prefill steps recorded."""
        return sum(self.prefill.values())

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


@dataclass(frozen=True)
class PiecewiseLinear:
    """Seconds as a piecewise-linear function of size through measured points.

    Interpolates between measured sizes, extrapolates with the slope of the nearest end segment
    and never returns less than 0 s. One point gives a constant.
    """

    sizes: tuple[float, ...]
    seconds: tuple[float, ...]

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float]]) -> PiecewiseLinear:
        """Fit (size, seconds) samples; repeated sizes are averaged."""
        by_size: dict[float, list[float]] = defaultdict(list)
        for size, seconds in samples:
            if not size > 0 or not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"cost sample needs size > 0 and finite seconds >= 0, got ({size}, {seconds})")
            by_size[size].append(seconds)
        if not by_size:
            raise ValueError("a cost model needs at least one (size, seconds) sample")
        xs = sorted(by_size)
        return cls(tuple(xs), tuple(sum(by_size[x]) / len(by_size[x]) for x in xs))

    def __call__(self, size: float) -> float:
        xs, ys = self.sizes, self.seconds
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect.bisect_left(xs, size), 1), len(xs) - 1)
        return max(0.0, ys[i - 1] + (size - xs[i - 1]) * (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1]))


@dataclass(frozen=True)
class StepCosts:
    """One phase's step costs in seconds per forward (wall time of the step on the device).

    ``eager(size)``: an eager forward of ``size`` live rows (decode) or tokens (prefill).
    ``replay(bucket)``: loading and replaying the captured shape ``bucket``, i.e. at padded size.
    Any callables work; :meth:`fit` builds piecewise-linear ones from measurements.
    """

    eager: Callable[[int], float]
    replay: Callable[[int], float]

    @classmethod
    def fit(cls, eager: Iterable[tuple[int, float]], replay: Iterable[tuple[int, float]]) -> StepCosts:
        """From measured (size, seconds) pairs of eager forwards and of replays."""
        return cls(PiecewiseLinear.fit(eager), PiecewiseLinear.fit(replay))


@dataclass(frozen=True)
class MemoryModel:
    """Bytes a ladder of captured shapes keeps resident in the shared graph pool.

    ``shape_bytes(size)`` interpolates linearly between two shapes each captured alone into an
    empty pool (a small one and the largest). Every shape of the process shares one pool and
    capture runs largest first, so the scratch of smaller graphs reuses blocks the largest one
    already reserved; each further graph keeps only its exec and small private allocations,
    ``per_graph_overhead_bytes``. Hence ``ladder_bytes = shape_bytes(max) + overhead * (len - 1)``
    (graphs/DESIGN.md: 35 decode shapes measured at 1.02x the largest alone). Swap the model by
    subclassing and overriding :meth:`ladder_bytes`; the planner is exact for any model that
    depends only on the largest kept bucket and the count, non-decreasing in the count.
    (:func:`graphs.planner.joint_bytes` uses ``shape_bytes`` and ``per_graph_overhead_bytes``.)
    """

    small_size: int
    small_bytes: int
    large_size: int
    large_bytes: int
    per_graph_overhead_bytes: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.small_size <= self.large_size:
            raise ValueError(f"need 1 <= small_size <= large_size, got {self.small_size}, {self.large_size}")
        if min(self.small_bytes, self.large_bytes, self.per_graph_overhead_bytes) < 0:
            raise ValueError("memory measurements must be >= 0 bytes")

    def shape_bytes(self, size: int) -> int:
        """Bytes of one shape captured alone (linear through the two measurements, >= 0)."""
        if self.large_size == self.small_size:
            return self.large_bytes
        rise = (self.large_bytes - self.small_bytes) * (size - self.small_size)
        return max(0, self.small_bytes - (-rise // (self.large_size - self.small_size)))  # exact ceiling

    def ladder_bytes(self, ladder: Sequence[int]) -> int:
        """Modelled resident bytes of ``ladder`` captured into one pool (0 for an empty ladder)."""
        if not ladder:
            return 0
        return self.shape_bytes(max(ladder)) + self.per_graph_overhead_bytes * (len(ladder) - 1)
