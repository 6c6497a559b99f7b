"""The exceptions of ``stream/``.

::

    StreamError                  a real failure: the process should stop or retry
    ├── DatasetMissing           a packaged data set is not installed (the message says how)
    ├── DeliveryFailed           the broker did not acknowledge produced messages
    └── BadMessage               *skip this message*: it goes to ``<topic>.dlq``, processing continues
        └── ValidationError      a decoded event breaks its schema (field, value, expected)

``BadMessage`` is kept apart from real failures on purpose: a consumer catches ``BadMessage`` per
message and dead-letters it, and lets every other exception propagate.
"""

from __future__ import annotations

from typing import Any


class StreamError(Exception):
    """Base of every error raised by ``stream/``."""


class DatasetMissing(StreamError):
    """A data set the command needs is not installed."""


class DeliveryFailed(StreamError):
    """Messages were not acknowledged by the broker."""


class BadMessage(StreamError):
    """A message that cannot be processed; it is dead-lettered with :attr:`reason`."""

    #: short machine-readable class of the problem, used as a metric label
    kind: str = "bad_message"

    def __init__(self, reason: str, *, kind: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        if kind is not None:
            self.kind = kind


class ValidationError(BadMessage):
    """An event field has a value its schema does not allow."""

    kind = "invalid_field"

    def __init__(self, field: str, value: Any, expected: str) -> None:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"field {field!r}: got {shown}, expected {expected}")
        self.field = field
        self.value = value
        self.expected = expected
