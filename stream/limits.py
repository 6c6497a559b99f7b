"""Limits on outside input, checked when an event is decoded (``stream/events.py``).

Every bound is a setting (``[limits]`` in the config file, ``STREAMREC_LIMITS_*``) with a default that
no legitimate event comes near and that keeps one event's cost bounded: a message over a limit is
dead-lettered with the limit in its reason, never truncated or let through.

============================  =======  ===========================================================
setting                       default  bounds
============================  =======  ===========================================================
``max_message_bytes``         65536    the raw message (checked before parsing)
``max_context_keys``          64       keys of ``context``
``max_dense_keys``            64       keys of ``dense``
``max_key_len``               64       characters of a context or dense key
``max_str_len``               256      characters of a string id or context value
``max_list_len``              1024     elements of a context list
``future_ts_s``               3600     how far ``ts`` may be ahead of the message's broker
                                       timestamp, capped at the reader's wall clock (a
                                       producer's CreateTime is its own clock), or of that
                                       clock alone where the message has none
                                       (``stream.events.ts_bound_ms``)
============================  =======  ===========================================================

Dense values must be finite *as float32* (the learner's dtype): ``1e39`` is finite in JSON and inf in
training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stream.config import DURATION_CAP_S, check_counts
from stream.errors import ConfigError

FLOAT32_MAX = 3.4028234663852886e38
# Numbers at or beyond this round to inf as float32 (below it they round to at most FLOAT32_MAX).
FLOAT32_OVERFLOW = float(2**128 - 2**103)
# Dense feature values: |x| < 2**64 (~1.8e19) at every stage (events, event logs, samples, scoring requests). A larger
# value squares past float32's range: fed raw to the model, one made Adam's second moment inf for good. One bound end
# to end: while events took anything finite as float32, one event of 1e20 was joined and then cost the learner the
# whole 64-row samples message it shared with good impressions. Dense features must be scaled.
MAX_ABS_DENSE = float(2**64)  # on the float32 value the model reads (stream/samples.py)
# ... and on a number before it becomes float32 (events, event logs, requests): below this it rounds to below
# MAX_ABS_DENSE (float32's spacing just under 2**64 is 2**40; from half of it below, a number rounds up to 2**64)
DENSE_BOUND = MAX_ABS_DENSE - float(2**39)
# An integer is read through float64, which rounds 2**64 - 2**39 - 2**10 and above up to DENSE_BOUND: the largest
# number literal accepted whatever its form (any literal up to it reads as a float below DENSE_BOUND).
DENSE_MAX_LITERAL = 2**64 - 2**39 - 2**10 - 1


@dataclass(frozen=True)
class EventLimits:
    max_message_bytes: int = 65_536  # at most 1,000,000,000 (librdkafka's message.max.bytes cap)
    max_context_keys: int = 64
    max_dense_keys: int = 64
    max_key_len: int = 64
    max_str_len: int = 256
    max_list_len: int = 1024
    # An event more than this far ahead of its message's broker timestamp (at most the wall clock) is dead-lettered
    # (future_ts): one client with a wrong clock must not move event time (and with it every window) for everyone.
    future_ts_s: float = 3600.0

    def __post_init__(self) -> None:
        # every max_* >= 1; a message at most librdkafka's 1e9 bytes (the rest: stream.config.MAX_COUNT)
        check_counts("limits", self, at_most={"max_message_bytes": 1_000_000_000})
        # finite and at most ten years (DURATION_CAP_S, every duration's): an infinite bound, or 1e306 s (1e309 ms is
        # inf), overflowed future_ts_ms on every event with a broker time
        ahead = self.future_ts_s
        if isinstance(ahead, bool) or not isinstance(ahead, int | float) or not (
                math.isfinite(ahead) and 0 <= ahead <= DURATION_CAP_S):
            raise ConfigError(f"[limits] future_ts_s: got {ahead!r}, expected a finite number of seconds >= 0 and <= "
                              f"{DURATION_CAP_S:g} (ten years)")

    @property
    def future_ts_ms(self) -> int:
        return int(self.future_ts_s * 1000)


DEFAULT_LIMITS = EventLimits()
