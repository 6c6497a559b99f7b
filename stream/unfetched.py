"""How long an input whose end is not known yet counts as having more to read: one rule for every bounded reader.

A reader knows an input's end (a partition's) from the high watermark its fetcher last saw
(``stream.kafka.fetched_more``); until a fetch of it has been answered since its assignment, that is unknown. A reader
that ends a bounded run once it has been idle for a while (``exit_when_idle_s``) must not take that for the end of the
input: a first fetch can take longer than the idle limit (a large response under load, a slow broker, a group join),
and counted as "nothing more" then, the run ends with its input unread and reports success. So :class:`Unfetched`
counts an input of unknown end as "more" for ``grace_s`` from when it was first asked about, and past that names it
(:meth:`Unfetched.overdue`): never fetched, so not read, and a bounded run fails on it instead of ending as complete.
The joiner's drivers (``stream/joiner/backpressure.py``: its hold and idle exit) and the learner's samples reader
(``learner/kafka_dataset.py``) use it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

Key = tuple[str, int]  # an input, (name, partition): the joiner's (IMPRESSIONS | CLICKS, p), the learner's (topic, p)

UNFETCHED_GRACE_S = 10.0  # the longest an input not fetched yet since its assignment counts as having more to read


@dataclass
class Unfetched:
    """Whether an input whose end is not known yet has more to read (the joiner's drivers' ``behind``, the learner's
    idle exit): yes, for up to ``grace_s`` from when it was first asked about in its assignment; then no.

    Right after an assignment one input's first fetch can come a round or more before another's (each waits for its
    own start position; under load, seconds). Counted as "nothing more" then, the joiner joined the input fetched
    first whole (a fresh worker on a backlog sent out every impression of its first batches as an observed 0 minutes
    of event time ahead of the delayed positives still on their way), and the learner ended a bounded run "idle" with
    its input unread. Counted as "more" for good, an input whose fetch keeps failing would hold the rest back (or keep
    a bounded run going) for ever; so it counts as more only for ``grace_s``, time enough for a first fetch, and stalls
    nothing past it. Nor is it read: :meth:`overdue` names it, for an idle exit to fail on instead of ending the run
    as if its input were read."""

    grace_s: float = UNFETCHED_GRACE_S
    clock: Callable[[], float] = time.monotonic
    since: dict[Key, float] = field(default_factory=dict)  # when each input was first found unknown
    unknown: set[Key] = field(default_factory=set)  # the inputs whose end was unknown when last asked

    def behind(self, key: Key, more: bool | None) -> bool:
        """Whether input ``key`` has more to read, given what its fetcher says (``more``; None: unknown)."""
        if more is not None:
            self.unknown.discard(key)
            return more
        self.unknown.add(key)
        now = self.clock()
        return now - self.since.setdefault(key, now) < self.grace_s

    def overdue(self) -> list[Key]:
        """The inputs whose end is still unknown past their grace: never fetched since their assignment (a fetch that
        keeps failing), so not read to their end, whatever :meth:`behind` says of them."""
        now = self.clock()
        return sorted(k for k in self.unknown if now - self.since[k] >= self.grace_s)

    def forget(self, partitions: Iterable[int]) -> None:
        """Start the grace afresh for the inputs of ``partitions`` (assigned or revoked)."""
        gone = set(partitions)
        self.since = {k: t for k, t in self.since.items() if k[1] not in gone}
        self.unknown = {k for k in self.unknown if k[1] not in gone}
