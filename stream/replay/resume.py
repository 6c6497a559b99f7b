"""Resuming a replay from what its topics hold (``streamrec replay --resume``).

The topics are the record of what was delivered (no side file to lose; it holds after a SIGKILL too):

- Every message a replay sends carries two headers: ``replay.run``, a short fingerprint of what defines the event
  sequence (:func:`run_fingerprint`: the data set and its file's size and mtime, ``--limit``, ``--seed``, the click
  delay, the synthetic and event-log settings, the topics' partition count; not the pace), and ``replay.seq``, the
  event's index in the replay order (decimal ASCII).
- The replay chooses each message's partition itself, the producer's partitioner over its key
  (:func:`key_partitions`: murmur2, as librdkafka's ``murmur2_random`` and the Java client pick; a message without a
  key, a raw malformed one, goes where an empty key does). So an event's partition is known before it is sent, and
  impressions and clicks of one impression id share a partition number.
- The idempotent producer delivers each partition's messages once and in order, so what a partition holds is a
  prefix of that partition's share of the replay order. :func:`delivered_seqs` reads each partition's last message
  (from its high watermark - 1 to its end: a broker whose high watermark lags by a record batch, Tansu, is read to the
  end all the same); :func:`already_delivered` marks every event whose seq is at or below that of the partition it
  goes to. A partition whose last message is not this run's (no replay headers, another fingerprint) is a
  :class:`~stream.errors.ConfigError` naming it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import Message

from stream.config import KafkaSettings
from stream.errors import BadMessage, ConfigError, shown
from stream.kafka import headers_of, read_to_end, watermarks

RUN_HEADER = "replay.run"
SEQ_HEADER = "replay.seq"
TAIL_READ_S = 60.0  # the longest reading the partitions' last messages may take


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


def _tail_seq(topic: str, partition: int, m: Message, run: str) -> int:
    """The ``replay.seq`` of ``m``, the last message of ``topic`` partition ``partition``; a ConfigError where it is
    not one of run ``run``'s."""
    where = f"topic {topic} partition {partition} (offset {m.offset()})"
    fix = ("replay into fresh topics ([kafka] impressions_topic and clicks_topic), or rerun without --resume (which "
           "sends every event again)")
    try:
        headers = dict(headers_of(m) or ())
    except BadMessage:
        headers = {}
    got_run, got_seq = headers.get(RUN_HEADER), headers.get(SEQ_HEADER)
    if got_run is None or got_seq is None or not got_seq.isdigit():
        raise ConfigError(f"--resume: the last message of {where} is not a replay's (no {RUN_HEADER}/{SEQ_HEADER} "
                          f"headers: key {shown(m.key())}), so what this replay delivered there cannot be told: {fix}")
    if got_run.decode("utf-8", "replace") != run:
        raise ConfigError(f"--resume: the last message of {where} is of another replay run ({RUN_HEADER} "
                          f"{shown(got_run.decode('utf-8', 'replace'))}; this run is {run}: another data set, "
                          f"--limit, --seed, click delay, source settings or partition count): {fix}")
    return int(got_seq)


def delivered_seqs(kafka: KafkaSettings, topics: list[str], partitions: int, run: str) -> dict[str, np.ndarray]:
    """Per topic, ``(partitions,)`` int64: the ``replay.seq`` of each partition's last message, -1 where it holds
    none (never written, or every record deleted). ConfigError where a last message is not run ``run``'s."""
    out: dict[str, np.ndarray] = {}
    for topic in topics:
        seqs = np.full(partitions, -1, np.int64)
        start = {p: max(high - 1, low, 0) for p, (low, high) in watermarks(kafka, topic).items() if high > low}
        last: dict[int, Message] = {}
        if start:
            read_to_end(kafka, topic, _keep_last(last), start=start, timeout_s=TAIL_READ_S)
        for p, m in sorted(last.items()):
            if p < partitions:
                seqs[p] = _tail_seq(topic, p, m, run)
        out[topic] = seqs
    return out


def _keep_last(last: dict[int, Message]) -> Callable[[Message], None]:
    """A reader's ``handle`` keeping each partition's last message read in ``last``."""
    def keep(m: Message) -> None:
        last[m.partition()] = m  # type: ignore[index]  # a consumed record has its partition
    return keep


def already_delivered(seq: np.ndarray, topic_kind: np.ndarray, partition: np.ndarray,
                      last: Mapping[int, np.ndarray]) -> np.ndarray:
    """(E,) bool: the events (their ``seq``, the kind of the topic each goes to, its partition) at or below the last
    seq delivered to that partition (``last``: topic kind -> per-partition last seq, -1 for none)."""
    bound = np.full(len(seq), -1, np.int64)
    for kind, seqs in last.items():
        mask = topic_kind == kind
        bound[mask] = seqs[partition[mask]]
    return seq <= bound
