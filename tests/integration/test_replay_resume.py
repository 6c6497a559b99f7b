"""``streamrec replay --resume``: a replay stopped part way, rerun, sends only what its topics do not hold yet
(stream/replay/resume.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stream.config import KafkaSettings
from stream.errors import ConfigError
from stream.kafka_producer import AckedProducer
from stream.kafka_topics import ensure_topics
from stream.replay import publisher as publisher_module
from stream.replay.column_map import ColumnMap
from stream.replay.config import ClickDelay, SyntheticSettings
from stream.replay.eventlog import load_eventlog
from stream.replay.publisher import publish, replay_order
from stream.replay.resume import RUN_HEADER, SEQ_HEADER, key_partitions
from stream.replay.synthetic import build_synthetic
from stream.replay.table import EventTable
from streamrec.cli import main
from tests.kafka_io import Record, read_topic

PARTITIONS = 4
SYN = SyntheticSettings(impressions=9000, malformed_share=0.01)


def _table(seed: int = 3) -> EventTable:
    return build_synthetic(SYN, ClickDelay(), seed=seed)


def _topics(kafka: KafkaSettings) -> None:
    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic], partitions=PARTITIONS)


def _seqs(kafka: KafkaSettings) -> dict[str, list[Record]]:
    return {t: read_topic(kafka, t) for t in (kafka.impressions_topic, kafka.clicks_topic)}


def _assert_every_event_once_in_order(kafka: KafkaSettings, n_events: int) -> None:
    """Every seq of the replay order is in the topics exactly once, each partition's in increasing order, all of one
    run."""
    seen: list[int] = []
    runs = set()
    for records in _seqs(kafka).values():
        by_partition: dict[int, list[int]] = {}
        for r in sorted(records, key=lambda r: (r.partition, r.offset)):
            headers = dict(r.headers)
            runs.add(headers[RUN_HEADER])
            by_partition.setdefault(r.partition, []).append(int(headers[SEQ_HEADER]))
        for p, seqs in by_partition.items():
            assert seqs == sorted(seqs), f"partition {p} out of replay order"
            seen += seqs
    assert len(runs) == 1
    assert sorted(seen) == list(range(n_events)), (len(seen), len(set(seen)), n_events)


class _Interrupted(RuntimeError):
    pass


def test_a_replay_stopped_mid_chunk_then_resumed_delivers_every_event_exactly_once_in_partition_order(
        kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay stopped by an error in the middle of its third chunk (some of its messages produced): its rerun with
    resume sends only the events the partitions lack. Without it a rerun wrote the delivered part again."""
    _topics(kafka)
    table = _table()
    n_events = len(replay_order(table)[0])
    calls = [0]

    class StoppingProducer(AckedProducer):
        def send_run(self, topics: list[str], values: list[bytes | None], keys: list[Any], partitions: list[int],
                     headers: list[Any]) -> None:
            calls[0] += 1
            if calls[0] == 3:
                half = len(topics) // 2
                super().send_run(topics[:half], values[:half], keys[:half], partitions[:half], headers[:half])
                raise _Interrupted("stopped mid-chunk")
            super().send_run(topics, values, keys, partitions, headers)

    with monkeypatch.context() as m:
        m.setattr(publisher_module, "AckedProducer", StoppingProducer)
        with pytest.raises(_Interrupted):
            publish(table, kafka, "synthetic")
    delivered = sum(len(r) for r in _seqs(kafka).values())
    assert 0 < delivered < n_events

    summary = publish(table, kafka, "synthetic", resume=True)
    assert sum(summary.skipped.values()) == delivered
    assert summary.impressions + summary.clicks + summary.malformed_published + summary.dead_lettered \
        == n_events - delivered
    _assert_every_event_once_in_order(kafka, n_events)


def test_resuming_a_complete_replay_sends_nothing_and_says_so(kafka: KafkaSettings,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    _topics(kafka)
    table = _table()
    n_events = len(replay_order(table)[0])
    first = publish(table, kafka, "synthetic")
    assert first.skipped == {kafka.impressions_topic: 0, kafka.clicks_topic: 0}
    with caplog.at_level("INFO", logger="streamrec.replay"):
        again = publish(table, kafka, "synthetic", resume=True)
    assert (again.impressions, again.clicks, again.malformed_published) == (0, 0, 0)
    assert first.dead_lettered == 0 and sum(again.skipped.values()) == n_events
    assert "the replay is complete, nothing sent" in caplog.text
    _assert_every_event_once_in_order(kafka, n_events)


def test_resume_with_nothing_delivered_is_a_whole_replay(kafka: KafkaSettings) -> None:
    _topics(kafka)
    table = _table()
    summary = publish(table, kafka, "synthetic", resume=True)
    assert sum(summary.skipped.values()) == 0
    _assert_every_event_once_in_order(kafka, len(replay_order(table)[0]))


def test_resume_refuses_a_partition_whose_last_message_is_not_a_replays(kafka: KafkaSettings) -> None:
    _topics(kafka)
    producer = AckedProducer(kafka)
    producer.send(kafka.clicks_topic, b"{}", b"someone-else", partition=2)
    producer.flush_answered()
    with pytest.raises(ConfigError, match=rf"topic {kafka.clicks_topic} partition 2 .*not a replay's.*fresh topics"):
        publish(_table(), kafka, "synthetic", resume=True)
    assert read_topic(kafka, kafka.impressions_topic) == []  # nothing sent


def test_resume_refuses_topics_another_run_wrote(kafka: KafkaSettings) -> None:
    _topics(kafka)
    publish(_table(seed=1), kafka, "synthetic", run={"seed": 1})
    before = sum(len(r) for r in _seqs(kafka).values())
    with pytest.raises(ConfigError, match=r"another replay run.*rerun without --resume"):
        publish(_table(seed=2), kafka, "synthetic", run={"seed": 2}, resume=True)
    assert sum(len(r) for r in _seqs(kafka).values()) == before


def test_a_sigkilled_cli_replay_resumed_unpaced_delivers_every_event_exactly_once(
        kafka: KafkaSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SIGKILL leaves no chance to record anything: the topics' own headers are the record. The rerun is unpaced
    (the pace is not part of the run)."""
    _topics(kafka)
    cfg = tmp_path / "replay.toml"
    cfg.write_text(f'[kafka]\nbootstrap_servers = "{kafka.bootstrap_servers}"\nimpressions_topic = '
                   f'"{kafka.impressions_topic}"\nclicks_topic = "{kafka.clicks_topic}"\n[replay]\nprogress = false\n')
    args = ["replay", "--config", str(cfg), "--dataset", "synthetic", "--syn-impressions", "3000", "--seed", "5"]
    proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", *args, "--rate", "300"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:  # until some events are in the topic
            if len(read_topic(kafka, kafka.impressions_topic)) >= 200:
                break
            time.sleep(0.1)
        assert proc.poll() is None, "the replay ended before it was killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    delivered = sum(len(r) for r in _seqs(kafka).values())
    assert main([*args, "--resume", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sum(out["skipped"].values()) == delivered > 0
    n_events = out["impressions"] + out["clicks"] + out["malformed_published"] + out["dead_lettered"] + delivered
    _assert_every_event_once_in_order(kafka, n_events)


def test_the_replays_chosen_partition_is_the_one_the_producers_partitioner_picks(kafka: KafkaSettings) -> None:
    """The replay sets each message's partition itself (to know it before sending); it must be where the producer's
    murmur2 partitioner puts the key (another producer of the same keys, the Java client, faust), else impressions it
    sent and clicks another client sent would land in different partitions."""
    _topics(kafka)
    keys = [f"imp-{n}" for n in range(200)]
    producer = AckedProducer(kafka)
    for k in keys:
        producer.send(kafka.clicks_topic, b"{}", k)  # no partition: librdkafka's partitioner picks it
    producer.flush_answered()
    by_librdkafka = {r.key.decode(): r.partition for r in read_topic(kafka, kafka.clicks_topic) if r.key}
    chosen = key_partitions(np.array(keys, dtype=object), PARTITIONS).tolist()
    assert chosen == [by_librdkafka[k] for k in keys]
    assert len(set(chosen)) == PARTITIONS


def test_dead_letters_carry_the_run_headers_and_are_sent_again_on_a_resume(kafka: KafkaSettings,
                                                                          tmp_path: Path) -> None:
    """Rows a source rejected go to <topic>.dlq, which a resume does not read: they are sent again (documented),
    carrying the run's headers among their original ones so the copies can be told."""
    _topics(kafka)
    log = tmp_path / "log.csv"
    log.write_text("user_id,item_id,ts,clicked\n1,2,1700000000000,1\n-1,3,1700000001000,0\n4,5,1700000002000,0\n")
    table = load_eventlog(log, ColumnMap(), ClickDelay(), seed=1)
    first = publish(table, kafka, "log")
    again = publish(table, kafka, "log", resume=True)
    assert (first.dead_lettered, again.dead_lettered, again.impressions, again.clicks) == (1, 1, 0, 0)
    letters = read_topic(kafka, kafka.dlq_topic(kafka.impressions_topic))
    assert len(letters) == 2
    assert all((RUN_HEADER, first.run.encode()) in r.headers for r in letters)


def test_the_cli_run_is_defined_by_the_seed_and_an_event_logs_file_so_a_resume_of_another_is_refused(
        kafka: KafkaSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The fingerprint the command gives covers what changes the events: another --seed, or an event log changed
    since (its size and mtime), is another run, and resuming it into these topics is exit 2, nothing sent."""
    _topics(kafka)
    cfg = tmp_path / "replay.toml"
    cfg.write_text(f'[kafka]\nbootstrap_servers = "{kafka.bootstrap_servers}"\nimpressions_topic = '
                   f'"{kafka.impressions_topic}"\nclicks_topic = "{kafka.clicks_topic}"\n[replay]\nprogress = false\n')
    log = tmp_path / "log.csv"
    log.write_text("user_id,item_id,ts,clicked\n1,2,1700000000000,1\n3,4,1700000001000,0\n")
    base = ["replay", "--config", str(cfg), "--dataset", str(log)]
    assert main([*base, "--seed", "5"]) == 0
    assert main([*base, "--seed", "5", "--resume", "--rate", "50"]) == 0  # the same run: the pace is no part of it
    assert main([*base, "--seed", "6", "--resume"]) == 2
    assert "another replay run" in capsys.readouterr().err
    log.write_text(log.read_text() + "5,6,1700000002000,0\n")
    assert main([*base, "--seed", "5", "--resume"]) == 2
    assert "another replay run" in capsys.readouterr().err
    assert len(read_topic(kafka, kafka.impressions_topic)) == 2
