"""The joiner's durable state: one record per processed batch and partition in a compacted topic.

Key ``"{partition}:{seq}:{part}"``, value = the :class:`~stream.joiner.engine.StateChunk`, split into parts of
at most ``MAX_RECORD_BYTES`` (Kafka's default message limit is 1 MB). Every part carries the chunk's scalars
(seq, offsets, event times) and a share of its lists (clicks joined, clicks waiting, evictions, clicks given
up, the impressions added): none of them is bounded by the batch alone (a batch of orphan clicks with 256-character
ids made a 1.4 MB head part, over the producer's limit, which failed the batch and gave its clicks strikes), so each
list is split across parts like the impressions. A retired chunk gets a tombstone per part (null value), so log
compaction keeps the topic as small as the live state. Where the state topic takes less than ``MAX_RECORD_BYTES``,
the pipeline passes its smaller bound (it learns the topic's limit at start: ``pipeline.py``, "Message size").

A chunk's parts are not written at once: a process that stops between two parts leaves the first ones in the log
(the rest never written), and one that stops while retiring a chunk leaves its last parts (tombstones go in part
order). Every part therefore says how many parts its chunk has and which write it belongs to (``parts``, ``write``:
an id per :func:`encode_chunk` call), and a restore leaves out a chunk whose parts are not all there: a chunk
restored from part 0 alone claimed the whole batch's offsets (its records skipped when read again) without the
impressions of its other parts, which then never got a sample. Leaving it out is safe: the batch's input offsets
are committed only after every part was acknowledged, so a chunk being written is read again, and a chunk being
retired no longer mattered. Parts of an older write of the same seq (a batch written again after a failed flush,
in fewer parts) are left out the same way. Records without ``parts`` (written before it existed) are taken as they
are, except a chunk without its part 0: that one was being retired.

Fencing: a partition has one owner at a time only as far as the group knows. A member that stalls past its session
(a long GC pause, a swapping or stopped host) loses its partitions to another member, which restores them from this
log; the stalled one wakes with a batch in hand and finishes it, writing a chunk, before its next poll tells it the
partition is gone. Its chunk numbered ``seq`` as the new owner's next one was (both continue from the newest chunk in
the log), so a later restore read the new owner's chunk replaced by the stale one (compaction keeps the last record of
a key): clicks the new owner had joined or kept waiting were lost and their impressions went out labelled 0. There are
no broker transactions here, so each owner fences the seqs a stale writer could use: at every restore it writes a
claim (key ``"{partition}:claim"``) listing the ranges no chunk may come from, the newest ``[top + 1, top +
FENCE_SPAN]`` past the highest seq in the log (``top``), and numbers its own chunks from ``top + FENCE_SPAN + 1``. A
chunk in a fenced range (the stale writer's next seqs) is left out of every restore and removed by the one that
finds it. The claim keeps the last ``FENCED_KEEP`` ranges, so a writer stalled over many owners is still fenced off.
A batch that reads its partition again (``pipeline.JoinPipeline._reload``) is no new owner: it writes no claim and its
chunks keep their numbers; one that finds its next seq used or fenced off by another owner fails, unwritten.
Not fenced: the stale writer's samples (duplicates of the batch the new owner does again, both joining the same
input from the same state: the same labels unless the two cut the input into batches at other places, where a click
later than ``allowed_lateness`` one took as late the other may join, or the reverse) and its tombstones (those
retire chunks whose impressions it emitted), and a member that stalls between reading the log and writing its claim
(a claim of its own, later, would drop the newer owner's ranges). A joiner older than the claim cannot read a log
that has one (a ``StateLogError`` naming the key).

The record goes to the same partition number as the input partition it describes, and is written
after the batch's samples are acknowledged and before the batch's input offsets are acknowledged
to faust: committed offsets never run ahead of durable state. Events between the committed offset
and the chunk's offsets are skipped on redelivery (the chunk stores the last applied offsets).
Those offsets are of the input topics the chunk names by topic id (``topic_ids``, where the broker gives ids): a
restore onto a topic of that name made again reads it from its first record (``pipeline.JoinPipeline._follow_topics``).

This replaces a faust Table keyed by impression id: faust sends one changelog record per Table
write (25-35% of the join time here) and routes it by the *current* event, which batches of
``stream.take_events`` blur; a chunk per batch costs one record per partition per batch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import orjson
import pyarrow as pa
from confluent_kafka import OFFSET_BEGINNING, Message

from stream.config import DURATION_CAP_S, KafkaSettings
from stream.errors import StreamError, quoted, shown
from stream.events import MAX_TS_MS
from stream.joiner.config import state_topic as state_topic  # (defined with app_id, which names it)
from stream.joiner.context_block import Column, ContextBlock
from stream.joiner.engine import Pending, StateChunk
from stream.joiner.sample_rows import encode_bounded, state_batch
from stream.kafka import read_to_end
from stream.samples import BASE_FIELDS, CTX_PREFIX, DENSE_PREFIX, KIND_FIELD, SampleBatch

log = logging.getLogger("streamrec.join")


MAX_RECORD_BYTES = 900_000
_MAGIC = b"SRJ1"
_COUNT_ROOM = 64  # bytes kept free in each part for the "parts" and "write" fields, added once the parts are known


class StateLogError(StreamError):
    """A record of the joiner's state log that cannot be read: the partition it describes cannot be restored."""


def chunk_key(partition: int, seq: int, part: int = 0) -> bytes:
    return f"{partition}:{seq}:{part}".encode()


FENCE_SPAN = 1 << 16  # seqs fenced off past the log's highest at each claim: far more than a stale writer's batches
FENCED_KEEP = 64  # fenced ranges a claim keeps (one per owner change)
_SEQ_MAX = (1 << 63) - 1  # a chunk's seq is an int64 (the header check, _check)
Fenced = list[tuple[int, int]]  # inclusive seq ranges no chunk may come from, oldest first


def claim_key(partition: int) -> bytes:
    return f"{partition}:claim".encode()


def encode_claim(fenced: Fenced, topics: tuple[str | None, str | None] = (None, None),
                 emission: Mapping[str, int | str] | None = None) -> bytes:
    """``topics``: the input topic ids the claiming owner reads (``PartitionLog.followed``); left out when unknown.
    ``emission``: the settings its chunks are written under (``JoinConfig.emission``, ``PartitionLog.emission``)."""
    ids = {"topics": list(topics)} if any(topics) else {}
    return orjson.dumps({"fenced": [[lo, hi] for lo, hi in fenced], **ids, **(emission or {})})


def _decode_claim(value: bytes) -> Fenced:
    return _read_claim(value)[0]


def _read_claim(value: bytes) -> tuple[Fenced, tuple[str | None, str | None], dict[str, int | str]]:
    """A claim record's fenced ranges, the input topic ids and the emission settings its owner wrote (None and those
    absent where a joiner before them wrote it), each checked: a ValueError (or the JSON's own) names the damage."""
    claim = orjson.loads(value)
    ranges = claim["fenced"]
    fenced = [(int(lo), int(hi)) for lo, hi in ranges]
    if any(type(v) is not int for pair in ranges for v in pair) or any(lo > hi for lo, hi in fenced):
        raise ValueError(f"fenced ranges must be [low, high] pairs of integers, got {shown(ranges, 200)}")
    topics = claim.get("topics", [None, None])
    if not _pair(topics, lambda t: t is None or type(t) is str):
        raise ValueError(f"topics must be [impressions, clicks] topic ids or null, got {shown(topics, 200)}")
    policy = claim.get("policy")
    if policy is not None and type(policy) is not str:
        raise ValueError(f"policy must be an emission policy's name, got {shown(policy, 200)}")
    emission: dict[str, int | str] = {} if policy is None else {"policy": policy}
    for name in _EMISSION_MS:
        if (ms := claim.get(name)) is not None:
            if type(ms) is not int or ms < 0:
                raise ValueError(f"{name} must be an integer of milliseconds >= 0, got {shown(ms, 200)}")
            emission[name] = ms
    return fenced, (topics[0], topics[1]), emission


_EMISSION_MS = ("window_ms", "lateness_ms", "elapsed_ms")  # a claim's emission settings besides its policy


def claimed_top(log: PartitionLog) -> int:
    """The highest seq ``log``'s partition has used or fenced off: an owner's next chunk comes past it, or another
    owner has restored the partition since (``pipeline.JoinPipeline.restore``, a reload)."""
    return max([log.top, *(hi for _, hi in log.fenced)])


def next_claim(log: PartitionLog, topics: tuple[str | None, str | None] = (None, None),
               emission: Mapping[str, int | str] | None = None) -> tuple[bytes, int]:
    """The claim a new owner of ``log``'s partition writes (reading the input topics of ids ``topics``, emitting
    under the settings ``emission``), and the seq its first chunk takes (module docstring, "Fencing")."""
    top = claimed_top(log)
    start = top + FENCE_SPAN + 1
    return encode_claim([*log.fenced, (top + 1, start - 1)][-FENCED_KEEP:], topics, emission), start


_LISTS = ("joined", "waiting", "evicted", "unwaited")  # the chunk's lists in the header, in item order (then added)


def _encode(c: StateChunk, items: range, bounds: list[int]) -> bytes:
    """``SRJ1`` + header length (4 bytes) + JSON header + the added impressions as an Arrow sample batch
    (columnar: histories and contexts cost their int64s, not their decimal text). ``items``: the chunk's items this
    part holds, numbered over its lists in ``_LISTS`` order and then its added impressions (``bounds``: where each
    starts, and the end)."""
    lo, hi = items.start, items.stop

    def share(k: int, seq: list[Any]) -> list[Any]:
        start = bounds[k]
        return seq[max(lo - start, 0):max(min(hi, bounds[k + 1]) - start, 0)]

    header = orjson.dumps({
        "seq": c.seq,
        "joined": share(0, c.joined),
        "waiting": share(1, c.waiting),
        "max_ts": None if c.max_ts is None else c.max_ts - 1,  # the watermark + lateness (``_chunk``)
        "offsets": c.offsets,
        "max_ref_ts": c.max_ref_ts,
        "evicted": share(2, c.evicted),
        "unwaited": share(3, c.unwaited),
        "topic_max": c.topic_max,
        "topic_top": c.topic_top,
        # Only where the broker gave an id: without one the chunk is as before, and a joiner rolled back reads it
        **({"topic_ids": c.topic_ids} if any(c.topic_ids) else {}),
        **({"snapshot": True} if c.snapshot else {}),  # (a joiner before it refuses the log, naming the field)
    })
    # Without the histories: a sample's history is read from Redis whenever it goes out (pipeline._apply_all), and under
    # fake_negative every added impression has had one attached already (on ML-1M, 400 of each row's ~560 bytes).
    added = share(4, c.added)
    body = state_batch(added).encode() if added else b""
    return _MAGIC + len(header).to_bytes(4, "big") + header + body


def encode_chunk(c: StateChunk, max_bytes: int = MAX_RECORD_BYTES,
                 oversized: Callable[[Pending, int], None] | None = None) -> list[bytes]:
    """The chunk as one or more records (parts), each at most ``max_bytes`` unless one impression is bigger; each
    part names the number of parts and this write (module docstring). ``oversized(pending, size)``, when given, is
    told of each added impression whose part alone is over ``max_bytes`` (its encoded size), and that part is left
    out: the caller then has a chunk without it and must not write it as it is (the joiner takes the impression out of
    the batch and joins the batch again, ``pipeline.py``). Any other item is small (ids are bounded by the
    ``[limits]``) and stays."""
    bounds = [0]
    for seq in (c.joined, c.waiting, c.evicted, c.unwaited, c.added):
        bounds.append(bounds[-1] + len(seq))

    def too_large(items: range, value: bytes) -> bool:
        if oversized is None or items.start < bounds[4]:
            return False
        oversized(c.added[items.start - bounds[4]], len(value) + _COUNT_ROOM)
        return True

    parts = encode_bounded(range(bounds[-1]), lambda items, _first: _encode(c, items, bounds),  # type: ignore[arg-type]
                           max_bytes - _COUNT_ROOM, oversized=too_large)  # type: ignore[arg-type]
    tail = b',"parts":%d,"write":"%s"}' % (len(parts), os.urandom(4).hex().encode())
    out = []
    for raw in parts:
        n = int.from_bytes(raw[4:8], "big")
        header = raw[8:8 + n - 1] + tail  # the JSON object's closing brace replaced by the two fields and one
        out.append(_MAGIC + len(header).to_bytes(4, "big") + header + raw[8 + n:])
    return out


def _split(raw: bytes) -> tuple[dict[str, Any], bytes]:
    """A part's header and body."""
    if raw[:4] != _MAGIC:
        raise ValueError(f"not a joiner state record (magic {raw[:4]!r}, expected {_MAGIC!r})")
    n = int.from_bytes(raw[4:8], "big")
    if len(raw) < 8 + n:
        raise ValueError(f"truncated: a header of {n} bytes in a record of {len(raw)}")
    header = orjson.loads(raw[8:8 + n])
    if not isinstance(header, dict):
        raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    return header, raw[8 + n:]


def _int64(v: Any) -> bool:
    return type(v) is int and -(1 << 63) <= v < 1 << 63  # (not a bool; the engine keeps times and offsets in int64s)


# The times a joiner writes: an event's (stream/events.py: [0, MAX_TS_MS]), and the event time a drain moves past them
# (at most a window and the lateness later, each at most DURATION_CAP_S; the header's max_ts is 1 ms short, -1 before
# any event). Any int64 was taken: a forged max_ts or click time of int64 max restored, the drain then wrote a chunk
# past int64, and the next restore refused the joiner's own record (the partition blocked until a human came).
_LAST_CLOCK_MS = MAX_TS_MS + 2 * int(DURATION_CAP_S * 1000) + 1


def _event_ts(v: Any) -> bool:
    return type(v) is int and 0 <= v <= MAX_TS_MS


def _clock_ts(v: Any) -> bool:
    return type(v) is int and -1 <= v <= _LAST_CLOCK_MS


def _pair(v: Any, ok: Callable[[Any], bool]) -> bool:
    return type(v) is list and len(v) == 2 and all(map(ok, v))


def _clicks(v: Any) -> bool:
    return type(v) is list and all(type(c) is list and len(c) == 2 and type(c[0]) is str and _event_ts(c[1]) for c in v)


_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {  # name -> (what it must be, the check); fields added since
    "offsets": ("[impressions, clicks] offsets", lambda v: _pair(v, _int64)),
    "max_ts": (f"a time in [-1, {_LAST_CLOCK_MS}] or null", lambda v: v is None or _clock_ts(v)),
    "max_ref_ts": (f"a time in [-1, {_LAST_CLOCK_MS}]", _clock_ts),
    "joined": (f"a list of [impression id, click time in [0, {MAX_TS_MS}]]", _clicks),
    "waiting": (f"a list of [impression id, click time in [0, {MAX_TS_MS}]]", _clicks),
    "unwaited": (f"a list of [impression id, click time in [0, {MAX_TS_MS}]]", _clicks),
    "evicted": ("a list of impression ids", lambda v: type(v) is list and all(type(i) is str for i in v)),
    "topic_max": (f"[impressions, clicks] times in [0, {MAX_TS_MS}] or null",
                  lambda v: _pair(v, lambda t: t is None or _event_ts(t))),
    "topic_top": (f"[impressions, clicks] lists of times in [0, {MAX_TS_MS}]",
                  lambda v: _pair(v, lambda t: type(t) is list and all(map(_event_ts, t)))),
    "topic_ids": ("[impressions, clicks] topic ids (strings) or null",
                  lambda v: _pair(v, lambda t: t is None or type(t) is str)),
    "parts": ("a count of at least 1", lambda v: type(v) is int and v >= 1),
    "write": ("a string", lambda v: type(v) is str),
    "snapshot": ("true", lambda v: v is True),
}
_OPTIONAL = {"joined", "waiting", "unwaited", "evicted", "topic_max", "topic_top", "topic_ids", "parts",  # (older
             "write", "snapshot"}  # writers; topic_ids where the broker gives no id; snapshot where not one)


def _check(header: dict[str, Any], seq: int) -> None:
    """Raise ValueError naming the first field of a part's header that is not as :func:`encode_chunk` writes it: a
    restore that took it (``"12"`` as ``topic_top``, a string as a list of clicks) rebuilt another state, or failed
    later naming no record. A field this version does not know (a newer joiner's) is refused too: it is state the
    restore would drop in silence (joiners before ``parts`` took a chunk's part 0 alone as the whole chunk)."""
    unknown = sorted(k for k in header if k != "seq" and k not in _FIELDS)
    if unknown:
        raise ValueError(f"header field {shown(unknown[0], 100)} is unknown to this version: a newer streamrec "
                         "joiner wrote it (state this one cannot restore)")
    if header.get("seq") != seq or not _int64(header.get("seq")):
        raise ValueError(f"header field 'seq' must be its key's seq {seq}, got {shown(header.get('seq'), 100)}")
    for name, (want, ok) in _FIELDS.items():
        if name in header or name not in _OPTIONAL:
            if not ok(header.get(name)):
                raise ValueError(f"header field {name!r} must be {want}, got {shown(header.get(name), 100)}")


def _decode_added(body: bytes, seq: int) -> list[Pending]:
    if not body:
        return []
    b = SampleBatch.decode(body)
    known = {f.name for f in (*BASE_FIELDS, KIND_FIELD)}
    if unknown := [n for n in b.batch.schema.names if n not in known and not n.startswith((CTX_PREFIX, DENSE_PREFIX))]:
        raise ValueError(f"the added impressions' column {shown(unknown[0], 100)} is unknown to this version: a "
                         "newer streamrec joiner wrote it (state this one cannot restore)")
    ctx: dict[str, Column] = {}
    for name in b.context_names:
        col = b.batch.column(CTX_PREFIX + name)
        if isinstance(col, pa.ListArray):  # a list column: (flat (V,) int64, offsets (N + 1,) int32 from 0)
            offsets = col.offsets.to_numpy()
            ctx[name] = col.values.to_numpy()[offsets[0]:offsets[-1]], (offsets - offsets[0]).astype(np.int32)
        else:
            ctx[name] = col.to_numpy()
    contexts = ContextBlock(ctx, b.batch.num_rows).rows()  # the chunk's contexts stay columns
    dense = {name: b.column(DENSE_PREFIX + name).tolist() for name in b.dense_names}
    return [
        Pending(imp_id, ts, user, item, context, {k: v[i] for k, v in dense.items()}, seq)
        for i, (imp_id, ts, user, item, context) in enumerate(zip(
            b.impression_ids, b.column("ts").tolist(), b.column("user_id").tolist(), b.column("item_id").tolist(),
            contexts, strict=True))
    ]


def _chunk(parts: list[tuple[dict[str, Any], bytes]]) -> StateChunk:
    """One chunk from its parts' (header, body), part 0 first: its lists joined over the parts."""
    head = parts[0][0]
    added: list[Pending] = []
    for header, body in parts:
        added.extend(_decode_added(body, header["seq"]))

    def joined_lists(name: str) -> list[Any]:
        return [item for header, _ in parts for item in header.get(name, ())]

    # The header's max_ts is the watermark + lateness, as every joiner wrote it: the engine's is 1 ms more since its
    # watermark became max_ts - lateness - 1. Read as the engine's, a chunk of the joiner before (a rolling upgrade)
    # restored a watermark 1 ms short of what it had closed, which then went out twice; and that joiner, reading ours,
    # took 1 ms more as closed than we had closed, which it never sent.
    max_ts = None if head["max_ts"] is None else head["max_ts"] + 1
    return StateChunk(head["seq"], added, list(map(tuple, joined_lists("joined"))),
                      list(map(tuple, joined_lists("waiting"))), max_ts, tuple(head["offsets"]),
                      head["max_ref_ts"], list(joined_lists("evicted")), list(map(tuple, joined_lists("unwaited"))),
                      tuple(head.get("topic_max", (None, None))),
                      tuple(list(map(int, t)) for t in head.get("topic_top", ([], []))),  # type: ignore[arg-type]
                      tuple(head.get("topic_ids", (None, None))),  # type: ignore[arg-type]
                      snapshot=head.get("snapshot", False))


def decode_chunk(raws: list[bytes]) -> StateChunk:
    """Join the parts of one chunk (part 0 first)."""
    parts = [_split(raw) for raw in raws]
    for header, _ in parts:
        _check(header, parts[0][0].get("seq"))  # type: ignore[arg-type]
    return _chunk(parts)


class PartitionLog(NamedTuple):
    """What :func:`load_chunks` read of one partition of the state log."""

    chunks: list[StateChunk]  # the live, complete chunks (tombstones applied)
    parts: dict[int, int]  # seq -> how many part keys it has in the log (all of them to tombstone when retired)
    incomplete: dict[int, list[int]]  # seq -> the part numbers in the log of a chunk left out, not all there
    fenced: Fenced = []  # the claim's fenced ranges (module docstring, "Fencing"); [] without a claim
    fenced_out: dict[int, list[int]] = {}  # seq -> the part numbers in the log of a chunk in a fenced range
    top: int = -1  # the highest seq of any chunk record in the log (left out or not); -1 when none
    # The input topic ids the claim's owner read: a change to them was followed, the strikes of the topic before
    # dropped (``pipeline.JoinPipeline._follow_topics``); (None, None) without a claim or from a joiner before them
    followed: tuple[str | None, str | None] = (None, None)
    # The emission settings the claim's owner wrote its chunks under (JoinConfig.emission): {} without a claim, those
    # a joiner before them did not record left out (the policy alone, or nothing)
    emission: dict[str, int | str] = {}


def _whole(parts: dict[int, tuple[dict[str, Any], bytes]]
           ) -> tuple[list[tuple[dict[str, Any], bytes]] | None, str]:
    """The parts that make a chunk, part 0 first; None (and why) when they are not all there."""
    head = parts.get(0)
    if head is None:
        return None, "its part 0 is gone: the process stopped while retiring it"
    n, write = head[0].get("parts"), head[0].get("write")
    if n is None:  # written before parts were counted: whatever is there
        return [parts[i] for i in sorted(parts)], ""
    # Of the parts there (never counted up to ``n``: a head naming 2**62 parts made a list that long)
    have = sorted(i for i, part in parts.items() if i < n and part[0].get("write") == write)
    if len(have) < n:
        return None, f"parts {shown(have, 200)} of {n} are in the log: the process stopped while writing it"
    return [parts[i] for i in have], ""


def load_chunks(kafka: KafkaSettings, topic: str, partitions: list[int],
                stall_s: float = 60.0) -> dict[int, PartitionLog]:
    """Read partitions of the state log to their end, all with one consumer (see :class:`PartitionLog`), for as long
    as records keep coming (a ``TimeoutError`` only when none and no end came for ``stall_s``: a log that compaction
    has not cleaned yet can take minutes to read, and a fixed bound on the whole read made its restore fail at every
    start, for good; ``stream.kafka.read_to_end``). A chunk
    whose parts are not all there is left out and logged (module docstring); a record that cannot be read raises
    :class:`StateLogError` naming it (the partition cannot be restored without it)."""
    live: dict[int, dict[bytes, tuple[int, bytes]]] = {p: {} for p in partitions}

    def apply(m: Message) -> None:
        part, key, value = int(m.partition() or 0), m.key() or b"", m.value()
        if value is None:
            live[part].pop(key, None)  # a tombstone
        else:
            live[part][key] = (int(m.offset() or 0), value)

    read_to_end(kafka, topic, apply, start={p: OFFSET_BEGINNING for p in partitions}, timeout_s=None, stall_s=stall_s)
    out = {}
    for p, records in live.items():
        by_seq: dict[int, dict[int, tuple[dict[str, Any], bytes]]] = {}
        where: dict[int, int] = {}  # seq -> offset of a record of it, for an error about the chunk
        fenced: Fenced = []
        followed: tuple[str | None, str | None] = (None, None)
        emission: dict[str, int | str] = {}
        raw_parts: dict[int, list[tuple[int, bytes, int]]] = {}  # seq -> (part, value, offset): read after the claim
        for key, (offset, value) in records.items():
            try:
                if key == claim_key(p):
                    fenced, followed, emission = _read_claim(value)
                    continue
                _, seq_text, part_text = key.decode().split(":")
                seq, part = int(seq_text), int(part_text)
                if min(seq, part) < 0 or key != chunk_key(p, seq, part):  # ("5:0:0", "0:00:0": two keys, one part)
                    raise ValueError(f"not a chunk key of partition {p} (\"{p}:<seq>:<part>\", plain decimals)")
                raw_parts.setdefault(seq, []).append((part, value, offset))
            except Exception as exc:  # noqa: BLE001 - whatever the damage, it is named with the record
                raise _unreadable(topic, p, key, offset, exc) from exc
            where[seq] = offset
        fenced_out: dict[int, list[int]] = {}
        for seq, values in raw_parts.items():
            if any(lo <= seq <= hi for lo, hi in fenced):  # a stale owner's, written after the partition moved on
                fenced_out[seq] = sorted(part for part, _, _ in values)
                log.warning("state log %s partition %d: chunk %d is in a range fenced off by a later owner (it was "
                            "written by a member that had lost the partition: a stall past its session); left out "
                            "of the restore and removed", topic, p, seq)
                continue
            for part, value, offset in values:
                try:
                    by_seq.setdefault(seq, {})[part] = header_body = _split(value)
                    _check(header_body[0], seq)
                except Exception as exc:  # noqa: BLE001
                    raise _unreadable(topic, p, chunk_key(p, seq, part), offset, exc) from exc
        chunks: list[StateChunk] = []
        incomplete: dict[int, list[int]] = {}
        for seq, parts in by_seq.items():
            try:
                whole, why = _whole(parts)
                if whole is not None:
                    chunks.append(_chunk(whole))
            except Exception as exc:  # noqa: BLE001
                raise _unreadable(topic, p, chunk_key(p, seq), where[seq], exc) from exc
            if whole is None:
                incomplete[seq] = sorted(parts)
                log.warning("state log %s partition %d: chunk %d is incomplete (%s); left out of the restore (a "
                            "chunk being written was not committed and its batch is read again; one being retired "
                            "no longer mattered)", topic, p, seq, why)
        out[p] = plog = PartitionLog(chunks, {seq: max(parts) + 1 for seq, parts in by_seq.items()}, incomplete,
                                     fenced, fenced_out, max(raw_parts, default=-1), followed, emission)
        if (top := claimed_top(plog)) > _SEQ_MAX - FENCE_SPAN - 1:  # a new owner's first chunk would be past int64
            key = claim_key(p) if top > plog.top else chunk_key(p, top)
            raise _unreadable(topic, p, key, records[key][0] if key in records else where[top], ValueError(
                f"seq {top} leaves a new owner no int64 seq for its chunks (past {top} + {FENCE_SPAN})"))
    return out


def _unreadable(topic: str, partition: int, key: bytes, offset: int, exc: BaseException) -> StateLogError:
    return StateLogError(
        f"state log {topic} partition {partition}: the record {shown(key)} (offset {offset}, or a part of its chunk) "
        f"cannot be read ({type(exc).__name__}: {quoted(str(exc), 200)}); the join state of input partition "
        f"{partition} cannot be restored without it. It was not written by this version of streamrec or was damaged: "
        "run the version that wrote it, or accept losing what it held (the impressions it added get no further "
        "sample) by writing a tombstone (a null value) for that key to the topic")
