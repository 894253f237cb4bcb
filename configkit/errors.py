"""The error every configuration check raises, :class:`ConfigError` (keyed by the dotted key path),
and how a bad value is quoted in its message."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration; the message names the full key path, the bad value and what is allowed.

    ``key`` is the dotted key path the error is about (None for file-level errors); ``reason`` is
    the message without the key prefix.
    """

    def __init__(self, reason: str, *, key: str | None = None) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}" if key else reason)

    def under(self, prefix: str) -> ConfigError:
        """The same error with its key path moved under the section ``prefix``."""
        if not prefix:
            return self
        return type(self)(self.reason, key=f"{prefix}.{self.key}" if self.key else prefix)


class TypeMismatch(ConfigError):
    """A value of the wrong type for its key.

    Its own type so that a union (``int | str``) that no arm accepts can tell "wrong type for this
    arm" from a specific error inside one arm (a bad enum value, a bad list element) and report
    the specific one, or else every alternative at once.
    """


def show_value(value: object) -> str:
    """``repr(value)`` cut to 80 characters, for quoting a bad value in an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def describe(value: object) -> str:
    """``'16' (str)``: the bad value and its type, for type errors."""
    return f"{show_value(value)} ({'null' if value is None else type(value).__name__})"
