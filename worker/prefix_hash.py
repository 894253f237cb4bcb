"""Content keys of full KV pages: a hash chained over the token ids of every page up to this one.

A page's KV depends on every token before it as well as its own (attention mixes them in), so page
``i``'s key is ``H(key of page i-1, salt, tokens of page i)``: two prompts share page ``i``'s key only
if they share all of their first ``(i + 1) * page_size`` tokens. ``salt`` is whatever else changes the
KV's content for the same tokens (a model or adapter name, a cache salt a tenant supplies); the engine
passes the same salt for every request today.

The hash is BLAKE2b (16-byte digests over the int64 bytes of the tokens), not Python's ``hash``: a
collision would hand one request another prompt's KV, so keys must not be forgeable from chosen
prompts (vLLM moved its prefix cache off the built-in hash for that reason). The keys are equal across
processes and machines, so a router can compute them for the groups it sends to.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

PageKey = bytes

_ROOT = b"graphfleet-prefix-v1"


def page_keys(token_ids: Sequence[int] | np.ndarray, page_size: int, *, salt: bytes = b"",
              limit: int | None = None, parent: PageKey | None = None) -> list[PageKey]:
    """Keys of the full pages of ``token_ids`` (a trailing partial page has none), at most ``limit``.

    ``parent``: the key of the page before ``token_ids[0]`` (to continue a chain); None starts one.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    tokens = np.asarray(token_ids, dtype=np.int64)
    full = len(tokens) // page_size
    if limit is not None:
        full = min(full, max(0, limit))
    keys: list[PageKey] = []
    key = parent if parent is not None else hashlib.blake2b(_ROOT + salt, digest_size=16).digest()
    data = tokens[: full * page_size].tobytes()
    step = page_size * 8
    for i in range(full):
        key = hashlib.blake2b(key + data[i * step: (i + 1) * step], digest_size=16).digest()
        keys.append(key)
    return keys
