"""The join of one input partition: impressions + clicks -> exactly one labelled sample per impression.

Pure logic, no I/O: the driver (``stream/joiner/worker.py``) feeds decoded events in batches and
writes what :meth:`PartitionJoin.apply` returns. Semantics, all in event time:

- An impression waits for its click for ``window`` ms. The first click with
  ``0 <= click.ts - imp.ts <= window`` makes a positive sample at once (label delay = click.ts -
  imp.ts). Further clicks on it are duplicates: counted, no second sample.
- ``watermark = min(impression time, click time) seen on the partition - allowed lateness - 1``: the
  two topics are consumed independently, so event time is only as far as the slower one (as with
  Flink's multi-input watermarks). The watermark is the newest time that has passed: an event exactly the
  allowed lateness behind its input's time (with none: a tie with it) is still in order, so it is 1 ms
  short of that (Flink's ``BoundedOutOfOrdernessWatermarks`` subtracts the same 1 ms): at ``time - lateness`` a
  click at its impression's ``ts + window`` read a batch later was late, and a click at its impression's time read
  a batch before it an orphan, though both were in order. An input's time is the ``watermark_quorum``-th largest event
  time seen on it, not the largest: event time is steered by the bulk of the partition, never by
  one event (a client with a wrong clock would otherwise expire every pending impression at once).
  Until both inputs have been seen, event time
  does not advance. When the driver reports the click input idle (no click on this partition for a
  while of wall-clock time, ``clicks_idle=True``), event time follows impressions alone, so a quiet
  click stream cannot hold back expiry for ever. When
  ``imp.ts + window <= watermark`` the impression expires: a negative sample if it had no click.
- A click on an expired impression, or one more than ``window`` after it, is *late*; a click whose
  impression never arrives (by the time the watermark passes the click) is an *orphan*. Both are
  returned as :class:`Unjoined` records (the driver writes them to ``late_clicks``); none vanishes.
  Clicks may arrive before their impression (two topics are consumed independently): they wait.
- Each event is applied at most once: the state remembers the last handled offset per topic (applied, or
  dead-lettered by the caller: ``apply``'s ``handled``), and a redelivered event (after a restart) is skipped.
- Memory is bounded per partition: beyond ``max_pending`` impressions the oldest expire early (a
  negative sample now; a click on it later is reported late) and beyond ``max_waiting`` impression
  ids with waiting clicks the furthest-future clicks are given up as ``overflow``. Both are counted
  (``evicted_impressions``, ``overflow_clicks``); nothing leaves silently.
- Events far in the past (older than the watermark by more than the window) are applied like any
  other: an impression expires at once as a negative, a click on it is late.

When a sample goes out is the emission policy (``JoinConfig.policy``; ``stream/samples.py`` for the kinds,
``learner/delayed.py`` for how the learner corrects for each):

- ``wait``: a positive when the click arrives, a negative when the window closes (all :data:`FINAL`).
- ``window``: every sample when its window closes, with its final label: no label-dependent order, but
  every sample is a window old.
- ``fake_negative`` (Ktena et al., RecSys 2019): every impression at once as an :data:`OBSERVED` 0, and
  again as a :data:`DELAYED_POSITIVE` 1 when its click arrives inside the window.
- ``es_dfm`` (elapsed-time sampling, Yang et al., AAAI 2021): an impression waits ``elapsed_ms`` of event
  time; a click by then makes an :data:`OBSERVED` 1 at once, else an :data:`OBSERVED` 0 goes out when the
  watermark passes ``ts + elapsed_ms``, and a click after that (inside the window) a :data:`DELAYED_POSITIVE`.
  Decided by the click's delay, not by when the batch checks the timers: a click more than ``elapsed_ms``
  after its impression always comes after an :data:`OBSERVED` 0, even when both are seen in one batch.

Under every policy an impression has exactly one sample with its final label in view: a :data:`FINAL` one,
or an :data:`OBSERVED` one followed by a :data:`DELAYED_POSITIVE` when it was clicked late. ``(impression_id,
kind)`` is each sample's identity.

State durability is event-sourced (``stream/joiner/state_log.py``): every batch yields one
:class:`StateChunk` (impressions added, clicks joined, clicks waiting, watermark, offsets), and a
chunk is retired (tombstoned) once nothing it holds can matter any more. While event time stands still
(the impressions stalled after their quorum, or never reaching it) nothing retires, and a batch of
clicks on impressions that never come wrote a chunk each for as long as the stall lasted: so once the
live chunks outweigh twice the live state (plus ``COMPACT_SLACK``; a chunk weighs its items plus ``CHUNK_WEIGHT``
for its own framing), the batch's chunk holds the whole live state instead and every older chunk retires
(:meth:`PartitionJoin._compact`).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import attrgetter, itemgetter
from typing import NamedTuple

import numpy as np

from stream.events import Click, Impression
from stream.features import hash_column, hash_context
from stream.joiner.config import EmissionPolicy
from stream.joiner.context_block import hashed_rows
from stream.joiner.timers import ForgetRuns, TimerRuns
from stream.samples import DELAYED_POSITIVE, FINAL, OBSERVED

IMPRESSIONS, CLICKS = 0, 1
_USER_ID, _ITEM_ID, _CONTEXT = attrgetter("user_id"), attrgetter("item_id"), attrgetter("context")  # of an Impression
_TIME_THEN_KIND, _TS_OF_EVENT = itemgetter(0, 1), itemgetter(0)  # of (ts, kind, Pending or Click): run in C
_OFFSET, _EVENT = itemgetter(0), itemgetter(1)  # of an (offset, event) input pair
_ID, _TS, _DENSE = attrgetter("impression_id"), attrgetter("ts"), attrgetter("dense")  # of an Impression or Pending
_CLICK_TS = attrgetter("click_ts")  # of a Pending
_SECOND = itemgetter(1)  # of a (due time, impression_id) timer
_NO_OFFSET = -1
# Compaction (``PartitionJoin._compact``): the live chunks' weight (a chunk: CHUNK_WEIGHT + its listed items) may
# exceed twice the weight of one chunk holding the whole live state by this much before they are replaced by such a
# chunk.
COMPACT_SLACK = 1_000
# A chunk's own cost in listed items: an empty chunk encodes to ~350 bytes and a waiting click adds ~31
# (state_log.encode_chunk), and each chunk is one more Kafka record to write, read and decode at a restore. Counted
# as 1, a stall whose batches each brought a click or two on impressions that never come grew the log by a chunk a
# batch up to the waiting cap (100,000 chunks, each mostly framing) before the first snapshot: its chunks' items
# alone never outweighed twice the state they held.
CHUNK_WEIGHT = 12


@dataclass(frozen=True)
class JoinConfig:
    window_ms: int = 1_800_000
    lateness_ms: int = 5_000
    late_retention_ms: int = 3_600_000
    history_len: int = 50
    watermark_quorum: int = 16  # an input's event time = its k-th largest event time seen
    max_pending: int = 500_000  # impressions held per partition
    max_waiting: int = 100_000  # impression ids with clicks waiting for their impression, per partition
    policy: str = "wait"  # emission policy: wait | window | fake_negative | es_dfm (module docstring)
    elapsed_ms: int = 0  # es_dfm: how long an impression waits for its click before its OBSERVED sample

    def __post_init__(self) -> None:
        if self.watermark_quorum < 1:  # [joiner] watermark_quorum is checked the same way (stream.config.check_counts)
            raise ValueError(f"watermark_quorum must be >= 1, got {self.watermark_quorum}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.policy == "es_dfm" and not 0 <= self.elapsed_ms <= self.window_ms:
            raise ValueError(f"elapsed_ms must be in [0, window_ms], got {self.elapsed_ms}")

    def emission(self) -> dict[str, int | str]:
        """The settings that decide which samples a state's impressions have had (the claim records them:
        ``pipeline.JoinPipeline.restore``): the policy, the window and the lateness (when an impression closes), and
        es_dfm's elapsed time (when its observed sample goes out). :meth:`PartitionJoin.restore` takes every impression
        its watermark has passed under them as emitted: under others it took some that never were (no sample), or
        held open again some that were (two)."""
        return {"policy": self.policy, "window_ms": self.window_ms, "lateness_ms": self.lateness_ms,
                **({"elapsed_ms": self.elapsed_ms} if self.policy == "es_dfm" else {})}


POLICIES = tuple(p.value for p in EmissionPolicy)


@dataclass(slots=True)
class Pending:
    """An impression inside its attribution window, with its features as of impression time."""

    impression_id: str
    ts: int
    user: int  # stable_hash(user_id)
    item: int  # stable_hash(item_id)
    # key -> hashed value or list: a ContextRow (its row of the batch's ContextBlock, context_block.py) or a dict
    context: Mapping[str, int | list[int]]
    dense: dict[str, float]
    chunk: int  # the state chunk that added it
    click_ts: int | None = None  # set once joined
    observed: bool = False  # fake_negative / es_dfm: its OBSERVED sample is out
    # The user's clicked items before ts, oldest first: filled by the pipeline when the sample is
    # emitted (from Redis, filtered to clicks before ts), when event time has passed ts.
    history: list[int] = field(default_factory=list)


class Sample(NamedTuple):  # immutable like a frozen dataclass, at a third of its construction cost (one per sample)
    pending: Pending
    label: int
    label_delay_ms: int
    kind: int = FINAL  # stream/samples.py: FINAL | OBSERVED | DELAYED_POSITIVE


@dataclass(frozen=True, slots=True)
class Unjoined:
    impression_id: str
    click_ts: int
    reason: str  # "late" | "orphan" | "before_impression" | "overflow"


class JoinedClick(NamedTuple):  # immutable, one per joined click: a NamedTuple builds in a third of a frozen dataclass
    user: int
    item: int
    click_ts: int


def _fold_offset(offset: int, topic_id: str | None, chunk_offset: int, chunk_topic_id: str | None) -> int:
    """The restored offset of one input after a chunk (folded in seq order): the larger one of the same topic, but the
    chunk's own where it names another topic id than the chunks before it (the topic made again: ``start_over``), as
    the old topic's larger offset would skip the new topic's records below it as redelivered."""
    if topic_id and chunk_topic_id and topic_id != chunk_topic_id:
        return chunk_offset
    return max(offset, chunk_offset)


@dataclass
class StateChunk:
    """What one batch changed; folding every live chunk in order rebuilds the partition's state."""

    seq: int
    added: list[Pending]
    joined: list[tuple[str, int]]  # (impression_id, click_ts)
    waiting: list[tuple[str, int]]  # clicks whose impression was not seen yet
    max_ts: int | None  # the watermark's event time after this batch (watermark = max_ts - lateness - 1)
    offsets: tuple[int, int]  # last handled (impressions, clicks) offset: applied, or dead-lettered by the pipeline
    max_ref_ts: int  # latest event time this chunk refers to; it retires after that + window + retention
    evicted: list[str] = field(default_factory=list)  # impressions expired early by the max_pending cap
    unwaited: list[tuple[str, int]] = field(default_factory=list)  # waiting clicks given up (max_waiting cap)
    # Each input's event time after this batch: a restored partition continues from it instead of waiting
    # for both inputs again (the clicks before the restart are not delivered again).
    topic_max: tuple[int | None, int | None] = (None, None)
    # Each input's ``watermark_quorum`` largest event times after this batch (ascending; fewer before that many):
    # a restore continues the quorum from them exactly. Without them (a chunk written before they were kept) it takes
    # ``topic_max`` k times, which holds the watermark back until k newer times come: a click late before the restart
    # could join after it.
    topic_top: tuple[list[int], list[int]] = ([], [])
    # Which (impressions, clicks) topics ``offsets`` are of, by topic id (``kafka_topics.topic_identity``; None: a
    # chunk written before ids were kept, or a broker that gives none): a restore onto a topic of that name made again
    # drops the old topic's offset instead of skipping the new one's records below it (``pipeline.JoinPipeline``).
    topic_ids: tuple[str | None, str | None] = (None, None)
    # The whole live state (``PartitionJoin._compact``): a restore leaves out every chunk before it. Those are retired
    # with it, but a stop between its write and their tombstones leaves some live, and folded in they held its waiting
    # clicks twice.
    snapshot: bool = False


@dataclass
class BatchResult:
    samples: list[Sample] = field(default_factory=list)
    unjoined: list[Unjoined] = field(default_factory=list)
    joined_clicks: list[JoinedClick] = field(default_factory=list)
    new_impressions: list[Pending] = field(default_factory=list)  # for the Redis counts
    chunk: StateChunk | None = None  # None when the batch changed nothing
    retired: list[int] = field(default_factory=list)  # chunk seqs no longer needed
    stats: Counter[str] = field(default_factory=Counter)


def _timers(ps: list[Pending], after: int) -> list[tuple[int, str]]:
    """``(p.ts + after, p.impression_id)`` of each of ``ps``, built in C."""
    return list(zip(map(after.__add__, map(_TS, ps)), map(_ID, ps), strict=True))


class PartitionJoin:
    """Join state and logic of one partition (impressions[p] with clicks[p])."""

    def __init__(self, partition: int, cfg: JoinConfig) -> None:
        self.partition = partition
        self.cfg = cfg
        self.pending: dict[str, Pending] = {}
        self._expiry = TimerRuns()  # (imp.ts + window, impression_id)
        self._elapsed = TimerRuns()  # es_dfm: (imp.ts + elapsed, impression_id)
        self.finalized: dict[str, tuple[int, int]] = {}  # id -> (ts, label), kept late_retention
        self._final_order = ForgetRuns(cfg.window_ms + cfg.late_retention_ms)  # finalized ids, by ts
        self.waiting: dict[str, list[int]] = {}  # impression_id -> click ts, impression not seen yet
        self._waiting_heap: list[tuple[int, str]] = []
        self._hopeless: list[str] | None = None  # what hopeless() is now, where known (None: scan; apply drops it)
        self.max_ts: int | None = None  # the watermark's event time (before lateness)
        self.topic_max: list[int | None] = [None, None]  # event time per input topic (k-th largest seen)
        self._top: list[list[int]] = [[], []]  # per input: min-heap of the k largest event times
        self.offsets = [_NO_OFFSET, _NO_OFFSET]
        self.topic_ids: list[str | None] = [None, None]  # the input topics ``offsets`` are of (StateChunk.topic_ids)
        self.next_seq = 0
        self.newest_seq = -1  # the newest chunk's seq (the next one's may be further on: ``continue_at``)
        self._chunks: list[tuple[int, int]] = []  # heap of (retire_at event time, seq)
        self._live: dict[int, tuple[int, int]] = {}  # seq -> (max_ref_ts, weight) of each live chunk
        self._live_weight = 0  # the sum of the live chunks' weights (_compact)
        self._superseded: list[int] = []  # chunks before the restored snapshot, still in the log: retired next batch
        # False: no snapshot (_compact) of this state can be written, a held impression being over what a state record
        # may be now (a limit lowered since it came: ``pipeline.JoinPipeline._join_partition``); the chunks stay
        self.compacts = True

    # -- the batch step ------------------------------------------------------------------------
    @property
    def live_chunks(self) -> int:
        """Chunks of this partition's state log not retired yet (what a restore reads): those a restore left before its
        snapshot count until the next batch's tombstones."""
        return len(self._live) + len(self._superseded)

    @property
    def watermark(self) -> int | None:
        return None if self.max_ts is None else self.max_ts - self.cfg.lateness_ms - 1  # (module docstring)

    def oldest_pending_ts(self) -> int | None:
        """Event time of the oldest impression still inside its window (None: none is)."""
        while (first := self._expiry.peek()) is not None and first[1] not in self.pending:
            self._expiry.pop()  # left before its window closed (evicted in a restored chunk)
        return None if first is None else first[0] - self.cfg.window_ms

    def hopeless(self) -> list[str]:
        """The impression ids whose waiting clicks can no longer meet their impression: the impression input's time,
        less the allowed lateness, has passed the newest of them (an impression at or before a click's time would come
        later than the lateness allows). They would expire as orphans once the click input's time moved on too; the
        waiting cap gives them up first (:meth:`_enforce_caps`), and ``backpressure.click_room`` does not count them.
        Scans the waiting clicks (asked only while the cap is full), once between two batches: ``_take`` asks after a
        batch whose cap gave them up, and then none is left (``_enforce_caps`` keeps that), or asks again in a batch."""
        if self._hopeless is None:
            imp_time = self.topic_max[IMPRESSIONS]
            past = None if imp_time is None else imp_time - self.cfg.lateness_ms
            self._hopeless = [] if past is None else [imp_id for imp_id, ts in self.waiting.items() if past > max(ts)]
        return list(self._hopeless)

    def clicks_within(self, clicks: Iterable[tuple[int, Click]], free: int, hopeless: Collection[str] = ()) -> int:
        """How many of a batch's clicks (``(offset, Click)`` pairs, as :meth:`apply` takes them) can be joined while
        they add no more than ``free`` impression ids to :attr:`waiting` (``backpressure.click_room``). None adds more
        than one, and none adds one that is redelivered (skipped), whose impression is held (it joins, or is a
        duplicate, late or before it) or closed and remembered, whose id already waits, or whose id an earlier click of
        the batch added: nothing in :meth:`apply`'s loop takes an impression out of ``pending`` or ``finalized``, and an
        id leaves ``waiting`` there only for ``pending``. An id in ``hopeless`` counts as not waiting: the cap gives it
        up first, unless this click (newer) keeps it, and then it holds a place. Safely high, never low: a click whose
        impression comes in the same batch is counted."""
        pending, finalized, waiting, seen = self.pending, self.finalized, self.waiting, set()
        applied, n = self.offsets[CLICKS], -1
        for n, (offset, click) in enumerate(clicks):
            imp_id = click.impression_id
            if offset > applied and imp_id not in seen:
                seen.add(imp_id)
                if imp_id in hopeless or not (imp_id in pending or imp_id in finalized or imp_id in waiting):
                    if free == 0:
                        return n
                    free -= 1
        return n + 1

    def reached(self, kind: int, ts: Sequence[int] | np.ndarray) -> int | None:
        """The event time input ``kind`` is at once ``ts`` ((N,) int64) are read too (its ``watermark_quorum``-th
        largest; None: fewer events than that). For the hold-back of ``backpressure.hold_limits``; changes nothing."""
        k = self.cfg.watermark_quorum
        times = np.concatenate([np.asarray(self._top[kind], np.int64), np.asarray(ts, np.int64)])
        return int(np.partition(times, len(times) - k)[len(times) - k]) if len(times) >= k else None

    def within(self, kind: int, ts: Sequence[int] | np.ndarray, limit: int) -> int:
        """How many of ``ts`` (one input's events, in offset order) can be joined before that input's time
        would pass ``limit``. A lone event past it does not move the time (the quorum), so it does not stop
        the rest."""
        # The k-th largest of the times so far passes ``limit`` exactly when k of them are past it: the first index
        # where the running count of times past ``limit`` (the held top-k's, then ts's) reaches k.
        k = self.cfg.watermark_quorum
        past = np.cumsum(np.asarray(ts, np.int64) > limit) + sum(t > limit for t in self._top[kind])
        first = int(np.searchsorted(past, k))  # ``past`` never decreases
        return min(first, len(ts))

    def apply(self, impressions: list[tuple[int, Impression]], clicks: list[tuple[int, Click]],
              drain: bool = False, clicks_idle: bool = False, handled: Sequence[int] | None = None) -> BatchResult:
        """Apply one batch: ``(offset, event)`` pairs of this partition, offsets ascending per topic.

        ``drain=True`` ends the input: every
        pending impression expires. ``clicks_idle=True``: the click input has been quiet, let
        impressions alone drive event time. ``handled``: the last offset of each input (impressions, clicks) the
        batch handled, its records handled outside the engine (dead-lettered) included: the offsets move past them
        too, in a chunk of their own if nothing else changed, so a bad record read again after a restart is
        redelivered, not dead-lettered twice.
        """
        out = BatchResult()
        self._hopeless = None  # the batch changes what waits, and the impressions' time
        seq, max_ts = self.next_seq, self.max_ts  # (a batch with no new event may still move event time: clicks_idle)
        added: list[Pending] = []
        joined: list[tuple[str, int]] = []
        waiting: list[tuple[str, int]] = []
        max_ref = -1

        imp_from, click_from = self.offsets
        new_imps = [pair for pair in impressions if pair[0] > imp_from]  # (offset, Impression)
        new_clicks = [pair for pair in clicks if pair[0] > click_from]
        # The new impressions' features hashed as columns, once per batch: an impression is event ``row`` of these.
        imp_events: list[Impression] = list(map(_EVENT, new_imps))
        users = hash_column(list(map(_USER_ID, imp_events))).tolist()
        items = hash_column(list(map(_ITEM_ID, imp_events))).tolist()
        contexts = hashed_rows(list(map(_CONTEXT, imp_events)), hash_context)
        # Each new impression's Pending, built in C (a duplicate's is dropped unused).
        imp_times = list(map(_TS, imp_events))
        fresh: tuple[list, list] = (
            list(zip(imp_times, repeat(IMPRESSIONS), map(Pending, map(_ID, imp_events), imp_times, users, items,
                                                           contexts, map(dict, map(_DENSE, imp_events)), repeat(seq)))),
            list(zip(map(_TS, click_events := list(map(_EVENT, new_clicks))), repeat(CLICKS), click_events)))
        redelivered = len(impressions) + len(clicks) - len(new_imps) - len(new_clicks)
        if redelivered:
            out.stats["redelivered"] += redelivered
        events: list[tuple[int, int, Pending | Click]] = fresh[IMPRESSIONS] + fresh[CLICKS]
        events.sort(key=_TIME_THEN_KIND)  # event time; impressions first at equal ts (stable: offset order after)

        # Each input's time: the k-th largest of its times, over the batch at once (it never decreases as times are
        # added, and nothing in the loop below reads it, so its value after the batch is all that counts).
        quorum = self.cfg.watermark_quorum
        for kind in (IMPRESSIONS, CLICKS):
            if fresh[kind]:
                times = np.fromiter(chain(self._top[kind], map(_TS_OF_EVENT, fresh[kind])), np.int64)  # (N,)
                if len(times) > quorum:
                    times = np.partition(times, len(times) - quorum)[len(times) - quorum:]  # (quorum,) the largest
                self._top[kind] = top = np.sort(times).tolist()  # ascending
                if len(top) == quorum:
                    prev = self.topic_max[kind]
                    self.topic_max[kind] = top[0] if prev is None else max(prev, top[0])
                self.offsets[kind] = max(self.offsets[kind], max(map(_OFFSET, (new_imps, new_clicks)[kind])))
        if handled is not None:
            self.offsets = [max(o, h) for o, h in zip(self.offsets, handled, strict=True)]
        # The per-event loop, kept lean (locals, counts added once): it runs once per input event.
        pending, finalized, waiting_clicks = self.pending, self.finalized, self.waiting
        window, push = self.cfg.window_ms, heapq.heappush
        fake, es_dfm, elapsed = self.cfg.policy == "fake_negative", self.cfg.policy == "es_dfm", self.cfg.elapsed_ms
        emit, click = out.samples.append, self._clicker(out, joined)
        n_duplicates = 0
        for ts, kind, ev in events:  # ev: a new impression's Pending, or a Click
            if kind == IMPRESSIONS:
                imp_id = ev.impression_id
                if imp_id in pending or imp_id in finalized:
                    n_duplicates += 1
                    continue
                pending[imp_id] = ev  # type: ignore[assignment]
                if fake:
                    ev.observed = True  # type: ignore[union-attr]
                    emit(Sample(ev, 0, 0, OBSERVED))  # type: ignore[arg-type]
                added.append(ev)  # type: ignore[arg-type]
                if imp_id in waiting_clicks:
                    took = sorted(waiting_clicks.pop(imp_id))
                    max_ref = max(max_ref, took[-1])  # outlive the chunks they waited in: a restore must see them go
                    for cts in took:
                        click(ev, cts)  # type: ignore[arg-type]
            else:
                imp_id, cts = ev.impression_id, ts
                found = pending.get(imp_id)
                if found is not None:
                    if click(found, cts) and found.ts > max_ref:
                        max_ref = found.ts
                elif imp_id in finalized:  # (ts, label): a click before it is that, whatever the label
                    f_ts, f_label = finalized[imp_id]
                    self._unjoined(out, imp_id, cts, "before_impression" if cts < f_ts else "duplicate" if f_label
                                   else "late")
                else:
                    waiting_clicks.setdefault(imp_id, []).append(cts)
                    push(self._waiting_heap, (cts, imp_id))
                    waiting.append((imp_id, cts))
                    if cts > max_ref:
                        max_ref = cts
        out.new_impressions.extend(added)
        if added:
            max_ref = max(max_ref, max(map(_TS, added)))
        self._expiry.add(_timers(added, window))  # nothing above reads the timers
        if es_dfm:
            self._elapsed.add(_timers(added, elapsed))
        for name, n in (("impressions", len(fresh[IMPRESSIONS])), ("clicks", len(fresh[CLICKS])),
                        ("duplicate_impressions", n_duplicates),
                        ("joined_clicks", len(out.joined_clicks))):
            if n:
                out.stats[name] += n

        evicted, unwaited = self._enforce_caps(out)
        # The chunk that records an eviction must outlive the chunk that added the impression / click.
        max_ref = max([max_ref, *(self.finalized[i][0] for i in evicted), *(t for _, t in unwaited)])
        self._advance_event_time(clicks_idle)
        # (the clicks still waiting: the heap keeps a click its impression took since until its time passes)
        held = [p.ts for p in self.pending.values()] + [t for ts in self.waiting.values() for t in ts] if drain else []
        if drain and held:
            # End of input: move event time past every window still open, and record that in the chunk (also when
            # event time never started: a partition restored with impressions but no click seen since). Past what
            # is held only: from the partition's time, a drain holding nothing (a re-run on a drained partition)
            # moved it a window further at each run.
            through = max(held) + self.cfg.window_ms + self.cfg.lateness_ms + 1  # the watermark: max(held) + window
            self.max_ts = through if self.max_ts is None else max(self.max_ts, through)
        self._expire(out)
        if events or drain or self.max_ts != max_ts or self.offsets != [imp_from, click_from]:
            out.chunk = self._chunk(seq, added, joined, waiting, max_ref, evicted, unwaited)
            self._keep(out.chunk)
            self.next_seq, self.newest_seq = seq + 1, seq
        out.retired = self._retire()
        if out.chunk is not None and self.compacts and self._outweigh_state():
            out.retired += self._compact(out)
        return out

    # -- internals -----------------------------------------------------------------------------
    def _chunk(self, seq: int, added: list[Pending], joined: list[tuple[str, int]], waiting: list[tuple[str, int]],
               max_ref: int, evicted: list[str], unwaited: list[tuple[str, int]]) -> StateChunk:
        """A chunk of these changes, with the partition's event times and offsets as they are now."""
        return StateChunk(seq, added, joined, waiting, self.max_ts, (self.offsets[0], self.offsets[1]), max_ref,
                          evicted, unwaited, (self.topic_max[0], self.topic_max[1]),
                          (list(self._top[0]), list(self._top[1])), (self.topic_ids[0], self.topic_ids[1]))

    def _keep(self, c: StateChunk) -> None:
        """Count ``c`` live until the watermark passes its ``retire_at`` (:meth:`_retire`)."""
        retire_at = c.max_ref_ts + self.cfg.window_ms + self.cfg.late_retention_ms if c.max_ref_ts >= 0 else -1
        heapq.heappush(self._chunks, (retire_at, c.seq))
        weight = CHUNK_WEIGHT + len(c.added) + len(c.joined) + len(c.waiting) + len(c.evicted) + len(c.unwaited)
        self._live[c.seq] = (c.max_ref_ts, weight)
        self._live_weight += weight

    def _outweigh_state(self) -> bool:
        """Whether the live chunks outweigh twice one chunk holding the whole live state, plus ``COMPACT_SLACK``
        (:meth:`_compact`). First on a bound in O(1) that counts an id's waiting clicks once, then, only past it, on
        the clicks themselves: a snapshot holds each, and one id's clicks waiting by the thousand (a burst on an
        impression not come yet) made a snapshot that alone outweighed twice the bound: every batch after it wrote
        the whole state again."""
        held = CHUNK_WEIGHT + 2 * (len(self.pending) + len(self.finalized))
        if self._live_weight <= 2 * (held + len(self.waiting)) + COMPACT_SLACK:
            return False
        return self._live_weight > 2 * (held + sum(map(len, self.waiting.values()))) + COMPACT_SLACK

    def _compact(self, out: BatchResult) -> list[int]:
        """Replace the batch's chunk (``out.chunk``) with one holding the whole live state, and retire every other
        live chunk (returned): folded by :meth:`restore`, that one chunk gives the state all of them gave. The held
        impressions with their clicks, the waiting clicks, and the closed impressions still remembered for late
        clicks (``finalized``, which keeps only their time and label) as impressions added and evicted at once, the
        way :meth:`restore` remembers an eviction. It refers to the latest time any of them did, so it outlives each."""
        assert out.chunk is not None
        seq = out.chunk.seq
        gone = [Pending(imp_id, ts, 0, 0, {}, {}, seq) for imp_id, (ts, _) in self.finalized.items()]
        held = list(self.pending.values())
        joined = [(p.impression_id, p.click_ts) for p in held if p.click_ts is not None]
        joined += [(imp_id, ts) for imp_id, (ts, label) in self.finalized.items() if label]  # restored as label 1
        waiting = [(imp_id, cts) for imp_id, times in self.waiting.items() for cts in times]
        max_ref = max(ref for ref, _ in self._live.values())
        retired = [s for s in self._live if s != seq]
        self._chunks, self._live, self._live_weight = [], {}, 0
        out.chunk = self._chunk(seq, held + gone, joined, waiting, max_ref, list(self.finalized), [])
        out.chunk.snapshot = True
        self._keep(out.chunk)
        return retired

    def _enforce_caps(self, out: BatchResult) -> tuple[list[str], list[tuple[str, int]]]:
        """The memory bounds (module docstring): returns what was evicted, for the state chunk."""
        gone: dict[str, Pending] = {}  # the oldest, in the order they expire
        excess = len(self.pending) - self.cfg.max_pending
        while excess > 0 and self._expiry:
            _, imp_id = self._expiry.pop()
            p = self.pending.get(imp_id)
            if p is not None and imp_id not in gone:
                gone[imp_id] = p
                excess -= 1
        self._finalize_all(list(gone.values()), out)
        evicted = list(gone)
        if evicted:
            out.stats["evicted_impressions"] += len(evicted)
        unwaited: list[tuple[str, int]] = []
        if len(self.waiting) > self.cfg.max_waiting:
            # First the clicks past hope (they cannot join any more); then, still over the cap, the clicks furthest in
            # the future (a wrong clock's), down to 90% of it. The furthest first alone gave up the clicks a batch
            # brought ahead of their impressions while the cap was full of hopeless ones (backpressure.click_room).
            give_up = self.hopeless()
            if (rest := len(self.waiting) - len(give_up)) > self.cfg.max_waiting:
                keep, past = int(self.cfg.max_waiting * 0.9), set(give_up)
                latest = sorted(((max(t), i) for i, t in self.waiting.items() if i not in past), reverse=True)
                give_up += [imp_id for _, imp_id in latest[: rest - keep]]
            for imp_id in give_up:
                for cts in self.waiting.pop(imp_id):
                    unwaited.append((imp_id, cts))
                    self._unjoined(out, imp_id, cts, "overflow")
            self._hopeless = []  # all given up; nothing after this in the batch adds a waiting id or moves the time
        return evicted, unwaited

    def _finalize_all(self, ps: list[Pending], out: BatchResult) -> None:
        """Take each of ``ps`` (distinct impressions) out of the window, in order: its negative sample if it had no
        click; remembered for late clicks. Expiry runs it once per batch over every impression due."""
        window, pending = self.cfg.window_ms, self.pending
        ids, times, clicked = list(map(_ID, ps)), list(map(_TS, ps)), list(map(_CLICK_TS, ps))  # (N,) each
        for imp_id in ids:
            del pending[imp_id]
        if self.cfg.policy == "window":
            out.samples.extend(Sample(p, 0, window) if c is None else Sample(p, 1, c - t)
                               for p, t, c in zip(ps, times, clicked, strict=True))
        else:
            out.samples.extend(Sample(p, 0, window) for p, c in zip(ps, clicked, strict=True)
                               if c is None and not p.observed)
        labels = [0 if c is None else 1 for c in clicked]
        self.finalized.update(zip(ids, zip(times, labels, strict=True), strict=True))  # id -> (ts, label)
        self._final_order.add(times, ids)

    def _advance_event_time(self, clicks_idle: bool) -> None:
        imp_max, click_max = self.topic_max
        if imp_max is None:
            return  # nothing can expire before the first impression
        if clicks_idle:
            t = imp_max
        elif click_max is None:
            return  # the click input has not started yet
        else:
            t = min(imp_max, click_max)
        self.max_ts = t if self.max_ts is None else max(self.max_ts, t)

    def _clicker(self, out: BatchResult, joined: list[tuple[str, int]]) -> Callable[[Pending, int], bool]:
        """The click step of one batch, its lookups bound once (it runs once per click): ``click(p, cts)`` applies a
        click to the pending impression ``p``; True if it made the positive sample."""
        window, elapsed, policy, unjoined = self.cfg.window_ms, self.cfg.elapsed_ms, self.cfg.policy, self._unjoined
        emit, joined_click, join = out.samples.append, out.joined_clicks.append, joined.append
        wait, delayed = policy == "wait", policy in ("fake_negative", "es_dfm")

        def click(p: Pending, cts: int) -> bool:
            delay = cts - p.ts
            if p.click_ts is not None:
                unjoined(out, p.impression_id, cts, "duplicate")
                return False
            if delay < 0:
                unjoined(out, p.impression_id, cts, "before_impression")
                return False
            if delay > window:
                unjoined(out, p.impression_id, cts, "late")
                return False
            p.click_ts = cts
            if wait:
                emit(Sample(p, 1, delay))
            elif delayed:  # after its OBSERVED 0 a click is a delayed positive
                if not p.observed and delay > elapsed:
                    # es_dfm in event time, whatever the batching: by then its elapsed time had passed unclicked
                    emit(Sample(p, 0, elapsed, OBSERVED))
                    p.observed = True
                emit(Sample(p, 1, delay, DELAYED_POSITIVE if p.observed else OBSERVED))
                p.observed = True
            joined_click(JoinedClick(p.user, p.item, cts))  # counted once per batch (apply)
            join((p.impression_id, cts))
            return True

        return click

    def _unjoined(self, out: BatchResult, imp_id: str, cts: int, reason: str) -> None:
        out.stats[f"{reason}_clicks"] += 1
        if reason != "duplicate":  # duplicates are counted only: the impression already has its label
            out.unjoined.append(Unjoined(imp_id, cts, reason))

    def _expire(self, out: BatchResult) -> None:
        wm = self.watermark
        if wm is None:
            return
        for _, imp_id in self._elapsed.pop_through(wm):  # es_dfm: waited long enough for a click
            p = self.pending.get(imp_id)
            if p is not None and not p.observed:
                p.observed = True
                out.samples.append(Sample(p, 0, self.cfg.elapsed_ms, OBSERVED))
        ids = list(map(_SECOND, self._expiry.pop_through(wm)))  # in the order they expire
        due = {i: p for i, p in zip(ids, map(self.pending.get, ids), strict=True) if p is not None}  # each once
        self._finalize_all(list(due.values()), out)
        while self._waiting_heap and self._waiting_heap[0][0] <= wm:
            cts, imp_id = heapq.heappop(self._waiting_heap)
            times = self.waiting.get(imp_id)
            if times and cts in times:
                times.remove(cts)
                if not times:
                    del self.waiting[imp_id]
                self._unjoined(out, imp_id, cts, "orphan")
        finalized = self.finalized
        for imp_id in self._final_order.pop_through(wm):
            finalized.pop(imp_id, None)

    def _retire(self) -> list[int]:
        wm = self.watermark
        retired, self._superseded = self._superseded, []
        # The newest chunk always stays: it holds the offsets and max event time.
        while wm is not None and self._chunks and self._chunks[0][0] <= wm and self._chunks[0][1] < self.newest_seq:
            retired.append(heapq.heappop(self._chunks)[1])
            self._live_weight -= self._live.pop(retired[-1])[1]
        return retired

    # -- recovery ------------------------------------------------------------------------------
    @classmethod
    def restore(cls, partition: int, cfg: JoinConfig, chunks: list[StateChunk]) -> PartitionJoin:
        """Rebuild from the live chunks of the state log (any order; sorted by seq here), from the newest snapshot on
        (:attr:`StateChunk.snapshot`)."""
        self = cls(partition, cfg)
        since = max((c.seq for c in chunks if c.snapshot), default=-1)
        self._superseded = sorted(c.seq for c in chunks if c.seq < since)
        chunks = [c for c in chunks if c.seq >= since]
        final_order: dict[str, int] = {}  # id -> ts of the evicted impressions, as _finalize_all keeps them
        tops: tuple[list[int], list[int]] = ([], [])  # the newest chunk's quorum per input (it only ever grows)
        for c in sorted(chunks, key=lambda c: c.seq):
            tops = (c.topic_top[0] or tops[0], c.topic_top[1] or tops[1])
            for imp_id, cts in c.waiting:  # before the impressions: a click waits only for one added later
                self.waiting.setdefault(imp_id, []).append(cts)
                heapq.heappush(self._waiting_heap, (cts, imp_id))
            for p in c.added:  # an id held from an earlier chunk was closed and forgotten before it came again
                self.pending[p.impression_id] = p
                self.waiting.pop(p.impression_id, None)  # its waiting clicks were applied to it (joined or unjoined)
                self.finalized.pop(p.impression_id, None)  # so was an eviction of it: its forget time is not this one's
                final_order.pop(p.impression_id, None)
                # fake_negative emits at once; es_dfm's timer is replayed by the _expire below
                p.observed = cfg.policy == "fake_negative"
            for imp_id, cts in c.joined:
                if imp_id in self.pending:
                    self.pending[imp_id].click_ts = cts
                    self.pending[imp_id].observed = cfg.policy in ("fake_negative", "es_dfm")
                times = self.waiting.get(imp_id)
                if times and cts in times:
                    times.remove(cts)
            for imp_id in c.evicted:  # expired early: its sample was emitted with that chunk
                gone = self.pending.pop(imp_id, None)
                if gone is not None:
                    p = gone
                    self.finalized[imp_id] = (p.ts, int(p.click_ts is not None))
                    final_order[imp_id] = p.ts
            for imp_id, cts in c.unwaited:
                times = self.waiting.get(imp_id)
                if times and cts in times:
                    times.remove(cts)
            if c.max_ts is not None:
                self.max_ts = c.max_ts if self.max_ts is None else max(self.max_ts, c.max_ts)
            for kind, t in enumerate(c.topic_max):
                if t is not None:
                    prev = self.topic_max[kind]
                    self.topic_max[kind] = t if prev is None else max(prev, t)
            self.offsets = [_fold_offset(self.offsets[k], self.topic_ids[k], c.offsets[k], c.topic_ids[k])
                            for k in (0, 1)]
            self.topic_ids = [new or was for new, was in zip(c.topic_ids, self.topic_ids, strict=True)]
            self._keep(c)
            self.next_seq = max(self.next_seq, c.seq + 1)
            self.newest_seq = max(self.newest_seq, c.seq)
        self._final_order.add(list(final_order.values()), list(final_order))
        # Timers of the impressions still held only: one of an id's first coming would close its second at once.
        self._expiry.add(_timers(list(self.pending.values()), cfg.window_ms))
        if cfg.policy == "es_dfm":
            self._elapsed.add(_timers(list(self.pending.values()), cfg.elapsed_ms))
        k = cfg.watermark_quorum
        for kind, t in enumerate(self.topic_max):  # the k largest times as kept, each at least the restored time (a
            top = sorted(tops[kind])[-k:]  # newer chunk of the old code's kept none: the quorum kept is older than it)
            self._top[kind] = top if t is None else [max(x, t) for x in [t] * (k - len(top)) + top]
        for imp_id in [i for i, t in self.waiting.items() if not t]:
            del self.waiting[imp_id]
        # Everything the stored watermark already expired was emitted before the state was written.
        self._expire(BatchResult())
        return self

    def start_over(self, kind: int, topic_id: str) -> None:
        """Read input ``kind`` (0 impressions, 1 clicks) from its first record: its topic is ``topic_id`` now, not the
        one the restored offset is of (made again under its name). Only the offset goes: the pending impressions,
        waiting clicks and event times are keyed by impression id and event time, not by the old topic's offsets, so
        a click of the new clicks topic still joins its impression of the old impressions topic (dropping them lost
        their samples, in silence: a new impressions topic does not hold them again)."""
        self.offsets[kind] = _NO_OFFSET
        self.topic_ids[kind] = topic_id

    def continue_at(self, seq: int) -> None:
        """Number this partition's next chunk ``seq`` (past every one in the log): a new owner's chunks start past
        the seqs it fences off (``state_log.py``, "Fencing")."""
        if seq <= self.newest_seq:
            raise ValueError(f"partition {self.partition}: chunk {seq} would not follow chunk {self.newest_seq}")
        self.next_seq = seq
