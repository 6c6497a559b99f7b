"""Counters a DataLoader worker increments, counted by the training process.

With ``num_workers > 0`` the samples reader (``learner/kafka_dataset.py``) runs in DataLoader worker processes, and
what it counts there (a dead letter, ``stream/dlq.py``; records lost to retention, ``stream/retention.py``) lands in
the worker's copy of the Prometheus registry, which the learner's /metrics (the training process's) never serves:
none of it was ever exported. The reader's increments stay where they are made; a worker's :class:`WorkerTally`
takes what its counters in :data:`WORKER_COUNTERS` gained since the batch before and hands it over with each batch
(``TensorBatch.worker_counts``), and the training process counts it (:func:`count_worker_counters`). One mechanism for
every counter the reader increments: a counter it comes to increment is added to :data:`WORKER_COUNTERS`, nothing
else. Without workers the reader runs in the training process, nothing is tallied and each increment counts once.

Exact: an increment rides on the first batch its worker yields after it (a dead letter's own batch, the zero-row
batch of a loss at a start), and a worker that dies before handing it over dies with its registry.
"""

from __future__ import annotations

from prometheus_client import Counter

from learner.batch import TensorBatch
from stream.metrics import DLQ_MESSAGES, INPUT_LOST

# Every counter the samples reader increments (a worker's tally diffs these; the training process counts them)
WORKER_COUNTERS: tuple[Counter, ...] = (DLQ_MESSAGES, INPUT_LOST)
_BY_NAME = {family.name: c for c in WORKER_COUNTERS for family in c.describe()}  # family name (no _total) -> counter

# (family name, its labels as (name, value) pairs) -> the value counted: a key the batch carries across processes
Key = tuple[str, tuple[tuple[str, str], ...]]


def _values() -> dict[Key, float]:
    """What :data:`WORKER_COUNTERS` hold in this process, per labelled series (their ``_total`` samples)."""
    return {(family.name, tuple(sorted(s.labels.items()))): s.value
            for counter in WORKER_COUNTERS for family in counter.collect()
            for s in family.samples if s.name.endswith("_total")}


class WorkerTally:
    """In a DataLoader worker: what :data:`WORKER_COUNTERS` gained since the last :meth:`take` (or since this worker
    started reading: what it inherited from the training process at the fork is not its own)."""

    def __init__(self) -> None:
        self._seen = _values()

    def take(self) -> dict[Key, float]:
        """The increments since the last call, per series, for the batch about to be handed over."""
        now = _values()
        gained = {k: v - self._seen.get(k, 0.0) for k, v in now.items() if v != self._seen.get(k, 0.0)}
        self._seen = now
        return gained


def count_worker_counters(batch: TensorBatch) -> None:
    """Count, in the training process, what a DataLoader worker counted for ``batch`` (module docstring)."""
    for (name, labels), n in batch.worker_counts.items():
        _BY_NAME[name].labels(**dict(labels)).inc(n)
