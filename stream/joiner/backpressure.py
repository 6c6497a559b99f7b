"""Backpressure between the two inputs of a partition: neither runs far ahead of the other.

The two topics are fetched independently. A reader that starts behind (a replayed log, a restart after
downtime, a slow producer) can get one input far ahead of the other, and both directions cost:

* **Clicks ahead of impressions** wait in the join (``PartitionJoin.waiting``) until their impression
  arrives; past ``max_waiting`` the engine gives the furthest up as ``overflow`` (their impressions become
  negatives). A click is a third of an impression's size, so a fetch of the same bytes holds more of them:
  on a full ML-1M replay 147,948 of 575,281 clicks went that way (click coverage 0.74).
* **Impressions ahead of clicks** go out (``fake_negative``: each impression at once as an observed 0)
  long before the clicks that label them, so the samples topic holds long runs of zeros followed by runs of
  delayed ones, and the learner swings between them. In event time, as in production, each delayed positive
  follows its impression by its click delay.

So the gate aligns the inputs in event time (``stream/alignment.py``: Flink's watermark alignment, FLIP-182),
with the waiting-click count as a second trigger. For each partition, the input whose event time (the engine's
per-input time, the ``watermark_quorum``-th largest seen) leads the other's by more than ``max_drift_ms`` is
paused while the other has more to read; clicks are also paused while their waiting count reaches ``high`` (80%
of the cap, or one batch below it). A paused input resumes when the lead is back under half the drift (and, for
clicks, the waiting count at ``low``, 50% of the cap), or as soon as the other input is read to the end (then
nothing more is coming to catch up with). Pausing never skips: the consumer's position stays where processing
stopped. In a live stream both inputs sit at the present and nothing is paused.

Pure logic: the drivers (``kafka_driver.py`` pauses librdkafka partitions, ``worker.py`` faust's) ask it
what to pause and resume after each batch (:class:`InputPauses`), and resume everything before an idle exit. Both
drivers use the gate's waiting-click rule only: they keep event time aligned with :func:`hold_limits` (what one batch
joins) and pause an input only for the memory its held records take (:class:`HoldBound`), since each pause purges what
the consumer prefetched (the event-time rule paused and resumed a replay's inputs nearly every batch). What a driver has
in hand when it pauses the clicks still comes, so the pipeline joins a partition's clicks only as far as the waiting
cap has room while its impressions have more to read (:func:`click_room`): with the hold on, the cap gives up clicks
only once nothing more can come to take them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client import Counter as PCounter
from prometheus_client import Gauge

from stream.alignment import lead
from stream.config import KafkaSettings

log = logging.getLogger("streamrec.join")

IMPRESSIONS, CLICKS = "impressions", "clicks"

PAUSED = Gauge("streamrec_join_input_paused", "1 while a partition's input is paused for backpressure.",
               ["input", "partition"])
PAUSES = PCounter("streamrec_join_input_pauses_total", "Times a partition's input was paused: it ran ahead of the "
                  "other input in event time, or (clicks) its waiting clicks reached the high mark.", ["input"])

Key = tuple[str, int]  # (IMPRESSIONS | CLICKS, partition)


def topic_of(kafka: KafkaSettings, kind: str) -> str:
    """The topic an input is read from."""
    return kafka.impressions_topic if kind == IMPRESSIONS else kafka.clicks_topic


def input_of(kafka: KafkaSettings, topic: str) -> str:
    """The input a topic feeds (IMPRESSIONS or CLICKS)."""
    return IMPRESSIONS if topic == kafka.impressions_topic else CLICKS

Behind = Callable[[str, int], bool]  # whether (input, partition) has more to read
HOLD_ALL = -sys.maxsize  # the limit of an input whose other input has more to read but has not been read yet


def never_fetched(inputs: list[Key], waited_s: float) -> int:
    """The exit status of a bounded run idle with ``inputs`` never fetched since their assignment
    (``stream.unfetched.Unfetched.overdue``: every fetch of them failing, the consumer logging each error): 1, said,
    and the run is not drained: their input is unread, the run not complete. Both drivers ended such a run as idle
    (status 0, ``--drain`` sending their impressions out as 0s) once the inputs' grace had passed."""
    log.error("inputs %s were never fetched in %.0f s (their fetches keep failing: see the consumer's errors above); "
              "their input is unread, so this bounded run ends with status 1 without draining: fix the broker or the "
              "topics' access and run it again", inputs, waited_s)
    return 1


def unread(partitions: Iterable[int], behind: Behind, paused: set[Key]) -> list[Key]:
    """The inputs of ``partitions`` with more to read (``behind``: by the high watermark their fetcher saw, or not
    fetched yet since the assignment, for ``stream.unfetched.Unfetched``'s grace), those ``paused`` left out (the idle
    exit resumes them first). A driver counts no idleness while there is one: an idle exit before the clicks' first
    fetch (a slow group join or fetch under load) drained their impressions as 0s, their clicks never read (the faust
    driver's)."""
    return [(kind, p) for p in sorted(partitions) for kind in (IMPRESSIONS, CLICKS)
            if (kind, p) not in paused and behind(kind, p)]


def hold_limits(reached: Mapping[Key, int | None], behind: Behind, drift_ms: int) -> dict[Key, int]:
    """Per input of the partitions in a batch, the event time it may be joined up to now (absent: no limit).

    The pause rule below works between batches; inside one, a fetch can bring one input days ahead of the
    other (on a replayed ML-1M's sparse later years, a batch of 5,000 impressions spans months and its clicks
    come in the next fetch): joined whole, every impression of it goes out as an observed 0 before the clicks
    that label the oldest of them. So a partition is joined only up to its frontier: the oldest of the event
    times its inputs that have more to read have reached (``reached``: the engine's measure of an input's time,
    ``PartitionJoin.reached``, over what it joined and this batch), plus ``drift_ms``. The rest waits (the driver
    keeps it and pauses that input) until the other input has caught up, or has nothing more to read. Below the
    frontier both inputs are in hand, and the engine merges them in event time. An input with more to read whose
    time is not known yet (None: fewer events than the quorum) is not held and holds the other back entirely
    (:data:`HOLD_ALL`), as in ``stream/alignment.py``: it is read until its time is known."""
    limits: dict[Key, int] = {}
    for p in sorted({p for _, p in reached}):
        ahead = {kind: reached.get((kind, p)) for kind in (IMPRESSIONS, CLICKS) if behind(kind, p)}
        unknown = {kind for kind, t in ahead.items() if t is None}
        if unknown:
            limits.update({(kind, p): HOLD_ALL for kind in (IMPRESSIONS, CLICKS) if kind not in unknown})
        elif ahead:
            frontier = min(t for t in ahead.values() if t is not None) + drift_ms
            limits.update({(IMPRESSIONS, p): frontier, (CLICKS, p): frontier})
    return limits


def click_room(cap: int, waiting: int) -> int:
    """How many more clicks of a partition may be joined now, while its impressions have more to read: no more than its
    waiting cap (``max_waiting_per_partition``) has room for, given the impression ids ``waiting`` for theirs (those
    past hope left out: ``PartitionJoin.hopeless``, the impressions' time less the allowed lateness has passed their
    clicks; the cap gives them up first). The rest are held (``JoinPipeline._take``) until the impressions read
    meanwhile take waiting clicks out or leave them past hope, or the impressions are read to the end; then the cap
    gives up the furthest, as without backpressure, and no click that could still join is among them. Applied while the
    hold is on (``[joiner] backpressure`` and ``max_input_drift_s``).

    The gate's pause acts between batches and only on what the consumer has not fetched yet; what is in hand already
    (the rest of a fetch a batch had no room for, the clicks a hold kept past their frontier) still came after the pause
    and joined in full, so a hostile stream's waiting clicks passed the cap by up to a batch and a fetch: faust's driver
    gave up 24 clicks as overflow in one CI run of three. Counted in the clicks that add a waiting id (none adds more
    than one; one on an impression held or closed or an id waiting adds none: ``PartitionJoin.clicks_within``),
    this holds the cap exactly. It cannot stop the join: while a partition's waiting count is at the cap its clicks are
    paused by the gate and do not hold its impressions back (:meth:`InputPauses.holds_back`), so the impressions are
    read and joined. The watermark that expires orphans does not move meanwhile (it is the slower input's time, and the
    clicks' stands still), so a cap full of orphans (clicks on impressions that never come) is released by the
    impressions' own time instead: once it passes them by the lateness, the cap gives them up and the clicks go on
    (without that, a live stream whose impressions always had more to read held the clicks for good). Only as many
    clicks as that frees are joined: with every waiting click past hope the cap was lifted whole until 2026-12-06, and a
    batch's clicks ahead of their impressions (79-131 at a cap of 10 on one waiting orphan) pushed the waiting count
    past it, the engine gave up the furthest of them (real clicks) and kept the hopeless orphans: the faust driver lost
    10-66 real clicks in 3 of 6 loaded runs of test_backpressure's orphan burst."""
    return max(0, cap - waiting)


@dataclass
class HoldBound:
    """Which inputs to pause for the records held past their partition's frontier (``hold_limits``): the memory bound
    of the hold, with hysteresis. An input is paused once ``high`` or more of its records are held and resumed once
    no more than ``low`` are (the frontier passed the rest, or they were dropped: revoked, rewound).

    Why hysteresis: a pause purges the consumer's prefetched messages of the partition and a resume fetches them
    again, a broker round trip before that input's next record. Pausing at one bound and resuming just under it
    (as a plain threshold does) toggles the input with almost every batch; on a replayed ML-1M the worker waited
    ~25 s of its ~70 s on such re-fetches. With the two marks apart, an input is paused once per ``high - low``
    records the frontier passes. Memory: at most ``high`` held per input plus what one fetch brings."""

    high: int
    low: int
    paused: set[Key] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"HoldBound needs 0 <= low < high, got low={self.low}, high={self.high}")

    def update(self, held: Mapping[Key, int]) -> set[Key]:
        """The inputs to keep paused now, given how many records of each are held (absent: none)."""
        self.paused = {k for k in self.paused if held.get(k, 0) > self.low} | \
            {k for k, n in held.items() if n >= self.high}
        return self.paused


# The hold's memory bound (hold_bounds), in batches of batch_max records: up to HOLD_BATCHES per partition, and no more
# than HOLD_BUDGET over a worker's partitions. 16 batches instead of 4 joined a replayed ML-1M (4 partitions) 8-12%
# faster: 5-6 input pauses instead of 26-32. Only the input ahead of a partition's frontier holds records, so at most
# one input per partition does. Memory: a replayed ML-1M's worker peaked at 540-610 MB with 16 batches of 5,000
# records per partition against 440-450 MB with 4.
HOLD_BATCHES, HOLD_BUDGET = 16, 64


def hold_bounds(batch_max: int, partitions: int, gate: InputGate) -> dict[str, HoldBound]:
    """The hold's bound per input of each of a worker's ``partitions`` (how many it is assigned): impressions paused at
    ``HOLD_BATCHES`` batches held, fewer where the worker's ``HOLD_BUDGET`` is shared by more partitions, and resumed at
    a quarter of that. Clicks no more than the waiting cap's margin above the gate's pause (``cap - gate.high``): held
    clicks are joined into the waiting ones once the frontier passes them, and a pause of the clicks' consumer does not
    stop that (with 16 batches of them held, a hostile stream's waiting clicks overflowed the cap: 115 clicks in
    test_backpressure, 320 held against a cap of 100, before :func:`click_room` held them at the cap); with the margin
    the clicks stay paused whenever the cap's room holds some back below the gate's mark. The clicks' low mark keeps the
    same share of their high."""
    high = max(1, min(HOLD_BATCHES, HOLD_BUDGET // max(1, partitions))) * batch_max
    low = high // 4
    c_high = max(2, min(high, gate.cap - gate.high))
    return {IMPRESSIONS: HoldBound(high, low), CLICKS: HoldBound(c_high, max(1, c_high * low // high))}


class InputPauses:
    """What a driver keeps paused, for both of its reasons: the gate's waiting-click rule, and the records each input
    holds past its partition's frontier (``hold_bounds``). Pure logic, shared by the kafka and faust drivers: they ask
    it after each batch, and pause and resume their consumer's partitions as :meth:`sync` says."""

    def __init__(self, gate: InputGate, batch_max: int) -> None:
        self.gate, self.batch_max = gate, batch_max
        self.bounds = hold_bounds(batch_max, 1, gate)  # sized again for each assignment (:meth:`resize`)
        self.paused: set[Key] = set()  # what the driver's consumer has paused now

    def resize(self, partitions: int) -> None:
        """The hold's bounds for a worker assigned ``partitions`` partitions."""
        self.bounds = hold_bounds(self.batch_max, partitions, self.gate)

    def held_inputs(self, held: Mapping[Key, int]) -> set[Key]:
        """The inputs paused for the records they hold past the frontier, given how many each holds (absent: none):
        impressions from 16 batches held until a quarter of that is, fewer with many partitions; clicks within the
        waiting cap's margin. Below the bound an input is read on, its records held in memory: a pause purges the
        consumer's prefetched messages of the partition and a resume fetches them again."""
        return set().union(*(bound.update({k: n for k, n in held.items() if k[0] == kind})
                             for kind, bound in self.bounds.items()))

    def holds_back(self, kind: str, partition: int, waiting: int, behind: Behind) -> bool:
        """Whether ``kind`` of ``partition`` bounds what is joined of the partition (``hold_limits``' ``behind``): it
        has more to read, and it is not clicks the gate holds for their ``waiting`` count (which stay paused until
        impressions come: waiting on them would stop both). An input paused for its held records is ahead of the
        frontier, not behind it, so it still bounds; once the other input has caught up its held records are joined
        and it is resumed."""
        if kind == CLICKS and (kind, partition) in self.gate.paused and waiting > self.gate.low:
            return False
        return behind(kind, partition)

    def sync(self, held: Mapping[Key, int]) -> tuple[set[Key], set[Key]]:
        """(inputs to pause now, inputs to resume now): what the gate or a hold wants paused, against what is. The
        hold's pauses are counted as the gate counts its own."""
        want = self.gate.paused | self.held_inputs(held)
        pause, resume = want - self.paused, self.paused - want
        self.gate.count(pause - self.gate.paused, resume)
        self.paused = want  # first: a revoked partition's resume may raise, and it is not paused any more
        return pause, resume


@dataclass
class InputGate:
    """Which partitions' inputs to pause and resume (module docstring). ``cap``: ``max_waiting_per_partition``."""

    cap: int
    max_drift_ms: int | None = 60_000  # None: no event-time rule (the waiting cap only)
    enabled: bool = True  # ``[joiner] backpressure``; off: never pauses
    headroom: int = 0  # events one more batch may add (``batch_max``): the high mark stays this far below the cap
    high_share: float = 0.8
    low_share: float = 0.5
    paused: set[Key] = field(default_factory=set)
    pauses: dict[str, int] = field(default_factory=lambda: {IMPRESSIONS: 0, CLICKS: 0})

    @property
    def high(self) -> int:
        return max(1, min(int(self.cap * self.high_share), self.cap - self.headroom))

    @property
    def low(self) -> int:
        return int(self.cap * self.low_share)

    def held(self, kind: str) -> set[int]:
        """The partitions whose ``kind`` input is paused now."""
        return {p for k, p in self.paused if k == kind}

    @staticmethod
    def _lead(times: tuple[int | None, int | None] | None, kind: str, behind: Callable[[str], bool]) -> int | None:
        """How far ``kind``'s event time leads the other input's, if that has more to read (stream/alignment.py)."""
        imp, clk = times if times is not None else (None, None)
        return lead(kind, {IMPRESSIONS: imp, CLICKS: clk}, behind)

    def _ahead(self, kind: str, lead: int | None, waiting: int, resuming: bool) -> bool:
        drift = self.max_drift_ms
        by_time = drift is not None and lead is not None and lead > (drift // 2 if resuming else drift)
        if kind == IMPRESSIONS:
            return by_time
        if resuming:
            return by_time or waiting > self.low
        return by_time or waiting >= self.high

    def update(self, waiting: Mapping[int, int], times: Mapping[int, tuple[int | None, int | None]],
               behind: Callable[[str, int], bool]) -> tuple[set[Key], set[Key]]:
        """(inputs to pause now, inputs to resume now), given each held partition's waiting clicks, its
        (impressions, clicks) event times and whether an input has more to read. A partition no longer held
        is resumed (forgotten)."""
        pause: set[Key] = set()
        resume: set[Key] = set()

        def of(p: int) -> Callable[[str], bool]:
            return lambda kind: behind(kind, p)

        for kind, p in sorted(self.paused):
            other = CLICKS if kind == IMPRESSIONS else IMPRESSIONS
            if p not in waiting or not behind(other, p) or not self._ahead(
                    kind, self._lead(times.get(p), kind, of(p)), waiting[p], resuming=True):
                resume.add((kind, p))
        still = self.paused - resume
        for p, n in waiting.items() if self.enabled else ():
            for kind, other in ((CLICKS, IMPRESSIONS), (IMPRESSIONS, CLICKS)):
                if (kind, p) in still or (other, p) in still or (other, p) in pause:
                    continue  # never both inputs of a partition
                d = self._lead(times.get(p), kind, of(p))
                if self._ahead(kind, d, n, resuming=False) and behind(other, p):
                    pause.add((kind, p))
        self.paused = still | pause
        self.count(pause, resume)
        return pause, resume

    def count(self, pause: set[Key], resume: set[Key]) -> None:
        """Count and show pauses a driver made for its own reasons (a :class:`HoldBound`'s) as the
        gate's are: ``pauses`` and the metrics cover every input paused for backpressure."""
        for kind, p in pause:
            self.pauses[kind] += 1
            PAUSES.labels(kind).inc()
            PAUSED.labels(kind, str(p)).set(1)
        for kind, p in resume:
            PAUSED.labels(kind, str(p)).set(0)

    def release(self, partitions: set[int] | None = None) -> set[Key]:
        """Forget the pauses of ``partitions`` (all when None): revoked, or the worker rewinds. Returns them."""
        gone = {key for key in self.paused if partitions is None or key[1] in partitions}
        self.paused -= gone
        for kind, p in gone:
            PAUSED.labels(kind, str(p)).set(0)
        return gone
