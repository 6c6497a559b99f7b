"""The order a batch's state records go out in (``JoinPipeline._write_state``): a snapshot chunk's predecessors are
tombstoned only once every part of the snapshot is acknowledged. And what an operator sees of it: the snapshots
written and the live chunks per partition (stream/joiner/metrics.py)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from prometheus_client import REGISTRY

from stream.events import Click
from stream.joiner import metrics as m
from stream.joiner.engine import PartitionJoin
from stream.joiner.pipeline import JoinPipeline
from stream.joiner.state_log import chunk_key, encode_chunk
from stream.joiner.totals import JoinTotals
from streamrec.commands.common import kv_lines
from tests.unit.stream.test_join_engine import STALL, Feed, imp


class Producer:
    """Records what was sent and each flush, in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, bytes | None] | str] = []

    def send(self, topic, value, key=None, headers=None, partition=None) -> None:  # noqa: ANN001 - AckedProducer's
        self.log.append((key, value))

    def flush(self) -> None:
        self.log.append("flush")


def _pipeline() -> tuple[JoinPipeline, Producer]:
    p = JoinPipeline.__new__(JoinPipeline)
    p.producer = producer = Producer()
    p.state_topic, p._parts, p.totals = "g-join-state", {(0, 1): 2, (0, 2): 1, (1, 7): 1}, JoinTotals()
    p.day_counts = SimpleNamespace(batch_done=lambda: None)  # type: ignore[assignment]
    return p, producer


def test_a_snapshots_predecessors_are_tombstoned_only_after_every_part_of_it_is_acknowledged() -> None:
    """Sent in one go, an idempotent producer that gave a failed snapshot part up and went on could land the
    tombstones of the chunks it replaces without it: the restore then lost the live state only those held."""
    p, producer = _pipeline()
    snapshot = SimpleNamespace(chunk=SimpleNamespace(seq=3, snapshot=True), retired=[1, 2])
    p._write_state({0: snapshot}, {0: [b"part0", b"part1"]})  # type: ignore[dict-item]
    log = producer.log
    parts = [log.index((chunk_key(0, 3, i), v)) for i, v in enumerate((b"part0", b"part1"))]
    tombs = [log.index((chunk_key(0, s, i), None)) for s, i in ((1, 0), (1, 1), (2, 0))]
    flushes = [i for i, x in enumerate(log) if x == "flush"]
    assert any(max(parts) < f < min(tombs) for f in flushes), log
    assert log[-1] == "flush"  # and the tombstones themselves acknowledged before the batch is done


def test_an_ordinary_chunks_retired_predecessors_go_with_it_in_one_flush() -> None:
    """Their contents matter no more (event time passed them): no flush between, the batch's one round trip."""
    p, producer = _pipeline()
    plain = SimpleNamespace(chunk=SimpleNamespace(seq=8, snapshot=False), retired=[7])
    p._write_state({1: plain}, {1: [b"c"]})  # type: ignore[dict-item]
    assert producer.log == ["flush", (chunk_key(1, 8, 0), b"c"), (chunk_key(1, 7, 0), None), "flush"]


def _live_in_log(log: list[tuple[str, bytes | None] | str]) -> int:
    """Chunks with a part in the (compacted) state topic the producer wrote: last value per key not a tombstone."""
    last: dict[bytes, bytes | None] = {}
    for entry in log:
        if entry != "flush":
            last[entry[0]] = entry[1]  # type: ignore[index] - keys are chunk_key's bytes
    return len({key.rsplit(b":", 1)[0] for key, value in last.items() if value is not None})  # (partition, seq)


def test_a_stalled_partitions_compaction_counts_each_snapshot_written_and_its_live_chunks() -> None:
    """Event time stands still (clicks on impressions that never come): no chunk retires, and compaction replaces
    them with a snapshot every so often. Nothing showed how often, nor how many chunks a partition's log held."""
    p, producer = _pipeline()
    p._parts, j, f = {}, PartitionJoin(0, STALL), Feed()
    counted = REGISTRY.get_sample_value("streamrec_join_state_snapshots_total") or 0.0
    batches = [(f.imps(*(imp(f"i{k}", k * 100) for k in range(40))), [])]
    batches += [([], f.clicks(*(Click(f"o{b}-{n}", 5000 + b) for n in range(3)))) for b in range(700)]
    snapshots, most = 0, 0
    for imps, clicks in batches:
        res = j.apply(imps, clicks)
        p._commit_state(({0: res}, {0: encode_chunk(res.chunk)} if res.chunk is not None else {}))
        m.gauges({0: j}, Counter())
        live = REGISTRY.get_sample_value("streamrec_join_state_live_chunks", {"partition": "0"})
        assert live == j.live_chunks == _live_in_log(producer.log)
        snapshots += res.chunk is not None and res.chunk.snapshot
        most = max(most, j.live_chunks)
    assert snapshots >= 2 and most < len(batches) // 2  # compacted, more than once: the log stays bounded
    assert REGISTRY.get_sample_value("streamrec_join_state_snapshots_total") - counted == snapshots
    assert p.totals.counts["snapshots"] == snapshots


def test_the_join_summary_says_how_many_snapshots_the_run_wrote() -> None:
    """The summary printed at exit (``--json``, or the text lines) had every other count of the run but this one."""
    p, _ = _pipeline()
    snapshot = SimpleNamespace(chunk=SimpleNamespace(seq=3, snapshot=True), retired=[1, 2])
    plain = SimpleNamespace(chunk=SimpleNamespace(seq=8, snapshot=False), retired=[7])
    p._commit_state(({0: snapshot, 1: plain}, {0: [b"part0", b"part1"], 1: [b"c"]}))  # type: ignore[arg-type]
    summary = p.totals.summary()
    assert summary["snapshots"] == 1 and "\n  snapshots: 1\n" in kv_lines(summary)
