"""The joiner's durable state: one record per processed batch and partition in a compacted topic.

Key ``"{partition}:{seq}:{part}"``, value = the :class:`~stream.joiner.engine.StateChunk` as JSON,
split into parts of at most ``MAX_RECORD_BYTES`` (Kafka's default message limit is 1 MB; part 0
carries everything but a share of the added impressions). A retired chunk gets a tombstone per part
(null value), so log compaction keeps the topic as small as the live state.
The record goes to the same partition number as the input partition it describes, and is written
after the batch's samples are acknowledged and before the batch's input offsets are acknowledged
to faust: committed offsets never run ahead of durable state. Events between the committed offset
and the chunk's offsets are skipped on redelivery (the chunk stores the last applied offsets).

This replaces a faust Table keyed by impression id: faust sends one changelog record per Table
write (25-35% of the join time here) and routes it by the *current* event, which batches of
``stream.take_events`` blur; a chunk per batch costs one record per partition per batch.
"""

from __future__ import annotations

import numpy as np
import orjson
import pyarrow as pa
from confluent_kafka import OFFSET_BEGINNING, Message

from stream.config import KafkaSettings
from stream.joiner.context_block import Column, ContextBlock
from stream.joiner.engine import Pending, StateChunk
from stream.joiner.sample_rows import encode_bounded, state_batch
from stream.kafka import read_to_end
from stream.samples import CTX_PREFIX, DENSE_PREFIX, SampleBatch


def state_topic(app_id: str) -> str:
    return f"{app_id}-join-state"


MAX_RECORD_BYTES = 900_000
_MAGIC = b"SRJ1"


def chunk_key(partition: int, seq: int, part: int = 0) -> bytes:
    return f"{partition}:{seq}:{part}".encode()


def _encode(c: StateChunk, added: list[Pending], head: bool) -> bytes:
    """``SRJ1`` + header length (4 bytes) + JSON header + the added impressions as an Arrow sample batch
    (columnar: histories and contexts cost their int64s, not their decimal text)."""
    header = orjson.dumps({
        "seq": c.seq,
        "joined": c.joined if head else [],
        "waiting": c.waiting if head else [],
        "max_ts": c.max_ts,
        "offsets": c.offsets,
        "max_ref_ts": c.max_ref_ts,
        "evicted": c.evicted if head else [],
        "unwaited": c.unwaited if head else [],
        "topic_max": c.topic_max,
    })
    # Without the histories: a sample's history is read from Redis whenever it goes out (pipeline._apply_all), and under
    # fake_negative every added impression has had one attached already (on ML-1M, 400 of each row's ~560 bytes).
    body = state_batch(added).encode() if added else b""
    return _MAGIC + len(header).to_bytes(4, "big") + header + body


def encode_chunk(c: StateChunk, max_bytes: int = MAX_RECORD_BYTES) -> list[bytes]:
    """The chunk as one or more records (parts), each at most ``max_bytes`` unless one impression is bigger."""
    return encode_bounded(c.added, lambda added, first: _encode(c, added, head=first), max_bytes)


def _decode_added(body: bytes, seq: int) -> list[Pending]:
    if not body:
        return []
    b = SampleBatch.decode(body)
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


def decode_chunk(raws: list[bytes]) -> StateChunk:
    """Join the parts of one chunk (part 0 first)."""
    headers, added = [], []
    for raw in raws:
        if raw[:4] != _MAGIC:
            raise ValueError(f"not a joiner state record (magic {raw[:4]!r})")
        n = int.from_bytes(raw[4:8], "big")
        headers.append(orjson.loads(raw[8:8 + n]))
        added.extend(_decode_added(raw[8 + n:], headers[-1]["seq"]))
    head = headers[0]
    return StateChunk(head["seq"], added, [tuple(j) for j in head["joined"]], [tuple(w) for w in head["waiting"]],
                      head["max_ts"], tuple(head["offsets"]), head["max_ref_ts"], list(head.get("evicted", [])),
                      [tuple(w) for w in head.get("unwaited", [])], tuple(head.get("topic_max", (None, None))))


def load_chunks(kafka: KafkaSettings, topic: str, partitions: list[int],
                timeout_s: float = 60.0) -> dict[int, tuple[list[StateChunk], dict[int, int]]]:
    """Read partitions of the state log to their end, all with one consumer. Per partition: the live
    chunks (tombstones applied) and the number of parts of each (by seq), which the writer needs to
    tombstone them later."""
    live: dict[int, dict[bytes, bytes]] = {p: {} for p in partitions}

    def apply(m: Message) -> None:
        part, key, value = int(m.partition() or 0), m.key() or b"", m.value()
        if value is None:
            live[part].pop(key, None)  # a tombstone
        else:
            live[part][key] = value

    read_to_end(kafka, topic, apply, start={p: OFFSET_BEGINNING for p in partitions}, timeout_s=timeout_s)
    out = {}
    for p, records in live.items():
        by_seq: dict[int, dict[int, bytes]] = {}
        for key, value in records.items():
            _, seq, part = key.decode().split(":")
            by_seq.setdefault(int(seq), {})[int(part)] = value
        chunks = [decode_chunk([parts[i] for i in sorted(parts)]) for parts in by_seq.values()]
        out[p] = (chunks, {seq: len(parts) for seq, parts in by_seq.items()})
    return out
