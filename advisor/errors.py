"""The project's error types: every bad input raises one of these, with a message a user can act on."""

from __future__ import annotations


class AdvisorError(ValueError):
    """Base class of the errors the core raises on bad input; the app and CLI show their message."""


class SpecError(AdvisorError):
    """A spec field holds a value outside its allowed range.

    The message names the field, the value given and what is allowed, e.g.
    ``parallel.tp=3: model.n_heads=32 must be divisible by tp (allowed: 1, 2, 4, 8, 16, 32)``.
    """

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={shown_value(value)}: {allowed}")


def shown_value(value: object, limit: int = 80) -> str:
    """``repr(value)`` for a message, cut to about ``limit`` characters: a 400-digit integer or a
    megabyte string given as a count shows its start and its length, not all of it."""
    text = repr(value)
    if len(text) <= limit:
        return text
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{text[:20]}...({len(text.lstrip('-'))} digits)"
    return f"{text[: limit - 20]}...({len(text)} characters)"


class Refused(AdvisorError):
    """An option this machine cannot run (fp8 without fp8 units, Unified Memory beyond free memory): the
    profiled run is filed with status 'refused' and this message."""


class ConfigImportError(AdvisorError):
    """A Hugging Face config.json could not be turned into a model spec."""


class TraceError(AdvisorError):
    """A trace file could not be read: wrong format, damaged, too large, or holding no events."""
