"""The first capture's split limit: how the caching allocator lays a captured forward out in the pool.

``graphs.pool_layout: tuned`` (graphs/DESIGN.md, "How the pool grows"). The CUDA caching allocator
serves a request from the smallest free block that fits and splits it, so a large activation freed
by one layer is carved up by the smaller tensors of the next, and the next large request finds no
run long enough and grows the pool by a segment of its own. Its ``max_split_size_mb`` option stops
that: blocks of at least that many MiB are never split, requests below it never take one, and a
request at or above it takes such a block only when it fits within 20 MiB. Which limit lays a
forward out tightest depends on its tensors' sizes and lifetimes; eager serving must pick one limit
for every shape it will ever run, but a captured shape makes the same requests every time it is
recorded. So a backend's first capture is recorded once per candidate limit into a trial pool of its
own, each trial pool's bytes are read and given back, and the real capture runs under the limit that
held fewest (the allocator's default when none holds fewer). The process's own allocator settings
are back in force for every other allocation before and after.

Hazard: ``max_split_size_mb`` is process-wide while a limited capture runs; an allocation another
thread makes in that window (a step beside a live re-plan's capture) follows the limit too. It
changes where blocks go, never what a tensor holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterable

import torch

from graphs import process

log = logging.getLogger(__name__)

#: Requests of at most this many bytes live in the small pool's own 2 MiB segments.
SMALL_REQUEST = 1 << 20
MIB = 1 << 20
#: The allocator refuses a ``max_split_size_mb`` at or below its 20 MiB large-buffer size.
MIN_SPLIT_MB = 21
#: The settings variables the allocator reads at start (the first set one wins).
SETTINGS_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")

Event = tuple[str, int, int]  # ("alloc" | "free", address, bytes)


def process_settings() -> str:
    """The allocator settings this process started with (its settings variable, or empty)."""
    return next((os.environ[v] for v in SETTINGS_VARIABLES if os.environ.get(v)), "")


def why_not_tuned(settings: str) -> str | None:
    """Why the split limit is left as ``settings`` set it, or None when it may be tuned: the
    operator chose ``max_split_size_mb`` already, or an allocator backend other than the native one
    (whose options these are)."""
    keys = {part.split(":", 1)[0].strip(): part.split(":", 1)[-1].strip() for part in settings.split(",") if part}
    if "max_split_size_mb" in keys:
        return f"the allocator settings set max_split_size_mb:{keys['max_split_size_mb']} already"
    if keys.get("backend", "native") != "native":
        return f"the {keys['backend']} allocator backend has no split limit"
    return None


def candidate_limits_mb(request_bytes: Iterable[int]) -> list[int]:
    """The split limits (whole MiB) worth a trial for a capture that made these requests: for each
    distinct size in whole MiB above 20, the limit that makes requests of that size and larger
    unsplittable blocks of their own, ascending."""
    return sorted({n // MIB for n in request_bytes if n // MIB >= MIN_SPLIT_MB})


def _apply(settings: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed to torch._C._accelerator_* in newer torch
        torch.cuda.memory._set_allocator_settings(settings)


@contextlib.contextmanager
def split_limit(limit_mb: int | None):
    """The caching allocator's ``max_split_size_mb`` at ``limit_mb`` while the body runs, then the
    process's own settings again (a setting they leave out returns to its default). None changes
    nothing. See the module docstring's hazard."""
    if limit_mb is None:
        yield
        return
    own = process_settings()
    _apply(",".join(p for p in (own, f"max_split_size_mb:{limit_mb}") if p))
    try:
        yield
    finally:
        _apply(own)


def _history_enabled() -> bool:
    probe = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    return bool(probe()) if probe is not None else False


def _trace(index: int) -> list[dict]:
    traces = torch.cuda.memory._snapshot()["device_traces"]
    return traces[index] if index < len(traces) else []


@contextlib.contextmanager
def recorded_allocations(device: torch.device, stream: torch.cuda.Stream):
    """Record the allocator's requests on ``stream`` while the body runs: yields a callable that,
    after the body, returns them as ``(kind, address, bytes)`` events (allocations and completed
    frees, in order). Uses the allocator's history (``torch.cuda.memory._record_memory_history``,
    without stack frames); a recording already running is read, not stopped."""
    events: list[Event] = []
    index = device.index if device.index is not None else torch.cuda.current_device()
    running = _history_enabled()
    if not running:
        torch.cuda.memory._record_memory_history("all", context=None, stacks="python", clear_history=True)
    start = len(_trace(index)) if running else 0
    try:
        yield lambda: events
        torch.cuda.synchronize(device)
        kinds = {"alloc": "alloc", "free_completed": "free"}
        events.extend((kinds[e["action"]], e["addr"], e["size"]) for e in _trace(index)[start:]
                      if e.get("action") in kinds and e.get("stream") == stream.cuda_stream)
    finally:
        if not running:
            torch.cuda.memory._record_memory_history(None)


def _trial_bytes(device: torch.device, capture_into: Callable[[tuple], Callable[[], None]],
                 limit_mb: int | None) -> int:
    trial = torch.cuda.graph_pool_handle()
    with split_limit(limit_mb):
        release = capture_into(trial)
    held = process.pool_usage(trial, device)[0]
    release()
    process.release_warm_up_memory(device)
    return held


def chosen_limit(trials: dict[int | None, int]) -> int | None:
    """The split limit whose trial pool held fewest bytes (None, the allocator's default, wins ties
    and is the answer when there were no trials)."""
    return min(trials, key=lambda k: (trials[k], k is not None), default=None)


def tuned_split_limit(device: torch.device, capture_into: Callable[[tuple], Callable[[], None]]
                      ) -> dict[int | None, int]:
    """Each trial capture's pool bytes by split limit (None: the allocator's default), for
    :func:`chosen_limit`. ``capture_into(trial)`` captures the shape into the pool ``trial`` and
    returns what releases that capture. The first trial runs with the process's own settings and
    records the requests the candidates come from (:func:`candidate_limits_mb`); each trial and its
    pool are given back before the next. Off CUDA, or where :func:`why_not_tuned` names a reason,
    no trial runs (an empty dict)."""
    reason = why_not_tuned(process_settings()) if device.type == "cuda" else "no CUDA"
    if reason is not None:
        log.info("graph pool layout: split limit not tuned: %s", reason)
        return {}
    with recorded_allocations(device, process.capture_stream(device)) as events:
        held = {None: _trial_bytes(device, capture_into, None)}
    for limit in candidate_limits_mb(n for kind, _, n in events() if kind == "alloc"):
        held[limit] = _trial_bytes(device, capture_into, limit)
    log.info("graph pool layout: first capture's trial pools by split limit (MiB): %s; chosen %s",
             {("default" if k is None else k): v >> 20 for k, v in held.items()}, chosen_limit(held) or "default")
    return held
