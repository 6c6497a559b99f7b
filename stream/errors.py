"""The exceptions of ``stream/``.

::

    ConfigError (ValueError)     a configuration that cannot be used: the message names the source and the fix
    ├── streamrec.settings.SettingsError    settings files, environment, flags
    ├── stream.replay.eventlog.EventLogError  an event log mapped wrongly
    └── monitor.rules.RulesError             an alert rules file
    StreamError                  a real failure: the process should stop or retry
    ├── DatasetMissing           a packaged data set is not installed (the message says how)
    ├── DeliveryFailed           the broker did not acknowledge produced messages
    ├── MessageTooLarge          a message over the producer's message.max.bytes (never sent)
    └── BadMessage               *skip this message*: it goes to ``<topic>.dlq``, processing continues
        └── ValidationError      a decoded event breaks its schema (field, value, expected)

``BadMessage`` is kept apart from real failures on purpose: a consumer catches ``BadMessage`` per
message and dead-letters it, and lets every other exception propagate.
"""

from __future__ import annotations

import reprlib
from typing import Any

_SHOW = reprlib.Repr()
_SHOW.maxlevel = 2  # nested containers beyond two levels show as "..."
_SHOW.maxstring = _SHOW.maxother = 60
_SHOW.maxlist = _SHOW.maxdict = _SHOW.maxtuple = _SHOW.maxset = 4
_SHOW.maxlong = 40


def shown(value: Any, limit: int = 80) -> str:
    """A short, bounded ``repr`` of ``value`` for an error message; never raises.

    ``repr()`` of hostile input can raise (``RecursionError`` on deep nesting, ``ValueError`` on a huge
    int) or be megabytes long; ``reprlib`` stops at a depth and a width, so the cost is bounded too.
    """
    try:
        text = _SHOW.repr(value)
    except Exception:  # noqa: BLE001 - an error message must never become a second error
        text = f"<{type(value).__name__}>"
    return clip(text, limit)


def clip(text: str, limit: int = 200) -> str:
    """``text`` cut to at most ``limit`` characters (a message from a library may quote the input)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ConfigError(ValueError):
    """A configuration mistake (a setting, a file mapping, a rules file): nothing ran yet; exit status 2."""


class StreamError(Exception):
    """Base of every error raised by ``stream/``."""


class DatasetMissing(StreamError):
    """A data set the command needs is not installed."""


class DeliveryFailed(StreamError):
    """Messages were not acknowledged by the broker."""


class MessageTooLarge(StreamError):
    """A message larger than the producer may send; the caller splits, truncates or dead-letters it."""


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
        super().__init__(f"field {shown(field, 120)}: got {shown(value)}, expected {expected}")
        self.field = field
        self.value = value
        self.expected = expected
