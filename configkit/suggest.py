"""Did-you-mean suggestions for unknown keys and invalid enum values."""

from __future__ import annotations

import difflib
from collections.abc import Sequence


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """``" (did you mean 'full'?)"`` for the choice closest to ``word``, or ``""`` when none is close.

    Close means a difflib ratio >= 0.6, or equal ignoring case (difflib scores case typos such as
    ``'FULL'`` low).
    """
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not match:
        match = [c for c in choices if c.lower() == word.lower()]
    return f" (did you mean {match[0]!r}?)" if match else ""
