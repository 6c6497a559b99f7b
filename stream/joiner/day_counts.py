"""The joiner's day counts on their way to Redis: counted per batch, buffered once the batch is durable, written by
one thread beside the batches.

A batch's counts (impressions per item and user, joined clicks per item and user, with their event times) and the raw
ids that name the counted hashes are kept apart until the batch's state is durable (:meth:`DayCountsWriter.batch_done`):
a batch that fails is done again from its input, and its counts must not be in the buffer twice. The buffer is
aggregated for ``counts_flush_s`` (popular ids repeat, so one ZINCRBY covers many events; a SIGKILL loses at most that
much counting) and handed to a writer thread (:meth:`DayCountsWriter.start_flush`) while the batches go on: Redis's
server time is most of a flush. A failed write fails the batch that finds it (:meth:`DayCountsWriter.check`, as a
synchronous write would have), and what it did not write stays for the next flush, which retries a write that was sent
as it was, under its write id, before writing what came since: a write whose reply was lost after Redis ran it is
counted once (``stream/counts.py``, "Retries"; :meth:`DayCountsWriter.finish_flush`). Redis losing its keys under the
prefix is checked after each write (``stream/keyspace.py``).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import redis

from stream.counts import DailyCounts, new_write_id
from stream.errors import ConfigError, quoted
from stream.features import hash_ids
from stream.joiner import metrics as m
from stream.keyspace import KeyspaceWatch
from stream.strikes import is_infrastructure

log = logging.getLogger("streamrec.join")
# Redis refusing a command it does not know (renamed or disabled by rename-command): "unknown command 'evalsha', with
# args beginning with: ..." (redis-py drops the "ERR "), "unknown subcommand 'load'"; not any other refusal
_UNKNOWN_COMMAND = re.compile(r"\bunknown (?:sub)?command\b", re.IGNORECASE)

Counts = dict[tuple[str, str], tuple[list[int], list[int]]]  # (kind, event) -> (hashed ids, event times in ms)
Names = dict[str, set[int | str]]  # kind ("item", "user") -> the raw ids counted under that kind


def _no_names() -> Names:
    return {"item": set(), "user": set()}


def add_counts(into: Counts, counts: Counts, ahead: bool = False) -> None:
    """Add ``counts`` to ``into``, each (kind, event)'s ids and times after those already there (``ahead``: before
    them, for counts handed back by a failed write, which are older)."""
    for key, (ids, ts) in counts.items():
        got = into.setdefault(key, ([], []))
        if ahead:
            got[0][:0], got[1][:0] = ids, ts
        else:
            got[0].extend(ids)
            got[1].extend(ts)


def named_by_hash(raws: set[int | str]) -> dict[int, int | str]:
    """Each raw id (an impression's user or item id: int or str, ``stream.events.check_id``) by its hash, for the
    counts writer to name what it counts. Through ``hash_ids``' cache, which the batches' joins filled with these very
    ids (``engine.apply`` hashes them as columns): ``hash_value``'s LRU cache, keyed apart, missed nearly every one
    and hashed it again (73 k ``stable_hash`` calls in a 220 k-event ``bench/joiner.py`` run: 0.17-0.24 s of the
    counts writer thread's 1.0-1.3 s CPU, 0.05-0.07 s this way). The same numbers (``features.hash_column``'s
    contract)."""
    ids = list(raws)
    return dict(zip(hash_ids(ids).tolist(), ids, strict=True))


@dataclass
class CountsWrite:
    """One write of day counts to Redis (:meth:`DayCountsWriter.write`): its counts (each kind and event removed once
    written), the raw ids that name them, and its write id, kept across every retry of these same counts so that a
    write whose reply was lost after Redis ran it counts once (``stream/counts.py``, "Retries")."""

    counts: Counts
    names: Names
    write_id: str = field(default_factory=new_write_id)
    sent: bool = False  # handed to Redis at least once: it may have been applied, so it is only retried as it is


class DayCountsWriter:
    """A joiner worker's day counts (module docstring): the batch in progress's, the buffer of durable batches', the
    writes in flight on the writer thread and the write that failed after it was sent."""

    def __init__(self, counts: DailyCounts, keyspace: KeyspaceWatch, flush_s: float) -> None:
        self.counts, self.keyspace, self.flush_s = counts, keyspace, flush_s
        # The batch in progress's counts and raw ids: added to the buffers below once its state is durable, so a
        # batch that fails (and is done again) is counted once (batch_done).
        self.batch: Counts = {}
        self.batch_names: Names = _no_names()
        self.buffered: Counts = {}
        self.names: Names = _no_names()  # raw ids since the flush
        self.flushed_at = time.monotonic()
        # The writes in flight on the writer thread, and the write that failed after it was sent (retried as it was,
        # under its write id, before anything newer: finish_flush).
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamrec-counts")
        self.flushing: tuple[Future[None], list[CountsWrite]] | None = None
        self.failed_write: CountsWrite | None = None

    def begin_batch(self) -> None:
        """A batch starts: what a failed batch before it counted is dropped (it is done again from its input)."""
        self.batch, self.batch_names = {}, _no_names()

    def add(self, kind: str, event: str, ids: list[int], ts: list[int]) -> None:
        """Count ``ids`` (hashed) at ``ts`` (ms) under ``kind`` and ``event`` for the batch in progress."""
        add_counts(self.batch, {(kind, event): (ids, ts)})

    def name(self, kind: str, raws: Iterable[int | str]) -> None:
        """Keep the raw ids of the batch in progress's ``kind`` ("item", "user") to name the hashes counted under it."""
        self.batch_names[kind].update(raws)

    def check(self) -> None:
        """A write that finished meanwhile: if it failed, raise its error now (a failed write fails the batch that
        finds it, which the worker rewinds, as a synchronous one would)."""
        if self.flushing is not None and self.flushing[0].done():
            self.finish_flush()

    def batch_done(self) -> None:
        """The batch's state is durable: its counts and raw ids join the buffers, and a flush starts when due."""
        counts, names = self.batch, self.batch_names
        self.begin_batch()
        add_counts(self.buffered, counts)
        for kind, raws in names.items():
            self.names[kind] |= raws
        if time.monotonic() - self.flushed_at >= self.flush_s:
            self.start_flush()

    def flush(self) -> None:
        """Write the buffered counts now, each counted hash with its raw id where an impression since the last flush
        carried it (a click's hash whose impression came earlier was named then); returns when they are written."""
        self.start_flush()
        self.finish_flush()

    def start_flush(self) -> None:
        """Hand the buffered counts to the writer thread and buffer afresh: the batches go on while Redis counts (its
        server time is most of a flush). One flush at a time: the previous one is finished first. A write that failed
        after it was sent goes first, as it was and under its own write id (:meth:`finish_flush`), then the buffer
        under a new one."""
        self.finish_flush()
        writes = [] if self.failed_write is None else [self.failed_write]
        self.failed_write = None
        counts, names = self.buffered, self.names
        self.buffered, self.names = {}, _no_names()
        self.flushed_at = time.monotonic()
        if counts:
            writes.append(CountsWrite(counts, names))
        if writes:
            self.flushing = (self.writer.submit(self.write, writes), writes)

    def finish_flush(self) -> None:
        """Wait for the writes in flight; if one failed, raise its error (a synchronous write failing would have), and
        keep what was not written for the next flush (the writer removed from each write every kind and event it
        wrote: those are not written again).

        The write that failed was sent: Redis may have run it and lost only the reply, so it is kept apart, with its
        write id, and retried exactly as it was (``stream/counts.py``, "Retries"); merged with newer counts it could
        not be retried safely (under its id the newer counts would be skipped as written, under a new id its own
        counted twice). A write not sent yet (behind the failed one) goes back into the buffer, ahead of what came
        since (it is older), and is written with the next flush's buffer; so at most one write waits apart."""
        if self.flushing is None:
            return
        future, writes = self.flushing
        self.flushing = None
        try:
            future.result()
        except BaseException as exc:
            for write in writes:
                if not write.counts:
                    continue
                if write.sent:
                    self.failed_write = write
                else:
                    add_counts(self.buffered, write.counts, ahead=True)
                    for kind, raws in write.names.items():
                        self.names[kind] |= raws
            if isinstance(exc, redis.RedisError) and not is_infrastructure(exc):
                # Redis refused the counts write (a WRONGTYPE: a key of ours holding something else; a command it does
                # not take: renamed or disabled; a script's error, a CROSSSLOT), the same every time: no message's
                # fault (the write sums many batches'), so no strikes for this batch's messages (which would
                # dead-letter good data), and no rewinding forever either.
                reply = str(exc).rsplit("caused error: ", 1)[-1]  # Redis's own words, not the pipeline's preamble
                refused = f"Redis refused the day counts write under prefix {self.counts.prefix!r} " \
                          f"({type(exc).__name__}: {quoted(reply, 300)})"
                if _UNKNOWN_COMMAND.search(reply):  # a command renamed or disabled: no key to delete
                    raise ConfigError(f"{refused}: the joiner writes them with EVALSHA and SCRIPT (EXISTS, LOAD) in "
                                      "MULTI/EXEC; give it those commands as Redis's reply says (renamed or disabled "
                                      "in its config?)") from exc
                if "WRONGTYPE" not in reply:  # a script error, CROSSSLOT, ...: what Redis says is all there is to go by
                    raise ConfigError(f"{refused}: check the Redis that [redis] url points at and what it holds under "
                                      f"[redis] prefix {self.counts.prefix!r}, as its reply says; on a Redis Cluster "
                                      "each write's keys share one hash slot, by the {item}/{user} tag after the "
                                      "prefix (stream/counts_keys.py), so a CROSSSLOT says something in between "
                                      "does not keep them together (a proxy? point [redis] url at a node of the "
                                      "cluster and set [redis] cluster = true)") from exc
                raise ConfigError(f"{refused}: a key under '{self.counts.prefix}:counts:' or "
                                  f"'{self.counts.prefix}:names:' holds something else (another "
                                  f"application using [redis] prefix {self.counts.prefix!r}?); delete that key or set "
                                  "another prefix") from exc
            raise

    def flush_last(self) -> None:
        """The last flush (at close): a write in flight that failed on an outage gets the one retry a next flush would
        give it (under its write id, with the counts buffered since); only a failure of that last flush is raised,
        after an ERROR saying how many events of durable batches it leaves uncounted (:meth:`unwritten`): no flush
        comes after it."""
        try:
            try:
                self.finish_flush()
            except Exception as exc:
                if not is_infrastructure(exc):
                    raise
                log.warning("a day counts write failed (%s: %s); retried with the last flush",
                            type(exc).__name__, quoted(str(exc)))
            self.flush()
        except BaseException as exc:
            if lost := self.unwritten():
                log.error("the last day counts flush failed (%s: %s): %d events of durable batches are not counted "
                          "in Redis (%s)", type(exc).__name__, quoted(str(exc)), sum(lost.values()),
                          ", ".join(f"{kind}/{event} {n}" for (kind, event), n in sorted(lost.items())))
            raise

    def unwritten(self) -> dict[tuple[str, str], int]:
        """The events of durable batches not written to Redis, per (kind, event): the write that failed after it was
        sent and the buffer (not the batch in progress: it is done again from its input). A copy of each is read (one
        C-level step): a wait for the writer interrupted (Ctrl-C) leaves its write in the writer's hands."""
        out: dict[tuple[str, str], int] = {}
        for counts in ([] if self.failed_write is None else [self.failed_write.counts]) + [self.buffered]:
            for key, (ids, _) in list(counts.items()):
                out[key] = out.get(key, 0) + len(ids)
        return out

    def shutdown(self) -> None:
        """Stop the writer thread, once the write in flight (if any) is done."""
        self.writer.shutdown(wait=True)

    def check_keyspace(self) -> None:
        """Redis lost its keys under the prefix since the last flush (``stream/keyspace.py``: a single node restarted
        empty, or on a cluster the node of that tag's slot): a warning and ``streamrec_join_redis_emptied_total{tag}``
        per tag. The joiner goes on, nothing to redo: the keys are gone, and samples from here on carry the click
        histories recorded since (empty at first) and the day counts start again (a nightly hot set left with no counts
        of a kind publishes with its ``hot_set`` warning); alerting on the metric is the operator's cue."""
        try:
            lost = self.keyspace.check()
        except redis.RedisError as exc:  # Redis refusing (full) or gone right after the counts: the next flush checks
            log.debug("the Redis keyspace markers were not checked: %s", exc)
            return
        for tag in lost:
            m.REDIS_EMPTIED.labels(tag).inc()
            log.warning("Redis lost the keys under prefix %r since the last counts flush (the %s marker is gone: "
                        "restarted without persistence, flushed, or on a Redis Cluster the node of the {%s} slot "
                        "restarted empty): users' click histories start again from empty and the %s day counts from "
                        "now; enable persistence (appendonly) to keep them", self.counts.prefix,
                        self.keyspace.keys[tag], tag, tag)

    def write(self, writes: list[CountsWrite]) -> None:
        """The writer thread's part of a flush: each write in turn, one DailyCounts.record per kind and event (each all
        or nothing) under the write's id; the first failure ends it.

        Each (kind, event) written is removed from its write's ``counts`` at once, so that what a failure leaves
        (:meth:`finish_flush`, which reads the writes only after this returned or raised) is only what was not
        written: with the item counts written and Redis failing on the user counts, the retry wrote the item counts a
        second time (and once more per further failure)."""
        for write in writes:
            names = {kind: named_by_hash(raws) for kind, raws in write.names.items()}
            for (kind, event), (ids, ts) in list(write.counts.items()):
                write.sent = True
                self.counts.record(kind, event, ids, ts, names=names[kind], write_id=write.write_id)
                del write.counts[(kind, event)]
        self.check_keyspace()  # after the counts: a failure of it fails no write
