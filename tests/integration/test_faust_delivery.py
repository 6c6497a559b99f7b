"""The faust join driver's batch delivery (``stream/joiner/faust_delivery.py``) against the real broker and Redis:
faust's consumer hands whole batches to the pipeline without per-message events, commits a batch's offsets only
after ``JoinPipeline.process_new`` returned (and only those it processed: the records it holds back wait), and commits
nothing of a batch that failed."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition

from stream.config import KafkaSettings
from stream.replay.config import ClickDelay, SyntheticSettings
from stream.replay.publisher import publish
from stream.replay.synthetic import build_synthetic
from tests.integration.test_joiner import expected_join, join_env, read_samples

BATCH_MAX = 500
SYN = SyntheticSettings(impressions=2500, users=2000, items=300, impressions_per_s=20.0, attribution_window_s=600.0,
                        malformed_share=0.0)


def _run(kafka: KafkaSettings, redis_url: str, group_id: str, log: Path, fail_batch: int = 0, fail_kind: str = "",
         faust_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = join_env(kafka, redis_url, group_id)
    env.update({"STREAMREC_JOINER_BATCH_MAX": str(BATCH_MAX), "STREAMREC_TEST_DELIVERY_LOG": str(log),
                "STREAMREC_TEST_FAIL_BATCH": str(fail_batch), "STREAMREC_TEST_FAIL_KIND": fail_kind,
                **(faust_env or {})})
    cmd = [sys.executable, "-m", "tests.integration.faust_delivery_hooks", "join", "--app-id", group_id, "--driver",
           "faust", "--window-s", "600", "--lateness-s", "0", "--exit-when-idle", "4", "--drain", "--json"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def _entries(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _committed(kafka: KafkaSettings, group_id: str) -> dict[str, int]:
    """The group's committed offset per "topic:partition" (absent: none committed)."""
    c = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": group_id, "enable.auto.commit": False})
    try:
        tps = [TopicPartition(t, p) for t in (kafka.impressions_topic, kafka.clicks_topic)
               for p in range(kafka.partitions)]
        return {f"{tp.topic}:{tp.partition}": tp.offset for tp in c.committed(tps, timeout=20) if tp.offset >= 0}
    finally:
        c.close()


def test_faust_delivers_whole_batches_without_per_message_events_and_commits_only_what_process_returned(
        kafka: KafkaSettings, stack, group_id: str, tmp_path: Path) -> None:
    table = build_synthetic(SYN, ClickDelay(median_s=60.0), seed=31)
    publish(table, kafka, "synthetic")
    log = tmp_path / "delivery.jsonl"
    out = _run(kafka, stack.redis_url, group_id, log)
    assert out.returncode == 0, out.stderr[-3000:]
    entries = _entries(log)
    batches = [e for e in entries if e.get("size")]  # not the offers of what is held alone (size 0)
    commits = [e for e in entries if "commit" in e]
    total = table.n_impressions + table.n_clicks
    assert sum(b["size"] for b in batches) == total  # every event in exactly one batch (no failure, no rebalance)
    assert max(b["size"] for b in batches) <= BATCH_MAX
    assert len(batches) <= 2 * -(-total // BATCH_MAX)  # batches, not single messages
    # faust's consumer hands the batch over without making an Event (or a stream buffer entry) per message
    assert [b["events"] for b in batches] == [0] * len(batches)
    assert commits, "faust committed nothing"
    assert [c["ahead"] for c in commits if c["ahead"]] == []  # never an offset past what returned batches processed
    ends: dict[str, int] = {}  # per partition, the offset after the last record processed
    for b in batches:
        for tp, (_, last) in b["tps"].items():
            ends[tp] = max(ends.get(tp, 0), last + 1)
    assert _committed(kafka, group_id) == ends  # and at its idle exit faust committed all of it


def test_faust_commits_nothing_of_a_batch_that_failed_and_exits_with_status_1(
        kafka: KafkaSettings, stack, group_id: str, tmp_path: Path) -> None:
    table = build_synthetic(SYN, ClickDelay(median_s=60.0), seed=32)
    publish(table, kafka, "synthetic")
    log = tmp_path / "delivery.jsonl"
    out = _run(kafka, stack.redis_url, group_id, log, fail_batch=3)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "injected fault in batch 3" in out.stderr
    entries = _entries(log)
    failed = next(e for e in entries if e.get("batch") == 3)
    assert {"returned": 3} not in entries and not any(e.get("batch", 0) > 3 for e in entries)  # it stopped there
    assert [c["ahead"] for c in entries if c.get("ahead")] == []
    committed = _committed(kafka, group_id)
    for tp, (first, _) in failed["tps"].items():
        assert committed.get(tp, 0) <= first, f"{tp}: committed {committed.get(tp)} is past the failed batch's start"
    for c in (e["commit"] for e in entries if "commit" in e):
        assert all(off <= failed["tps"].get(tp, [off])[0] for tp, off in c.items()), c


def test_faust_reads_a_batch_that_failed_for_want_of_redis_again_in_the_process_and_joins_every_impression(
        kafka: KafkaSettings, stack, group_id: str, tmp_path: Path) -> None:
    # An infrastructure failure is recovered in the process (stream/joiner/worker.py), as the kafka driver does: nothing
    # of the batch is acknowledged or committed, the hand is read again from the committed offsets after the backoff.
    table = build_synthetic(SYN, ClickDelay(median_s=60.0), seed=33)
    publish(table, kafka, "synthetic")
    log = tmp_path / "delivery.jsonl"
    out = _run(kafka, stack.redis_url, group_id, log, fail_batch=3, fail_kind="redis")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "infrastructure failure" in out.stderr and "injected outage in batch 3" in out.stderr
    entries = _entries(log)
    failed = next(e for e in entries if e.get("batch") == 3)
    assert {"returned": 3} not in entries  # it raised
    assert [c["ahead"] for c in entries if c.get("ahead")] == []  # no commit ran ahead of what was processed
    later = [e for e in entries if e.get("batch", 0) > 3]
    for tp, (first, last) in failed["tps"].items():  # every record of the failed batch was delivered again
        seen = [e["tps"][tp] for e in later if tp in e.get("tps", {})]
        assert any(a <= first for a, _ in seen) and any(b >= last for _, b in seen), (tp, first, last, seen)
    want = expected_join(table, 600_000)
    rows = read_samples(kafka)
    assert Counter(r[0] for r in rows) == Counter(list(want.labels))  # every impression exactly once
    assert {r[0]: r[1] for r in rows} == want.labels


def test_faust_never_commits_records_the_join_holds_back_before_it_joins_them(
        kafka: KafkaSettings, stack, group_id: str, tmp_path: Path) -> None:
    # The backpressure tests' stream with heavy clicks: impressions a fetch brings minutes ahead of their clicks are
    # held by the pipeline for many batches. faust commits on its timer meanwhile; no commit may pass a held record
    # (a crash would then skip it: the impression lost).
    from tests.integration.test_backpressure import BATCH, CAP, SYN, WINDOW, _publish_hostile

    _publish_hostile(kafka, SYN, heavy="clicks")
    log = tmp_path / "delivery.jsonl"
    env = join_env(kafka, stack.redis_url, group_id) | {
        "STREAMREC_TEST_DELIVERY_LOG": str(log), "STREAMREC_JOINER_BATCH_MAX": str(BATCH),
        "STREAMREC_JOINER_MAX_WAITING_PER_PARTITION": str(CAP),
        "STREAMREC_KAFKA_EXTRA": "max.partition.fetch.bytes=65536", "STREAMREC_JOINER_EMISSION": "fake_negative",
        "STREAMREC_JOINER_MAX_INPUT_DRIFT_S": "3", "STREAMREC_JOINER_WATERMARK_QUORUM": "1",
        "BROKER_COMMIT_INTERVAL": "0.5"}  # faust's commit timer (2.8 s) fires during the holds of a short run too
    cmd = [sys.executable, "-m", "tests.integration.faust_delivery_hooks", "join", "--app-id", group_id, "--driver",
           "faust", "--window-s", str(WINDOW), "--lateness-s", "0", "--exit-when-idle", "4", "--drain", "--json"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["held_back"] > 0  # records were held, many batches long
    commits = [e for e in _entries(log) if "commit" in e]
    assert len(commits) > 1, "faust committed only at exit: nothing shows what it does while records are held"
    assert [c["ahead"] for c in commits if c["ahead"]] == []  # never an offset past what was processed


def test_faust_drain_at_exit_expires_the_impressions_of_an_assigned_partition_that_brought_no_record(
        kafka: KafkaSettings, stack, group_id: str) -> None:
    """A worker restarted with ``--drain`` over input an earlier run had read to its end restored no partition that
    brought no record, and drained only those it held: their pending impressions never got a sample (the kafka
    driver's case: tests/integration/test_join_recovery.py). Each impression is its own record batch here."""
    from stream.events import Impression
    from stream.kafka_producer import AckedProducer
    from stream.kafka_topics import ensure_topics
    from tests.integration.test_joiner import join_cmd, read_samples

    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic])
    producer = AckedProducer(kafka)
    for i in range(3):
        producer.send(kafka.impressions_topic, Impression(f"imp-{i}", 1_700_000_000_000 + i, "u", "i").encode(),
                      f"imp-{i}", partition=0)
        producer.flush()
    env = join_env(kafka, stack.redis_url, group_id)
    cmd = join_cmd(group_id, "faust", idle_s=1.0)
    first = subprocess.run([c for c in cmd if c != "--drain"], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout.strip().splitlines()[-1])["impressions"] == 3 and read_samples(kafka) == []
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted((r[0], r[1]) for r in read_samples(kafka)) == [(f"imp-{i}", 0) for i in range(3)]



def test_faust_rejoins_after_a_slow_batch_got_it_dropped_from_the_group_and_joins_every_impression(
        kafka: KafkaSettings, stack, group_id: str, tmp_path: Path) -> None:
    """A batch past faust's ``broker_max_poll_interval`` (``[kafka.extra] max.poll.interval.ms``, 300 s unless set;
    shrunk here to the session) gets the member dropped from the group. Its commit after the batch
    goes out as a member of no generation and the broker refuses it; the revocation drops what it holds. aiokafka
    rejoins only once its fetcher polls again, and faust polls only once a rejoin resumed its flow: the worker sat
    with no partitions and exited idle with status 0, not one of the 2500 impressions out as a sample. faust's answer
    to the revocation now counts as a poll (``faust_delivery._CommittedReads``)."""
    table = build_synthetic(SYN, ClickDelay(median_s=60.0), seed=35)
    publish(table, kafka, "synthetic")
    log = tmp_path / "delivery.jsonl"
    poll_s = kafka.session_timeout_ms / 1000
    out = _run(kafka, stack.redis_url, group_id, log, faust_env={
        "STREAMREC_KAFKA_EXTRA": f"max.poll.interval.ms={kafka.session_timeout_ms}",
        "BROKER_COMMIT_EVERY": "1",  # faust's setting by its env name (one the worker leaves to faust)
        "STREAMREC_TEST_SLOW_BATCH": "2", "STREAMREC_TEST_SLOW_S": str(poll_s + 3)})  # the slow batch itself
    assert out.returncode == 0, out.stderr[-3000:]
    entries = _entries(log)
    after_slow = next(e for e in entries[entries.index({"returned": 2}):] if "commit" in e)
    assert after_slow["generation"] == -1  # dropped: the batch's commit went out as a member of no generation
    assert [c["ahead"] for c in entries if c.get("ahead")] == []
    want = expected_join(table, 600_000)
    rows = read_samples(kafka)
    assert Counter(r[0] for r in rows) == Counter(list(want.labels))  # every impression exactly once
    assert {r[0]: r[1] for r in rows} == want.labels
    ends: dict[str, int] = {}
    for b in (e for e in entries if e.get("size")):
        for tp, (_, last) in b["tps"].items():
            ends[tp] = max(ends.get(tp, 0), last + 1)
    assert _committed(kafka, group_id) == ends  # the refused commit moved nothing; the rejoined member committed all
