"""The exception tree of streamrec: rooted here, one subtree per package.

::

    StreamrecError                   every error streamrec raises on purpose; `streamrec` prints one line
    ├── ConfigError (ValueError)     a configuration that cannot be used: names the source and the fix; exit 2
    │   ├── streamrec.settings.SettingsError       settings files, environment, flags
    │   ├── MessageLimitError        a topic refused a message under the size limit learned for it
    │   ├── DeliveryRefused          the broker denied this client's writes to a topic (authorization)
    │   ├── stream.replay.column_map.EventLogError an event log mapped wrongly
    │   ├── learner.config.CheckpointMismatch      settings that would change a checkpoint's model shape
    │   └── monitor.rules.RulesError               an alert rules file
    ├── BindError                    a listener (serve, a /metrics port) could not bind its port: one line, exit 1
    ├── StreamError                  stream/: a real failure, the process should stop or retry
    │   ├── DatasetMissing           a packaged data set is not installed (the message says how)
    │   ├── DeliveryFailed           the broker did not acknowledge produced messages
    │   │   └── PartitionMissing     one was for a partition its topic does not have (fewer than expected)
    │   ├── MessageTooLarge          a message over the producer's message.max.bytes (never sent)
    │   ├── PartitionLost            another member took over a partition this one held (a stall): batch unwritten
    │   ├── joiner.state_log.StateLogError       a join-state record that cannot be read (restore stops)
    │   └── BadMessage               *skip this message*: it goes to ``<topic>.dlq``, processing continues
    │       └── ValidationError      a decoded event breaks its schema (field, value, expected)
    ├── learner/
    │   ├── checkpoint.ExitCheckpointFailed  the learner's checkpoint at exit was not written
    │   ├── artifact_versions.ArtifactError      an artifact or publish root that cannot be used
    │   │   └── cache_refresh.publish.PinHeld   a scheduled publish held back by a rollback pin
    │   ├── deltas.DeltaError (ValueError)       a delta file that cannot be used
    │   └── tensorpack.PackError (ValueError)    bytes that are not an intact tensor pack
    ├── cache_refresh/
    │   ├── job.RefreshError         a refresh failed and published nothing (``stage`` says where)
    │   ├── validate.ValidationFailed            a staged artifact failed a check
    │   └── hot_set.RedisUnavailable             Redis did not answer after every retry
    ├── serving.request.RequestError             a request the service refuses (4xx)
    ├── monitor/
    │   ├── alerts.SinkError         an alert delivery attempt failed
    │   └── expr.ExprError (ValueError)          an expression that does not parse
    └── streamrec.stack.StackError (RuntimeError)   the local stack could not start or stop

``BadMessage`` is kept apart from real failures on purpose: a consumer catches ``BadMessage`` per
message and dead-letters it, and lets every other exception propagate. Libraries' own errors
(``KafkaException``, ``redis.RedisError``, ``OSError``) are not wrapped where the caller can act on them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from stream.secrets import RedactingRepr, redact_for_cut

_SHOW = RedactingRepr()  # each string scrubbed of credentials before it is cut (stream.secrets.redact_for_cut)
_SHOW.maxlevel = 2  # nested containers beyond two levels show as "..."
_SHOW.maxstring = _SHOW.maxother = 60
_SHOW.maxlist = _SHOW.maxdict = _SHOW.maxtuple = _SHOW.maxset = 4
_SHOW.maxlong = 40


def shown(value: Any, limit: int = 80) -> str:
    """A short, bounded ``repr`` of ``value`` for an error message; never raises.

    ``repr()`` of hostile input can raise (``RecursionError`` on deep nesting, ``ValueError`` on a huge
    int) or be megabytes long; ``reprlib`` stops at a depth and a width, so the cost is bounded too. A ``str`` is
    quoted by the rule of :func:`quoted` (up to ``limit`` characters, not reprlib's 60) between repr's quotes, the
    count of what was left out after them: ``'abc\\x1b'... (7 more chars)``.
    """
    if isinstance(value, str):  # scrubbed before the cut, which may drop the '@' a later redaction needs
        head, left_out = _escaped_head(redact_for_cut(value), limit - 2)
        quote = '"' if "'" in head and '"' not in head else "'"
        return f"{quote}{head}{quote}{_left_out(left_out)}"
    try:
        text = _SHOW.repr(value)
    except Exception:  # noqa: BLE001 - an error message must never become a second error
        text = f"<{type(value).__name__}>"
    return quoted(text, limit)  # an object's own __repr__ may hold a line break


def quoted(text: str, limit: int = 200) -> str:
    """Text from outside (a peer's answer, a file's bytes, a library's error quoting input) as a message may quote
    it: as it is where printable and at most ``limit`` characters; else each character that is not printable
    escaped (``\\n``, ``\\x1b``, ``\\u2028``: no forged log line, no terminal escape) and the result cut to at
    most ``limit`` characters, followed by ``... (N more chars)`` (N characters of ``text`` left out)."""
    if len(text) <= limit and text.isprintable():
        return text
    head, left_out = _escaped_head(text, limit)
    return head + _left_out(left_out)


def error_lines(text: str, limit: int = 2000, lines: int = 20) -> str:
    """An error's message as a terminal shows it: its first line, then at most ``lines`` more (a service's last log
    lines under the error that shows them, ``stream.startup.not_started``), each :func:`quoted` at ``limit``
    characters and each after the first indented two spaces, so that none passes for a line of its own (a forged
    error or log line); further lines are said as ``... (N more lines)``. Whole lines, not the first ``limit``
    characters of them all: that cut the last lines of a log tail, the ones that say why."""
    first, *more = text.split("\n")
    out = [quoted(first, limit), *(f"  {quoted(line.removeprefix('  '), limit)}" for line in more[:lines])]
    if len(more) > lines:
        out.append(f"  ... ({len(more) - lines} more lines)")
    return "\n".join(out)


def _escaped_head(text: str, limit: int) -> tuple[str, int]:
    """The escaped characters of ``text`` that fit in ``limit`` (an escape is never cut), and how many of ``text``'s
    characters did not fit. Reads at most ``limit`` characters of ``text`` (each is at least one out)."""
    out: list[str] = []
    used = taken = 0
    for c in text[:max(limit, 0)]:
        piece = c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
        if used + len(piece) > limit:
            break
        out.append(piece)
        used += len(piece)
        taken += 1
    return "".join(out), len(text) - taken


def _left_out(count: int) -> str:
    return f"... ({count:,} more chars)" if count else ""


def close_after_error(close: Callable[[], object], what: str, log: logging.Logger) -> None:
    """``close()`` on the way out of an error (an ``except BaseException:`` that re-raises): a close that fails too
    is logged, naming ``what``, not raised. Raised, it replaced the error that ended the run, and the one line a
    command prints at exit named the second error and hid the real cause."""
    try:
        close()
    except Exception:  # noqa: BLE001 - the error being raised is the one to report
        log.exception("%s after the error below failed too", what)


class StreamrecError(Exception):
    """The root of every error streamrec raises on purpose (the tree is drawn above)."""


class ConfigError(StreamrecError, ValueError):
    """A configuration mistake (a setting, a file mapping, a rules file): nothing ran yet; exit status 2."""


class BindError(StreamrecError):
    """A listening socket could not be bound (the port is in use, or not ours to take); exit status 1."""


def bind_error(exc: Exception, setting: str, host: str, port: int) -> StreamrecError:
    """One line for a failed bind of ``host:port`` (named by ``setting``, e.g. ``[serve] host / port``): a host that
    does not resolve or is not an address of this machine, or a port out of range, is a :class:`ConfigError` (exit
    2); a port in use or not permitted a :class:`BindError` (exit 1)."""
    import errno
    import socket

    where = f"{setting}: cannot listen on {host}:{port}"
    if isinstance(exc, OverflowError):
        return ConfigError(f"{where}: a port is 0-65535")
    if isinstance(exc, socket.gaierror):
        return ConfigError(f"{where}: the host does not resolve ({exc.strerror or exc})")
    err = getattr(exc, "errno", None)
    if err == errno.EADDRNOTAVAIL:
        return ConfigError(f"{where}: {host!r} is not an address of this machine")
    if err == errno.EADDRINUSE:
        return BindError(f"{where}: the port is in use (another process listens there); pick another port")
    if err == errno.EACCES:
        return BindError(f"{where}: permission denied (ports below 1024 need privileges)")
    return BindError(f"{where}: {getattr(exc, 'strerror', None) or exc}")


class StreamError(StreamrecError):
    """Base of every error raised by ``stream/``."""


class DatasetMissing(StreamError):
    """A data set the command needs is not installed."""


class DeliveryFailed(StreamError):
    """Messages were not acknowledged by the broker."""


class BrokerUnreachable(DeliveryFailed):
    """The broker acknowledged nothing for longer than the caller's limit (down, unreachable or frozen): the caller
    stopped waiting (``streamrec replay``'s ``[replay] broker_wait_s``)."""


class PartitionMissing(DeliveryFailed):
    """A message written to a partition its topic does not have: the topic has fewer partitions than its writer
    expects (created again with fewer while it ran?). A DeliveryFailed to a caller that cannot tell more; the joiner
    checks its partition layout again (``stream/joiner/partitions.py``). ``topic``: where it was going."""

    def __init__(self, text: str, topic: str | None = None) -> None:
        super().__init__(text)
        self.topic = topic


class PartitionLost(StreamError):
    """Another member took over a partition this one still held (it stalled past its session): what it joined of it
    is not written. No message's fault: the worker rewinds like after a broker failure (``stream.strikes``), and its
    next poll tells it the partition is gone."""


class MessageTooLarge(StreamError):
    """A message larger than the producer may send, or one the broker refused as too large; the caller splits,
    truncates or dead-letters it. ``topic``: where it was going, when known."""

    def __init__(self, text: str, topic: str | None = None) -> None:
        super().__init__(text)
        self.topic = topic


class MessageLimitError(ConfigError):
    """A topic refused a message as too large although it was sized under the limit learned for that topic: the
    broker's or the topic's limit is lower than what was read (or was lowered since). A configuration to fix, not a
    message's fault (no strikes) nor an outage (no retry)."""


class DeliveryRefused(ConfigError):
    """The broker denied this client's writes to a topic (an ACL without WRITE on it, or without IDEMPOTENT_WRITE on
    the cluster): a configuration to fix, not a message's fault (no strikes) nor an outage (no retry: sending again
    is denied again, for ever). ``topic``: the topic denied, when known."""

    def __init__(self, text: str, topic: str | None = None) -> None:
        super().__init__(text)
        self.topic = topic


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
