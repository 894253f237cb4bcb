"""Naming threads where the OS shows them, so a profile can tell the engine loop from the rest."""

from __future__ import annotations

import sys


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` where the OS shows it (``top -H``, ``ps -L``, /proc task
    ``comm``: 15 characters on Linux), so its CPU time can be told from the HTTP loop's."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15])  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
