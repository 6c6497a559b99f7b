"""Event-time alignment of inputs read together: none runs far ahead of the others.

A reader that starts behind (a replayed log, a restart after downtime) finds every input full, and the
order it gets them in is the fetcher's, not event time's: librdkafka hands over a partition's backlog in
chunks of up to ``max.partition.fetch.bytes``. Whatever reads them in that order sees event time jump
back and forth. The joiner's two inputs of a partition (``stream/joiner/backpressure.py``) and the learner's
partitions of the samples topic (``learner/kafka_dataset.py``) are kept together by pausing an input whose
event time leads the slowest other input that still has something to read by more than a drift, until that
one catches up, as Flink's watermark alignment does for the splits of a source (FLIP-182, "Watermark
alignment": pause a split whose watermark leads the group's minimum by more than ``maxAllowedWatermarkDrift``).

Pure logic, for any key type: the caller keeps ``paused``, applies the decisions to its consumer and passes
each input's event time (None: not read yet) and whether it has more to read. An input that has nothing more
to read never holds the others back. One not read yet that has more to read holds back every input that has
been read (it may be the oldest: on the demo's ML-1M replay one partition read seven months of impressions
before its first click, and their delayed positives came out in a burst at the end); it is not paused itself,
so it is read, its time becomes known, and the rule cannot stall a reader.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


UNREAD = sys.maxsize  # the lead over an input that has more to read but has not been read yet


def lead(key: K, times: Mapping[K, int | None], behind: Callable[[K], bool]) -> int | None:
    """How far ``key``'s event time leads the slowest *other* input that has more to read (None: ``key`` not
    read yet, or no other input has more to read; :data:`UNREAD` when one of them has not been read yet).
    Negative when ``key`` is itself the slowest."""
    own = times.get(key)
    if own is None:
        return None
    others = [times.get(k) for k in times if k != key and behind(k)]
    if not others:
        return None
    known = [t for t in others if t is not None]
    return UNREAD if len(known) < len(others) else own - min(known)


def align(times: Mapping[K, int | None], paused: set[K], behind: Callable[[K], bool],
          drift_ms: int) -> tuple[set[K], set[K]]:
    """(inputs to pause now, inputs to resume now). An input is paused when it leads by more than ``drift_ms``
    (module docstring) and resumed when its lead is back to ``drift_ms // 2`` or less (hysteresis), when no
    other input has more to read, or when it is no longer among ``times``."""
    pause: set[K] = set()
    resume: set[K] = set()
    for key in paused:
        d = lead(key, times, behind) if key in times else None
        if d is None or d <= drift_ms // 2:
            resume.add(key)
    for key in times:
        if key not in paused:
            d = lead(key, times, behind)
            if d is not None and d > drift_ms:
                pause.add(key)
    return pause, resume
