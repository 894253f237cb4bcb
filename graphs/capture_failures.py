"""What a failed capture reports, and host synchronisation made an error while one records.

A capture that fails is ended and discarded by its backend, which names the shape and the call
that broke it (:func:`offending_call` of the :func:`root_cause`); :func:`sync_is_error` makes a
host sync inside a capture raise in PyTorch before CUDA sees it, so the capture can still end.
"""

from __future__ import annotations

import contextlib
import traceback

import torch


def root_cause(exc: BaseException) -> BaseException:
    """The first exception of a chain (a failed capture often raises again while ending)."""
    seen = {id(exc)}
    while exc.__context__ is not None and id(exc.__context__) not in seen:
        exc = exc.__context__
        seen.add(id(exc))
    return exc


def offending_call(exc: BaseException) -> str:
    """The innermost frame outside torch of ``exc``'s traceback, as ``file:line in fn: code``."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename]
    if not frames:
        return "unknown call"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {f.line}"


@contextlib.contextmanager
def sync_is_error(device: torch.device):
    """Make host synchronisation raise *before* it reaches CUDA, so a capture that tries one
    (``.item()``, ``.cpu()``, ``nonzero``) fails cleanly and can still be ended and discarded,
    instead of invalidating the capture and leaving the RNG and allocator in capture state."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
