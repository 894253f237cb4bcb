"""How often a streamed choice's tokens go out: every token at low load, coalesced under load.

Each chunk costs the replica a JSON body and a message through Serve's proxy, whatever it holds;
under load those messages, not the GPU, set the pace (``bench/stream_batching.py``). A fixed
interval (Ray Serve LLM's ``stream_batching_interval_ms``) pays for that at low load too: one
stream's tokens then come in bursts. The pacer gives the replica a chunk budget instead: with
``S`` choices streaming, each goes out at most once per ``min(ceiling, S / chunks_per_s)``, so a
lone stream gets every token as it comes and a full replica sends about ``chunks_per_s`` chunks a
second in all. The first token and the final chunk never wait (see
:meth:`fleet.handle.RequestHandle.aevent_batches`).
"""

from __future__ import annotations

import threading


class StreamPacer:
    """The streaming interval of the replica's open choices (thread-safe).

    ``ceiling_s``: the longest interval (``serve.stream_batching_interval_ms``); ``chunks_per_s``:
    the replica's chunk budget across its streams (``serve.stream_chunks_per_s``), None for the
    fixed interval ``ceiling_s`` whatever the load.
    """

    def __init__(self, ceiling_s: float, chunks_per_s: float | None) -> None:
        if ceiling_s < 0:
            raise ValueError(f"ceiling_s must be >= 0, got {ceiling_s!r}")
        if chunks_per_s is not None and chunks_per_s <= 0:
            raise ValueError(f"chunks_per_s must be > 0 or None, got {chunks_per_s!r}")
        self.ceiling_s, self.chunks_per_s = ceiling_s, chunks_per_s
        self._open = 0
        self._lock = threading.Lock()

    @property
    def open_streams(self) -> int:
        """Choices streaming now."""
        return self._open

    def interval_s(self) -> float:
        """The interval a choice's tokens wait for now (seconds; 0 = as they come)."""
        if self.chunks_per_s is None:
            return self.ceiling_s
        return min(self.ceiling_s, self._open / self.chunks_per_s)

    def open(self, choices: int) -> None:
        """Count ``choices`` more as streaming (until :meth:`close`)."""
        with self._lock:
            self._open += choices

    def close(self, choices: int) -> None:
        """``choices`` counted by :meth:`open` have stopped streaming."""
        with self._lock:
            self._open -= choices
