"""The ``samples`` topic: labelled samples as Arrow IPC record batches, many rows per message.

Schema version 2::

    impression_id   utf8              the impression this sample labels
    kind            int8              how final the label is (below); (impression_id, kind) is the dedup key
    ts              int64             impression event time, ms
    label           int8              1 clicked inside the attribution window, else 0 (for kind 1: so far)
    label_delay_ms  int64             click ts - impression ts (positives) / time waited (negatives)
    user_id         int64             stable_hash(raw user id)            see stream/ids.py
    item_id         int64             stable_hash(raw item id)
    history         list<int64>       the user's recently clicked items as of ``ts``, newest last
    ctx.<name>      int64             one categorical context feature, hashed
    ctx.<name>      list<int64>       one multi-valued context feature (genres), hashed
    dense.<name>    float32           one dense feature

The schema carries ``streamrec.schema=samples`` and ``streamrec.schema_version`` metadata. The
learner turns columns into tensors without per-row Python: ``history`` gives EmbeddingBag
``(values, offsets)`` straight from the Arrow list layout.

``kind`` is the joiner's emission policy speaking (``stream.joiner.config.EmissionPolicy``,
``learner/delayed.py`` for the learner's side):

- :data:`FINAL` (0): the label is final: the click came inside the window, or the window closed without
  one (policies ``wait`` and ``window``). One such sample per impression.
- :data:`OBSERVED` (1): the label as observed after waiting ``elapsed`` (``fake_negative``: 0, at once;
  ``es_dfm``: a few minutes). A 0 may turn out a fake negative: then a :data:`DELAYED_POSITIVE` follows.
- :data:`DELAYED_POSITIVE` (2): the click that came after an :data:`OBSERVED` 0, inside the window: the
  same impression again, label 1. An impression thus has one sample, or two with different kinds.

Version 1 (no ``kind`` column) still decodes, every row :data:`FINAL`.

Each message carries the header :data:`WATERMARK_HEADER`: the join watermark (``stream/joiner/engine.py``) of the
partition whose samples it holds (samples partition p = join partition p), int64 big-endian ms, after the batch that
made it on that batch's last message, before it on the others (:data:`NO_WATERMARK`: none yet). Every impression with
``ts + window <= watermark`` is closed: its delayed positive, if any, is in that message or an earlier one of the
partition (``learner/served.py`` waits for it by this; :func:`watermark_of` reads it).
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stream.errors import BadMessage, quoted, shown
from stream.events import MAX_TS_MS
from stream.limits import MAX_ABS_DENSE

SCHEMA_NAME = b"samples"
SCHEMA_VERSION = 2
READABLE_VERSIONS = (b"1", b"2")  # version 1 has no ``kind`` column: every row is FINAL
FINAL, OBSERVED, DELAYED_POSITIVE = 0, 1, 2
KINDS = (FINAL, OBSERVED, DELAYED_POSITIVE)
KIND_NAMES = {FINAL: "final", OBSERVED: "observed", DELAYED_POSITIVE: "delayed_positive"}
CTX_PREFIX = "ctx."
DENSE_PREFIX = "dense."

BASE_FIELDS: tuple[pa.Field, ...] = (
    pa.field("impression_id", pa.utf8(), nullable=False),
    pa.field("ts", pa.int64(), nullable=False),
    pa.field("label", pa.int8(), nullable=False),
    pa.field("label_delay_ms", pa.int64(), nullable=False),
    pa.field("user_id", pa.int64(), nullable=False),
    pa.field("item_id", pa.int64(), nullable=False),
    pa.field("history", pa.list_(pa.int64()), nullable=False),
)
KIND_FIELD = pa.field("kind", pa.int8(), nullable=False)
WATERMARK_HEADER = "streamrec-watermark"
NO_WATERMARK = -(1 << 63)  # the header's value before the join partition has a watermark: nothing closed yet
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # Arrow IPC: the continuation marker and a zero length
# Bounds on what one message may cost, checked before it is read. The joiner writes messages of at most
# ``[joiner] max_sample_bytes`` (900 KB) and never compresses an Arrow body, so an uncompressed body decodes to
# about its own size: the byte bound bounds the rows. A compressed body is refused before it is decompressed (6 KB
# of zstd held a 128 MiB history). List values (history, list context) cost the learner ~100 B each in training,
# so they are bounded on their own (a legitimate row has ~50 history ids and short context lists).
MAX_MESSAGE_BYTES = 16 << 20
MAX_LIST_VALUES = 1 << 20
_METADATA = {b"streamrec.schema": SCHEMA_NAME, b"streamrec.schema_version": str(SCHEMA_VERSION).encode()}


def watermark_header(watermark: int | None) -> tuple[str, bytes]:
    """The :data:`WATERMARK_HEADER` of a samples message (module docstring); None: :data:`NO_WATERMARK`."""
    return WATERMARK_HEADER, struct.pack(">q", NO_WATERMARK if watermark is None else watermark)


def watermark_of(headers: Sequence[tuple[str, bytes | None]] | None, window_ms: int = 0) -> int | None:
    """The watermark a samples message's headers carry (None: no such header, a joiner from before it). Raises
    :class:`BadMessage` (``bad_header``) for what the joiner never writes: one without a value or not of 8 bytes,
    or several (taken for no header, they sent the partition back to the click clock, ``learner/served.py``); and
    (``bad_value``) one past :data:`MAX_TS_MS` + ``window_ms`` (the attribution window: a drain's watermark is its
    newest event time + the window, ``stream/joiner/engine.py``)."""
    found = [v for k, v in headers or () if k == WATERMARK_HEADER]
    if len(found) > 1:
        raise BadMessage(f"{len(found)} {WATERMARK_HEADER} headers: the joiner writes one", kind="bad_header")
    if not found:
        return None
    value = found[0]
    if value is None or len(value) != 8:
        got = "no value" if value is None else f"{len(value)} bytes"
        raise BadMessage(f"a {WATERMARK_HEADER} header of {got}, expected 8 (int64 big-endian ms)", kind="bad_header")
    wm = int(struct.unpack(">q", value)[0])
    if wm > MAX_TS_MS + window_ms:  # past every event time the joiner takes (+ a drain's window): closes all for ever
        raise BadMessage(f"a {WATERMARK_HEADER} header of {wm} ms, past {MAX_TS_MS + window_ms} (no event time is, "
                         f"+ {window_ms} ms of attribution window)", kind="bad_value")
    return wm


def final_view(impression_ids: np.ndarray, labels: np.ndarray, kinds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(keep, final)``: each impression's first sample (``FINAL`` or ``OBSERVED``) and the label it ends with
    among these rows (1 if its ``DELAYED_POSITIVE`` is among them), for evaluating on a stretch of the topic.
    An ``OBSERVED`` 0 whose delayed positive comes after the stretch keeps its 0. Shapes ``(N,)``."""
    keep = kinds != DELAYED_POSITIVE
    final = np.asarray(labels).astype(np.int8, copy=True)
    late = kinds == DELAYED_POSITIVE
    if late.any():
        final[keep & np.isin(impression_ids, impression_ids[late])] = 1
    return keep, final


def _lists(values: Sequence[Sequence[int]] | tuple[np.ndarray, np.ndarray]) -> pa.ListArray:
    """A list<int64> from Python lists or from ``(flat_values, offsets)`` with offsets of length N+1."""
    if isinstance(values, tuple):
        flat, offsets = values
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, pa.int64()))
    return pa.array(values, pa.list_(pa.int64()))


@dataclass(frozen=True)
class SampleBatch:
    """A validated Arrow record batch of samples."""

    batch: pa.RecordBatch

    @classmethod
    def from_columns(
        cls,
        *,
        impression_id: Sequence[str],
        ts: np.ndarray,
        label: np.ndarray,
        label_delay_ms: np.ndarray,
        user_id: np.ndarray,
        item_id: np.ndarray,
        history: Sequence[Sequence[int]] | tuple[np.ndarray, np.ndarray],
        context: Mapping[str, np.ndarray | Sequence[Sequence[int]]] | None = None,
        dense: Mapping[str, np.ndarray] | None = None,
        kind: np.ndarray | None = None,
    ) -> SampleBatch:
        """``kind`` None: every row :data:`FINAL`."""
        arrays: list[pa.Array] = [
            pa.array(impression_id, pa.utf8()),
            pa.array(np.asarray(ts, np.int64)),
            pa.array(np.asarray(label, np.int8)),
            pa.array(np.asarray(label_delay_ms, np.int64)),
            pa.array(np.asarray(user_id, np.int64)),
            pa.array(np.asarray(item_id, np.int64)),
            _lists(history),
            pa.array(np.zeros(len(ts), np.int8) if kind is None else np.asarray(kind, np.int8)),
        ]
        fields = [*BASE_FIELDS, KIND_FIELD]
        for name, col in sorted((context or {}).items()):
            if isinstance(col, np.ndarray) and col.ndim == 1 and col.dtype != object:
                arr = pa.array(col.astype(np.int64, copy=False))
            else:
                arr = _lists(col)  # type: ignore[arg-type]
            arrays.append(arr)
            fields.append(pa.field(CTX_PREFIX + name, arr.type, nullable=False))
        for name, col in sorted((dense or {}).items()):
            arrays.append(pa.array(np.asarray(col, np.float32)))
            fields.append(pa.field(DENSE_PREFIX + name, pa.float32(), nullable=False))
        schema = pa.schema(fields, metadata=_METADATA)
        return cls(pa.RecordBatch.from_arrays(arrays, schema=schema))

    # -- codec -------------------------------------------------------------------------------
    def encode(self) -> bytes:
        """One Arrow IPC stream: the schema message, the record batch message, the end-of-stream marker, byte for byte
        what an ``ipc.new_stream`` writer writes, without the writer (a quarter less time for a 64-row message)."""
        return b"".join((self.batch.schema.serialize(), self.batch.serialize(), _END_OF_STREAM))

    @classmethod
    def decode(cls, raw: bytes | None) -> SampleBatch:
        """Decode one ``samples`` message; raises :class:`BadMessage` if it is not a valid v1/v2 sample batch.

        Valid means more than the schema: Arrow's full validation (list offsets ascending and inside
        their values, UTF-8), and every column inside the domain the joiner writes: non-empty impression
        ids, labels 0 or 1 (1 for a delayed positive), kinds 0-2 (a ``kind`` column of version 1 too),
        ``ts`` and ``label_delay_ms`` in ``[0, MAX_TS_MS]`` (event times, and a difference of two), ids and
        context values >= 0 (hashes), dense values finite and below ``MAX_ABS_DENSE`` in magnitude (the
        joiner passes any float32; the learner refuses what would overflow its optimizer). Whatever passes can
        be turned into tensors without an exception, and the learner's arithmetic on it (``ts +
        label_delay_ms``, delay rates, id lookups, squared gradients) cannot overflow or go negative.
        """
        if not raw:
            raise BadMessage("empty samples message", kind="empty")
        if len(raw) > MAX_MESSAGE_BYTES:
            raise BadMessage(f"samples message of {len(raw)} bytes, over the bound of {MAX_MESSAGE_BYTES}",
                             kind="too_large")
        _check_messages(raw)
        try:
            reader = pa.ipc.open_stream(pa.py_buffer(raw))
            batches = list(reader)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise BadMessage(f"not an Arrow IPC stream: {quoted(str(exc))}", kind="bad_arrow") from None
        meta = reader.schema.metadata or {}
        if meta.get(b"streamrec.schema") != SCHEMA_NAME:
            raise BadMessage("Arrow stream is not a streamrec samples batch (schema metadata missing)",
                             kind="bad_schema")
        version = meta.get(b"streamrec.schema_version")
        if version not in READABLE_VERSIONS:
            raise BadMessage(f"unsupported samples schema_version {version!r}, expected one of "
                             f"{', '.join(v.decode() for v in READABLE_VERSIONS)}", kind="bad_schema")
        if len(batches) != 1:
            raise BadMessage(f"expected one record batch per message, got {len(batches)}", kind="bad_schema")
        batch = batches[0]
        try:
            names = batch.schema.names
        except UnicodeDecodeError:
            raise BadMessage("a column name is not UTF-8", kind="bad_schema") from None
        if len(set(names)) != len(names):  # schema.field() / column() by name would raise KeyError
            # counted once (names.count per name was quadratic: a 16 MiB message holds ~280k columns, one named
            # twice held the reader ~30 minutes per decode, past worker_stall_s, at every restart)
            twice = sorted(n for n, k in Counter(names).items() if k > 1)
            raise BadMessage(f"column {shown(twice[0], 80)} appears more than once", kind="bad_schema")
        # Version 1 has no ``kind`` column; one there anyway is read (``kinds``), so it is checked as in version 2.
        with_kind = version != b"1" or KIND_FIELD.name in names
        for f in (*BASE_FIELDS, KIND_FIELD) if with_kind else BASE_FIELDS:
            got = batch.schema.field(f.name) if f.name in batch.schema.names else None
            if got is None or got.type != f.type:
                raise BadMessage(f"column {f.name!r}: got {got.type if got else 'nothing'}, expected {f.type}",
                                 kind="bad_schema")
        for f in batch.schema:
            if f.name.startswith(CTX_PREFIX) and f.type not in (pa.int64(), pa.list_(pa.int64())):
                raise BadMessage(f"column {f.name!r}: got {f.type}, expected int64 or list<int64>",
                                 kind="bad_schema")
            if f.name.startswith(DENSE_PREFIX) and f.type != pa.float32():
                raise BadMessage(f"column {f.name!r}: got {f.type}, expected float32", kind="bad_schema")
            if batch.column(f.name).null_count:
                raise BadMessage(f"column {f.name!r} has nulls", kind="bad_schema")
        try:
            batch.validate(full=True)
        except (pa.ArrowException, ValueError) as exc:
            raise BadMessage(f"invalid Arrow data: {quoted(str(exc))}", kind="bad_arrow") from None
        for f in batch.schema:  # the child as stored: flatten() aborts the process on some offsets validation allows
            if pa.types.is_list(f.type) and batch.column(f.name).values.null_count:
                raise BadMessage(f"column {shown(f.name, 80)} has nulls inside its lists", kind="bad_schema")
        values = sum(int(c.offsets[-1].as_py()) - int(c.offsets[0].as_py()) for f in batch.schema
                     if pa.types.is_list(f.type) for c in [batch.column(f.name)])
        if values > MAX_LIST_VALUES:
            raise BadMessage(f"{values} list values (history and list context), over the bound of {MAX_LIST_VALUES}",
                             kind="too_large")
        out = cls(batch)
        imp = batch.column("impression_id")
        if len(imp) and pc.min(pc.binary_length(imp)).as_py() == 0:  # the event decoder refuses an empty id
            raise BadMessage("column 'impression_id': empty impression ids", kind="bad_value")
        label, ts = out.column("label"), out.column("ts")
        if len(label) and not np.isin(label, (0, 1)).all():
            raise BadMessage("column 'label': values other than 0 and 1", kind="bad_value")
        for name, col in (("ts", ts), ("label_delay_ms", out.column("label_delay_ms"))):
            if len(col) and (col.min() < 0 or col.max() > MAX_TS_MS):
                raise BadMessage(f"column {name!r}: values outside [0, {MAX_TS_MS}] ms (min {col.min()}, "
                                 f"max {col.max()})", kind="bad_value")
        if with_kind:
            kinds = out.column("kind")
            if len(kinds) and not np.isin(kinds, KINDS).all():
                raise BadMessage(f"column 'kind': values other than {KINDS}", kind="bad_value")
            if len(kinds) and (label[kinds == DELAYED_POSITIVE] != 1).any():
                raise BadMessage("column 'kind': a delayed_positive row with label 0", kind="bad_value")
        # Hashed ids (stream/ids.py: BLAKE2b masked to 63 bits) and MISSING (0) are >= 0, in every id and context
        # column, scalar or list: a negative one has no row (IdMap refused it inside training, a crash per try).
        for name in ("user_id", "item_id", "history", *(CTX_PREFIX + n for n in out.context_names)):
            ids = out.lists(name)[0] if pa.types.is_list(batch.schema.field(name).type) else out.column(name)
            if len(ids) and ids.min() < 0:
                raise BadMessage(f"column {shown(name, 80)}: negative ids (hashed ids are >= 0)", kind="bad_value")
        for name in out.dense_names:
            col = out.column(DENSE_PREFIX + name)
            if not np.isfinite(col).all():
                raise BadMessage(f"column {DENSE_PREFIX + name!r}: values that are not finite", kind="bad_value")
            if len(col) and float(np.abs(col).max()) >= MAX_ABS_DENSE:
                raise BadMessage(f"column {DENSE_PREFIX + name!r}: |value| >= 2**64 (~1.8e19), whose square "
                                 f"overflows float32 in training; dense features must be scaled", kind="bad_value")
        return out

    # -- zero-copy access --------------------------------------------------------------------
    def __len__(self) -> int:
        return self.batch.num_rows

    def column(self, name: str) -> np.ndarray:
        """A primitive column as numpy (zero-copy where Arrow allows). Shape ``(N,)``."""
        return self.batch.column(name).to_numpy(zero_copy_only=False)

    def lists(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """A list<int64> column as ``(values (sum L,), offsets (N+1,))`` for ``nn.EmbeddingBag``."""
        col = self.batch.column(name)
        offsets = col.offsets.to_numpy()
        values = col.values.to_numpy()
        return values[offsets[0] : offsets[-1]], offsets - offsets[0]

    @property
    def kinds(self) -> np.ndarray:
        """``kind`` per row, shape ``(N,)`` int8 (all :data:`FINAL` for a version 1 batch)."""
        if "kind" not in self.batch.schema.names:
            return np.zeros(len(self), np.int8)
        return self.column("kind").astype(np.int8, copy=False)

    @property
    def impression_ids(self) -> list[str]:
        return self.batch.column("impression_id").to_pylist()

    @property
    def context_names(self) -> list[str]:
        return [n[len(CTX_PREFIX) :] for n in self.batch.schema.names if n.startswith(CTX_PREFIX)]

    @property
    def dense_names(self) -> list[str]:
        return [n[len(DENSE_PREFIX) :] for n in self.batch.schema.names if n.startswith(DENSE_PREFIX)]


# -- a look at the IPC messages' flatbuffer metadata before anything is read (format/Message.fbs) ----------------
def _check_messages(raw: bytes) -> None:
    """Raise :class:`BadMessage` for a dictionary batch or a record batch with Arrow body compression (the joiner
    writes neither), from the messages' metadata alone: a compressed body is refused before it is decompressed (a
    tiny message may decompress to gigabytes). What this cannot parse is left to the Arrow reader, which refuses
    it. (pyarrow does not expose a record batch's compression without reading it: its ``Message`` has the
    flatbuffer ``metadata``, where ``Message.header`` is a ``RecordBatch`` table whose field 3 is ``compression``.)"""
    try:
        messages = pa.ipc.MessageReader.open_stream(pa.py_buffer(raw))
        while True:
            try:
                m = messages.read_next_message()  # the body as a slice of raw, not decompressed
            except StopIteration:
                return
            if m.type == "dictionary":
                raise BadMessage("a dictionary batch: samples columns are never dictionary-encoded", kind="bad_schema")
            if m.type != "record batch":
                continue
            meta = m.metadata.to_pybytes()
            header = _field(meta, _offset(meta, 0), 2)  # Message.header (slot 1 is its union's type)
            if header is not None and _field(meta, _offset(meta, header), 3) is not None:  # RecordBatch.compression
                raise BadMessage("an Arrow body compressed with lz4/zstd: samples messages are never compressed "
                                 "(refused before decompressing)", kind="bad_arrow")
    except (pa.ArrowException, OSError, ValueError, struct.error):
        return  # not readable as IPC messages: open_stream says why


def _u(fmt: str, buf: bytes, pos: int) -> int:
    if pos < 0 or pos + struct.calcsize(fmt) > len(buf):
        raise ValueError("flatbuffer offset out of range")
    return int(struct.unpack_from(fmt, buf, pos)[0])


def _offset(buf: bytes, pos: int) -> int:
    """The table a flatbuffer uoffset at ``pos`` points to."""
    return pos + _u("<I", buf, pos)


def _field(buf: bytes, table: int, slot: int) -> int | None:
    """Where field ``slot`` of the flatbuffer table at ``table`` is stored, None if absent."""
    vtable = table - _u("<i", buf, table)
    size = _u("<H", buf, vtable)
    if 4 + 2 * slot + 2 > size:
        return None
    at = _u("<H", buf, vtable + 4 + 2 * slot)
    return table + at if at else None
