"""Resuming a replay from what its topics hold (``streamrec replay --resume``).

The topics are the record of what was delivered (no side file to lose; it holds after a SIGKILL too), read by
content: the messages carry no headers (any header costs librdkafka's produce 1-2 us CPU a message, bench/README.md).

- A replay's events are deterministic: the same data set and settings give byte-identical keys and values in the
  same order (:func:`run_fingerprint`, of what defines them, is logged and in the summary, never sent).
- The replay chooses each message's partition itself, the producer's partitioner over its key
  (:func:`key_partitions`: murmur2, as librdkafka's ``murmur2_random`` and the Java client pick; a message without a
  key, a raw malformed one, goes where an empty key does). So an event's partition is known before it is sent, and
  impressions and clicks of one impression id share a partition number.
- The idempotent producer delivers each partition's messages once and in order, so a partition holds a prefix of
  its share of the replay order. :func:`delivered_events` reads each partition's last message (from its high
  watermark - 1 to its end: a broker whose high watermark lags by a record batch, Tansu, is read to the end all the
  same) and finds the position of the partition's share whose (key, value) is it; where that pair is in the share
  more than once (repeated events, malformed messages alike), the last 2, 4, ... messages, until their sequence ends
  at one position only, or the whole partition (from offset 0) is read and is exactly a prefix of the share. Last
  messages found nowhere in the share (another run, other data) or that still match several positions with the whole
  partition read are a :class:`~stream.errors.ConfigError` naming the partition.
- A partition nothing was trimmed from (low watermark 0) holds exactly last offset + 1 messages (the idempotent
  producer, no transactions: contiguous offsets), so its last message must be at that position of its share: that
  count also tells repeated events apart, and a last message found elsewhere (an event log that gained or lost rows
  before it in event time since the first run, or another writer's messages) is a ConfigError naming the partition,
  the count and the position. Where retention trimmed a partition (low watermark > 0) the count cannot be known: a
  WARNING, once per topic, says the prefix length is not verified there (rows changed before the last messages are
  not seen).
- The reads go back by offsets, so records a consumer never gets (another producer's transaction markers, aborted
  records) at a partition's end are read past, not taken for an empty partition (which sent its share again), nor
  read again for ever. A partition that held messages (high watermark > 0) and has none to read holds none of this
  replay's where nothing was trimmed (low watermark 0: markers, aborted records); trimmed empty by retention or a
  delete of records, it is a ConfigError where this replay has events for it: how many it held is gone.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import Message

from stream.config import KafkaSettings
from stream.errors import ConfigError, shown
from stream.kafka import read_to_end, watermarks

log = logging.getLogger("streamrec.replay")

TAIL_READ_S = 60.0  # the longest reading a partition's last messages may take
FIX = ("replay into fresh topics ([kafka] impressions_topic and clicks_topic), or rerun without --resume (which sends "
       "every event again)")


def run_fingerprint(defines: Mapping[str, Any]) -> str:
    """A short fingerprint (16 hex digits) of ``defines``: every setting that changes a replay's events or their
    order (dataclasses as their fields, a path as its file: :func:`_file_identity`), JSON-encoded with sorted keys."""
    text = orjson.dumps(dict(defines), option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=_file_identity)
    return hashlib.sha256(text).hexdigest()[:16]


def _file_identity(value: Any) -> Any:
    """orjson's ``default`` for :func:`run_fingerprint`: a :class:`Path` (an event log) stands for the file, its
    resolved path, size and mtime (a file changed since is another run; a digest would cost a large log a second
    read); anything else JSON cannot hold as its ``str``."""
    if isinstance(value, Path):
        stat = value.stat()
        return [str(value.resolve()), stat.st_size, stat.st_mtime_ns]
    return str(value)


_SEED, _M = np.uint32(0x9747B28C), np.uint32(0x5BD1E995)


def key_partitions(keys: np.ndarray, partitions: int) -> np.ndarray:
    """(N,) int32: the partition of each key (str, bytes, or None: as an empty key) among ``partitions``, as
    librdkafka's ``murmur2_random`` partitioner (the producer's, ``stream.kafka.producer_config``) and the Java
    client pick it: ``(murmur2(key) & 0x7fffffff) % partitions``. Column-wise: keys of one length at a time."""
    n = len(keys)
    if n == 0:
        return np.empty(0, np.int32)
    arr = pc.fill_null(pa.array(keys, pa.binary()), b"")
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    offsets = np.frombuffer(arr.buffers()[1], np.int32)[arr.offset:arr.offset + n + 1].astype(np.int64)
    data = np.frombuffer(arr.buffers()[2], np.uint8) if arr.buffers()[2] is not None else np.empty(0, np.uint8)
    lengths = np.diff(offsets)
    h_all = np.empty(n, np.uint32)
    with np.errstate(over="ignore"):
        shortest, longest = int(lengths.min()), int(lengths.max())
        for length in [shortest] if shortest == longest else np.unique(lengths).tolist():
            rows = np.arange(n) if shortest == longest else np.flatnonzero(lengths == length)
            if len(rows) == n:  # every key of one length (the usual case): the data is an (n, length) matrix
                b = data[offsets[0]:offsets[0] + n * length].reshape(n, length)
            else:
                b = data[offsets[rows, None] + np.arange(length)]
            h = np.full(len(rows), _SEED ^ np.uint32(length), np.uint32)
            body = length - length % 4
            words = np.ascontiguousarray(b[:, :body]).view("<u4") if body else np.empty((len(rows), 0), np.uint32)
            for i in range(body // 4):
                k = words[:, i].astype(np.uint32) * _M
                k ^= k >> np.uint32(24)
                k *= _M
                h = (h * _M) ^ k
            tail = length % 4
            if tail >= 3:
                h ^= b[:, body + 2].astype(np.uint32) << np.uint32(16)
            if tail >= 2:
                h ^= b[:, body + 1].astype(np.uint32) << np.uint32(8)
            if tail:
                h ^= b[:, body].astype(np.uint32)
                h = h * _M
            h ^= h >> np.uint32(13)
            h = h * _M
            h ^= h >> np.uint32(15)
            h_all[rows] = h
    return ((h_all & np.uint32(0x7FFFFFFF)) % np.uint32(partitions)).astype(np.int32)


def delivered_events(kafka: KafkaSettings, topic: str, shares: Mapping[int, np.ndarray],
                     keys_of: Callable[[np.ndarray], Sequence[bytes | None]],
                     values_of: Callable[[np.ndarray], Sequence[bytes | None]]) -> np.ndarray:
    """The events (positions in the replay order) ``topic`` holds already: of each partition's share (``shares``:
    partition -> the positions of the events sent there, in order) the prefix up to the position of its last
    message (module docstring). ``keys_of`` / ``values_of``: the message keys (as bytes) / values of positions."""
    held: list[np.ndarray] = []
    marks = watermarks(kafka, topic)
    trimmed = sorted(p for p, (low, high) in marks.items() if high > low > 0)
    if trimmed:
        log.warning("--resume: retention trimmed the start of topic %s partition(s) %s (low watermark > 0), so the "
                    "resume cannot verify there that the partition holds exactly the prefix of its share its last "
                    "messages end (rows the input gained or lost before them since the first run are not seen): "
                    "resume with the same input", topic, ", ".join(map(str, trimmed)))
    for p, (low, high) in sorted(marks.items()):
        share = shares.get(p, np.empty(0, np.int64))
        if high > low or (high > 0 and len(share)):  # (one trimmed empty held messages all the same: _held_in)
            held.append(share[:_held_in(kafka, topic, p, (low, high), share, keys_of, values_of)])
    return np.concatenate(held) if held else np.empty(0, np.int64)


def _held_in(kafka: KafkaSettings, topic: str, p: int, marks: tuple[int, int], share: np.ndarray,
             keys_of: Callable[[np.ndarray], Sequence[bytes | None]],
             values_of: Callable[[np.ndarray], Sequence[bytes | None]]) -> int:
    """How many events of ``share`` partition ``p`` of ``topic`` (watermarks ``marks``: it held messages) holds."""
    low, high = marks
    start = max(high - 1, low)  # where the tail was read from; each read back doubles what it spans
    tail = _read_from(kafka, topic, p, start) if high > low else []
    while not tail and start > low:  # its last offsets hold no record (a transaction's marker, aborted records)
        start = max(2 * start - high, low)
        tail = _read_from(kafka, topic, p, start)
    if not tail:  # (its low watermark now: retention may have trimmed it since they were read)
        low = watermarks(kafka, topic).get(p, marks)[0]
    if not tail and (low == 0 or not len(share)):  # records none of this replay's (markers, aborted), or none for it
        return 0
    if not tail:  # trimmed empty (retention, a delete of records), before or since its watermarks were read
        raise ConfigError(f"--resume: topic {topic} partition {p} held messages (offsets up to {high - 1}) but has "
                          f"none to read now (low watermark {low}: retention or a delete of records emptied it), so "
                          f"what this replay delivered there cannot be told: {FIX}")
    # nothing trimmed: offsets 0..last, contiguous (idempotent producer, no transactions); the last message read, not
    # the high watermark, which may lag
    count = tail[-1].offset() + 1 if low == 0 else None  # type: ignore[operator]  # a consumed record has its offset
    key = tail[-1].key()
    cands = np.array([c for c, k in enumerate(keys_of(share)) if k == key], np.int64)  # where the tail may end
    checked = 0  # the tail's newest messages the candidates were checked against
    while True:
        for i in range(checked, len(tail)):
            m, live = tail[-1 - i], np.flatnonzero(cands >= i)  # (before a candidate near the share's start: not ours)
            pos = share[cands[live] - i]
            bad = [k != m.key() or v != m.value() for k, v in zip(keys_of(pos), values_of(pos), strict=True)]
            cands = np.delete(cands, live[np.array(bad, bool)])
        checked = len(tail)
        where = f"topic {topic} partition {p} (offsets {tail[0].offset()}-{tail[-1].offset()})"
        if count is not None and count - 1 in cands:  # where its count puts it (repeated events told apart)
            return count
        if len(cands) == 1:
            if count is None:
                return int(cands[0]) + 1
            raise ConfigError(f"--resume: topic {topic} partition {p} holds {count} message(s) (offsets "
                              f"0-{count - 1}, nothing trimmed), so its last must be event {count - 1} (0-based) of "
                              f"this replay's events for that partition, but it matches event {int(cands[0])}: the "
                              "input changed since the first run (an event log that gained or lost rows earlier in "
                              "event time than the last delivered message) or others wrote to the partition: resume "
                              f"with the same input as the first run, or {FIX}")
        if not len(cands):
            raise ConfigError(f"--resume: the last {len(tail)} message(s) of {where}, the last with key {shown(key)}, "
                              "are not this replay's events for that partition (another data set or settings: "
                              "--limit, --seed, click delay, source settings, partition count; or another producer's), "
                              f"so what this replay delivered there cannot be told: {FIX}")
        if start <= low:
            raise ConfigError(f"--resume: the {len(tail)} message(s) of {where}, the whole partition, match "
                              f"{len(cands)} positions of this replay's events for it (repeated events), so what this "
                              f"replay delivered there cannot be told: {FIX}")
        # twice the offsets the last read spanned (by offsets: records a consumer skips are no reason to read the
        # same again; to the last message read: the high watermark may lag)
        start = max(2 * start - tail[-1].offset() - 1, low)  # type: ignore[operator]  # a consumed record's offset
        tail = _read_from(kafka, topic, p, start)


def _read_from(kafka: KafkaSettings, topic: str, p: int, offset: int) -> list[Message]:
    """The messages of ``topic`` partition ``p`` from ``offset`` to its end."""
    got: list[Message] = []
    read_to_end(kafka, topic, got.append, start={p: offset}, timeout_s=TAIL_READ_S)
    return got
