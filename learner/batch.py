"""Sample batches (Arrow) -> the tensors one training step needs, without per-row Python.

Bags are laid out field-major: bag ``f * B + b`` holds field f of sample b, so the fused
``EmbeddingBag`` output ``(F * B, D)`` views as ``(F, B, D)``. Every column is already contiguous
per field in Arrow, so values and offsets are concatenations, not gathers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from learner.features import FeatureConfig
from stream.features import MISSING
from stream.samples import DENSE_PREFIX, SampleBatch


@dataclass
class TensorBatch:
    values: torch.Tensor  # (N,) int64: rows of the fused table, all fields, field-major
    offsets: torch.Tensor  # (F * B + 1,) int64: bag starts, include_last_offset layout
    dense: torch.Tensor  # (B, Dd) float32
    labels: torch.Tensor  # (B,) float32
    impression_ids: np.ndarray  # (B,) object
    ts: np.ndarray  # (B,) int64, impression event time
    # (partition, offset, rows) of every Kafka message the rows came from, in order
    positions: list[tuple[int, int, int]] = field(default_factory=list)
    # (N,) int64 hashed values behind ``values``, kept when the config is ``keyed``: the RowMapper
    # (learner/row_mapper.py) turns dynamic fields' into rows (until then ``values`` holds the buckets), the cold
    # tracker counts the users'
    keys: np.ndarray | None = None
    # (B,) int8 stream.samples kind of each row (FINAL / OBSERVED / DELAYED_POSITIVE); None: all FINAL
    kinds: np.ndarray | None = None
    # (B,) int64 the samples' label_delay_ms (a positive's click ts - impression ts); None: not read
    label_delay_ms: np.ndarray | None = None
    # samples partition -> the newest joiner watermark its messages here carry (stream/samples.py, learner/served.py)
    watermarks: dict[int, int] = field(default_factory=dict)
    # (counter, labels) -> what a DataLoader worker counted before handing this batch over, for the training process
    # to count (learner/worker_counters.py: a worker's own registry never reaches the learner's /metrics)
    worker_counts: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    # the DataLoader worker that read it (None: the training process), and whether it is that worker's last (its
    # reading ended): what the training process's bound on a hung worker goes by (learner/worker_stall.py)
    worker: int | None = None
    worker_done: bool = False
    # the samples partitions that worker reads now, those added since it started included (a rebalance, partitions
    # the topic gained): what the bound on a hung worker names for the operator (None: not said)
    worker_partitions: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def pin_memory(self) -> TensorBatch:
        self.values, self.offsets = self.values.pin_memory(), self.offsets.pin_memory()
        self.dense, self.labels = self.dense.pin_memory(), self.labels.pin_memory()
        return self

    def to(self, device: torch.device | str, non_blocking: bool = True) -> TensorBatch:
        return TensorBatch(self.values.to(device, non_blocking=non_blocking),
                           self.offsets.to(device, non_blocking=non_blocking),
                           self.dense.to(device, non_blocking=non_blocking),
                           self.labels.to(device, non_blocking=non_blocking),
                           self.impression_ids, self.ts, self.positions, self.keys, self.kinds, self.label_delay_ms,
                           self.watermarks)

    def select(self, keep: np.ndarray) -> TensorBatch:
        """Rows where ``keep`` (bool (B,)) is set, e.g. after dropping duplicates."""
        if keep.all():
            return self
        b = len(self)
        f = (len(self.offsets) - 1) // b
        offsets = self.offsets.numpy()
        starts, ends = offsets[:-1].reshape(f, b), offsets[1:].reshape(f, b)
        k = np.flatnonzero(keep)
        s, e = starts[:, k].ravel(), ends[:, k].ravel()  # (F * B',) field-major
        lengths = e - s
        new_offsets = np.zeros(len(s) + 1, np.int64)
        np.cumsum(lengths, out=new_offsets[1:])
        # Gather the kept value ranges without a Python loop: repeat each start over its length.
        idx = np.repeat(s - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])
        return TensorBatch(self.values[torch.from_numpy(idx)], torch.from_numpy(new_offsets),
                           self.dense[torch.from_numpy(k)], self.labels[torch.from_numpy(k)],
                           self.impression_ids[k], self.ts[k], self.positions,
                           None if self.keys is None else self.keys[idx],
                           None if self.kinds is None else self.kinds[k],
                           None if self.label_delay_ms is None else self.label_delay_ms[k], self.watermarks)


    def chunks(self, rows: int) -> list[TensorBatch]:
        """Consecutive pieces of at most ``rows`` rows (all of this batch's positions stay on the last)."""
        b = len(self)
        if rows <= 0 or b <= rows:
            return [self]
        out = []
        for start in range(0, b, rows):
            keep = np.zeros(b, bool)
            keep[start:start + rows] = True
            piece = self.select(keep)
            piece.positions = self.positions if start + rows >= b else []
            piece.watermarks = self.watermarks if start + rows >= b else {}
            out.append(piece)
        return out


def _field_values(batch: SampleBatch, col: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values (N_f,), lengths (B,))`` of one column; a scalar column has length 1 per row."""
    if not pa.types.is_list(batch.batch.schema.field(col).type):
        v = batch.column(col).astype(np.int64, copy=False)
        return v, np.ones(len(v), np.int64)
    values, offsets = batch.lists(col)
    return values.astype(np.int64, copy=False), np.diff(offsets).astype(np.int64)


def _without_missing(values: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A list-valued field's ``(values (N_f,), lengths (B,))`` without its MISSING values: an absent row (MISSING in
    a column of scalars) becomes an empty bag."""
    absent = values == MISSING  # (N_f,)
    if not absent.any():
        return values, lengths
    row = np.repeat(np.arange(len(lengths)), lengths)  # (N_f,) each value's row
    return values[~absent], lengths - np.bincount(row[absent], minlength=len(lengths))


def to_tensors(batch: SampleBatch, cfg: FeatureConfig, positions: list[tuple[int, int, int]] | None = None,
               ) -> TensorBatch:
    """One Arrow sample batch -> a TensorBatch. An absent feature is what serving encodes (``serving/features.py``)
    whatever the message's other rows hold: a single-valued field's :data:`~stream.features.MISSING` row, a
    list-valued field's empty bag (a zero embedding). Absent: the column missing from the message, or a row's
    MISSING (the joiner's value for a row without the key in a column other rows have, ``sample_rows.py``)."""
    b = len(batch)
    names = set(batch.batch.schema.names)
    all_values, all_keys, all_lengths = [], [], []
    for spec, (first, rows) in zip(cfg.fields, cfg.blocks, strict=True):
        if spec.name in names:
            v, lengths = _field_values(batch, spec.name)
            if spec.kind != "single":
                v, lengths = _without_missing(v, lengths)
        elif spec.kind == "single":
            v, lengths = np.full(b, MISSING, np.int64), np.ones(b, np.int64)
        else:
            all_lengths.append(np.zeros(b, np.int64))
            continue
        all_values.append(first + np.remainder(v, rows))  # hashed ids are >= 0: remainder is the bucket
        all_keys.append(v)
        all_lengths.append(lengths)
    values = np.concatenate(all_values) if all_values else np.zeros(0, np.int64)
    keys = (np.concatenate(all_keys) if all_keys else np.zeros(0, np.int64)) if cfg.keyed else None
    lengths = np.concatenate(all_lengths)  # (F * B,)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    dense = (np.stack([batch.column(DENSE_PREFIX + d).astype(np.float32) if DENSE_PREFIX + d in names
                       else np.zeros(b, np.float32) for d in cfg.dense], axis=1)
             if cfg.dense else np.zeros((b, 0), np.float32))
    return TensorBatch(
        values=torch.from_numpy(values), offsets=torch.from_numpy(offsets), dense=torch.from_numpy(dense),
        labels=torch.from_numpy(batch.column("label").astype(np.float32)),
        impression_ids=np.asarray(batch.impression_ids, dtype=object), ts=batch.column("ts"),
        positions=positions or [], keys=keys, kinds=kinds if (kinds := batch.kinds).any() else None,
        label_delay_ms=batch.column("label_delay_ms"),
    )


def concat(batches: list[TensorBatch], num_fields: int) -> TensorBatch:
    """Join batches into one, keeping the field-major bag layout (all of field 0, then field 1, ...)."""
    if len(batches) == 1:
        return batches[0]
    per_field_values: list[list[torch.Tensor]] = [[] for _ in range(num_fields)]
    per_field_keys: list[list[np.ndarray]] = [[] for _ in range(num_fields)]
    per_field_lengths: list[list[np.ndarray]] = [[] for _ in range(num_fields)]
    # A part without rows (a dead-lettered message's placeholder, a heartbeat) only brings its positions: it has
    # nothing to key or to delay, so it never takes the keys or label delays of the other parts' rows away.
    rows = [tb for tb in batches if len(tb)]
    with_keys = all(tb.keys is not None for tb in rows)
    for tb in batches:
        b = len(tb)
        if not b:
            continue
        offsets = tb.offsets.numpy()
        for f in range(num_fields):
            start, end = offsets[f * b], offsets[(f + 1) * b]
            per_field_values[f].append(tb.values[start:end])
            if with_keys:
                per_field_keys[f].append(tb.keys[start:end])  # type: ignore[index]
            per_field_lengths[f].append(np.diff(offsets[f * b:(f + 1) * b + 1]))
    lengths = np.concatenate([np.concatenate(ls) if ls else np.zeros(0, np.int64) for ls in per_field_lengths])
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    parts = rows or batches[:1]  # every part empty: one of them gives the (empty) columns their types
    return TensorBatch(
        values=torch.cat([v for vs in per_field_values for v in vs] or [parts[0].values[:0]]),
        offsets=torch.from_numpy(offsets),
        dense=torch.cat([tb.dense for tb in parts]), labels=torch.cat([tb.labels for tb in parts]),
        impression_ids=np.concatenate([tb.impression_ids for tb in parts]),
        ts=np.concatenate([tb.ts for tb in parts]),
        positions=[p for tb in batches for p in tb.positions],
        keys=(np.concatenate([k for ks in per_field_keys for k in ks]) if with_keys and rows else
              parts[0].keys if not rows else None),
        kinds=(None if all(tb.kinds is None for tb in parts) else
               np.concatenate([np.zeros(len(tb), np.int8) if tb.kinds is None else tb.kinds for tb in parts])),
        label_delay_ms=(None if any(tb.label_delay_ms is None for tb in parts) else
                        np.concatenate([tb.label_delay_ms for tb in parts])),  # type: ignore[misc]
        watermarks=_newest(tb.watermarks for tb in batches),
        worker_counts=dict(sum((Counter(tb.worker_counts) for tb in batches), Counter())),
    )


def _newest(watermarks: Iterable[dict[int, int]]) -> dict[int, int]:
    """Per partition, the newest of ``watermarks`` (a partition's watermark never goes back)."""
    out: dict[int, int] = {}
    for wm in watermarks:
        for part, t in wm.items():
            out[part] = max(out.get(part, t), t)
    return out
