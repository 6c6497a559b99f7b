"""``streamrec replay --resume``: a replay stopped part way, rerun, sends only what its topics do not hold yet, told
by the content of each partition's last messages (stream/replay/resume.py)."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from confluent_kafka import Producer

from stream.config import KafkaSettings
from stream.errors import ConfigError
from stream.kafka_producer import AckedProducer
from stream.kafka_topics import ensure_topics
from stream.replay import publisher as publisher_module
from stream.replay import resume as resume_module
from stream.replay.column_map import ColumnMap
from stream.replay.config import ClickDelay, SyntheticSettings
from stream.replay.eventlog import load_eventlog
from stream.replay.publisher import publish, replay_order
from stream.replay.resume import key_partitions
from stream.replay.synthetic import build_synthetic
from stream.replay.table import EventTable
from streamrec.cli import main
from tests.kafka_io import read_topic

PARTITIONS = 4
SYN = SyntheticSettings(impressions=9000, malformed_share=0.01)


def _table(seed: int = 3) -> EventTable:
    return build_synthetic(SYN, ClickDelay(), seed=seed)


def _topics(kafka: KafkaSettings) -> None:
    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic], partitions=PARTITIONS)


def _contents(kafka: KafkaSettings) -> dict[tuple[str, int], list[tuple[bytes | None, bytes | None]]]:
    """Per (topic kind, partition): the (key, value) of its messages in offset order."""
    out: dict[tuple[str, int], list[tuple[bytes | None, bytes | None]]] = {}
    for kind, topic in (("impressions", kafka.impressions_topic), ("clicks", kafka.clicks_topic)):
        for r in sorted(read_topic(kafka, topic), key=lambda r: (r.partition, r.offset)):
            out.setdefault((kind, r.partition), []).append((r.key, r.value))
    return out


def _delivered(kafka: KafkaSettings) -> int:
    return sum(len(v) for v in _contents(kafka).values())


def _fresh(kafka: KafkaSettings, partitions: int = PARTITIONS, suffix: str = "-ref") -> KafkaSettings:
    """The same broker, other topics (for the replay a resumed one must equal), created."""
    other = dataclasses.replace(kafka, impressions_topic=f"{kafka.impressions_topic}{suffix}",
                                clicks_topic=f"{kafka.clicks_topic}{suffix}")
    ensure_topics(other, [other.impressions_topic, other.clicks_topic], partitions=partitions)
    return other


def _assert_as_one_whole_replay(kafka: KafkaSettings, whole: KafkaSettings) -> None:
    """Every partition of ``kafka``'s topics holds what one uninterrupted replay wrote to ``whole``'s: each event
    once, in the replay order (byte for byte: keys and values)."""
    got, want = _contents(kafka), _contents(whole)
    assert got.keys() == want.keys()
    for where, messages in want.items():
        assert got[where] == messages, f"{where}: {len(got[where])} messages, the whole replay {len(messages)}"
    assert sum(map(len, got.values())) > 0


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
        def send_run(self, topics: list[str], values: list[bytes | None], keys: list[Any],
                     partitions: list[int]) -> None:
            calls[0] += 1
            if calls[0] == 3:
                half = len(topics) // 2
                super().send_run(topics[:half], values[:half], keys[:half], partitions[:half])
                raise _Interrupted("stopped mid-chunk")
            super().send_run(topics, values, keys, partitions)

    with monkeypatch.context() as m:
        m.setattr(publisher_module, "AckedProducer", StoppingProducer)
        with pytest.raises(_Interrupted):
            publish(table, kafka, "synthetic")
    delivered = _delivered(kafka)
    assert 0 < delivered < n_events

    summary = publish(table, kafka, "synthetic", resume=True)
    assert sum(summary.skipped.values()) == delivered
    assert summary.impressions + summary.clicks + summary.malformed_published + summary.dead_lettered \
        == n_events - delivered
    whole = _fresh(kafka)
    publish(table, whole, "synthetic")
    _assert_as_one_whole_replay(kafka, whole)


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
    assert sum(again.skipped.values()) == _delivered(kafka)


def test_resume_with_nothing_delivered_is_a_whole_replay(kafka: KafkaSettings) -> None:
    _topics(kafka)
    table = _table()
    summary = publish(table, kafka, "synthetic", resume=True)
    assert sum(summary.skipped.values()) == 0
    whole = _fresh(kafka)
    publish(table, whole, "synthetic")
    _assert_as_one_whole_replay(kafka, whole)


def test_resume_refuses_a_partition_whose_last_message_is_not_one_of_the_runs_events(kafka: KafkaSettings) -> None:
    _topics(kafka)
    producer = AckedProducer(kafka)
    producer.send(kafka.clicks_topic, b"{}", b"someone-else", partition=2)
    producer.flush_answered()
    with pytest.raises(ConfigError, match=rf"topic {kafka.clicks_topic} partition 2 \(offsets 0-0\).*someone-else.*"
                                          r"not this replay's events.*fresh topics"):
        publish(_table(), kafka, "synthetic", resume=True)
    assert read_topic(kafka, kafka.impressions_topic) == []  # nothing sent


def test_resume_refuses_topics_holding_another_runs_events(kafka: KafkaSettings) -> None:
    """A topic holding the events of another seed's replay: its partitions' last messages are found nowhere in this
    run's events."""
    _topics(kafka)
    publish(_table(seed=1), kafka, "synthetic")
    before = _delivered(kafka)
    with pytest.raises(ConfigError, match=r"not this replay's events.*rerun without --resume"):
        publish(_table(seed=2), kafka, "synthetic", resume=True)
    assert _delivered(kafka) == before


def test_a_sigkilled_cli_replay_resumed_unpaced_delivers_every_event_exactly_once(
        kafka: KafkaSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SIGKILL leaves no chance to record anything: the topics' content is the record. The rerun is unpaced (the
    pace is not part of the run)."""
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
    delivered = _delivered(kafka)
    assert main([*args, "--resume", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sum(out["skipped"].values()) == delivered > 0
    whole = _fresh(kafka)
    ref = tmp_path / "whole.toml"
    ref.write_text(cfg.read_text().replace(kafka.impressions_topic, whole.impressions_topic)
                   .replace(kafka.clicks_topic, whole.clicks_topic))
    assert main(["replay", "--config", str(ref), *args[3:]]) == 0
    _assert_as_one_whole_replay(kafka, whole)


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


def test_dead_letters_are_sent_again_on_a_resume_and_do_not_count_as_delivered_events(kafka: KafkaSettings,
                                                                                       tmp_path: Path) -> None:
    """Rows a source rejected go to <topic>.dlq, which a resume does not read: they are sent again (documented), and
    they are no part of a partition's share (the resume of a complete replay sends no event again)."""
    _topics(kafka)
    log = tmp_path / "log.csv"
    log.write_text("user_id,item_id,ts,clicked\n1,2,1700000000000,1\n-1,3,1700000001000,0\n4,5,1700000002000,0\n")
    table = load_eventlog(log, ColumnMap(), ClickDelay(), seed=1)
    first = publish(table, kafka, "log")
    again = publish(table, kafka, "log", resume=True)
    assert (first.dead_lettered, again.dead_lettered, again.impressions, again.clicks) == (1, 1, 0, 0)
    letters = read_topic(kafka, kafka.dlq_topic(kafka.impressions_topic))
    assert len(letters) == 2 and letters[0].value == letters[1].value
    assert sum(again.skipped.values()) == first.impressions + first.clicks == len(read_topic(
        kafka, kafka.impressions_topic)) + len(read_topic(kafka, kafka.clicks_topic))


def test_a_resume_says_how_many_dead_letters_an_earlier_run_had_sent_already(
        kafka: KafkaSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The dead letters a resume sends again were counted in its summary as new: it now says how many of them an
    earlier run had sent (those before the last event the topics hold, in the replay order every run sends in), and
    a resume with nothing delivered (a whole replay) says none."""
    _topics(kafka)
    cfg = tmp_path / "replay.toml"
    cfg.write_text(f'[kafka]\nbootstrap_servers = "{kafka.bootstrap_servers}"\nimpressions_topic = '
                   f'"{kafka.impressions_topic}"\nclicks_topic = "{kafka.clicks_topic}"\n[replay]\nprogress = false\n')
    log = tmp_path / "log.csv"
    log.write_text("user_id,item_id,ts,clicked\n1,2,1700000000000,0\n-1,3,1700000001000,0\n4,5,1700000002000,0\n"
                   "-2,6,1700000003000,0\n7,8,1700000004000,0\n")
    base = ["replay", "--config", str(cfg), "--dataset", str(log), "--resume"]
    assert main([*base, "--json"]) == 0  # nothing delivered yet: a whole replay
    whole = json.loads(capsys.readouterr().out)
    assert (whole["dead_lettered"], whole["dead_lettered_again"]) == (2, 0)
    assert main([*base, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert (again["impressions"], again["dead_lettered"], again["dead_lettered_again"]) == (0, 2, 2)
    assert main(base) == 0
    assert "dead-lettered at source: 2 (2 of them sent by an earlier run already" in capsys.readouterr().out
    assert len(read_topic(kafka, kafka.dlq_topic(kafka.impressions_topic))) == 6


def test_the_cli_resume_refuses_another_seeds_events_and_sends_only_the_rows_an_event_log_gained(
        kafka: KafkaSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The content is what counts: another --seed (other click times) is other events, and resuming it into these
    topics is exit 2, nothing sent; an event log grown since holds the same events first, and a resume sends only
    the new rows'."""
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
    assert "not this replay's events" in capsys.readouterr().err
    assert (len(read_topic(kafka, kafka.impressions_topic)), len(read_topic(kafka, kafka.clicks_topic))) == (2, 1)
    log.write_text(log.read_text() + "5,6,1700000002000,0\n")
    capsys.readouterr()
    assert main([*base, "--seed", "5", "--resume", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["impressions"], out["clicks"], sum(out["skipped"].values())) == (1, 0, 3)
    assert len(read_topic(kafka, kafka.impressions_topic)) == 3


def _repeated_rows(tmp_path: Path, rows: str) -> EventTable:
    """An event log whose rows name their impression id: a row repeated is an event repeated (same key and value)."""
    log = tmp_path / "repeated.csv"
    log.write_text("iid,user_id,item_id,ts\n" + rows)
    return load_eventlog(log, ColumnMap(impression_id="iid", clicked=None), ClickDelay(), seed=1)


A, X, B = "a,1,2,1700000000000\n", "x,3,4,1700000001000\n", "b,5,6,1700000002000\n"
C = "c,7,8,1700000003000\n"


def _holding(kafka: KafkaSettings, tmp_path: Path, rows: str, held: list[int]) -> tuple[EventTable, KafkaSettings]:
    """The table of ``rows``, a whole replay of it into fresh one-partition topics, and ``kafka``'s (one partition)
    holding the whole replay's messages at the positions ``held``, in that order."""
    table = _repeated_rows(tmp_path, rows)
    whole = _fresh(kafka, partitions=1)
    _fresh(kafka, partitions=1, suffix="")
    publish(table, whole, "log")
    messages = _contents(whole)[("impressions", 0)]
    producer = AckedProducer(kafka)
    for n in held:  # a record batch each: the last message is read first, and the ones before it only when needed
        key, value = messages[n]
        producer.send(kafka.impressions_topic, value, key, partition=0)
        producer.flush_answered()
    return table, whole


@pytest.mark.parametrize(("rows", "held"), [(A + X + X + X + B, 1), (A + X + X + X + B, 2), (A + X + X + X + B, 3),
                                            (A + X + X + X + B, 4), (X + X + B, 1), (X + X + B, 2)])
def test_a_resume_completes_a_prefix_whose_last_event_is_repeated_in_its_share_exactly(
        kafka: KafkaSettings, tmp_path: Path, rows: str, held: int) -> None:
    """x repeated in the partition's share: a last message x is told by the messages before it, read back until they
    match one position, or by the whole partition being a prefix of the share. The resume sends exactly the rest."""
    table, whole = _holding(kafka, tmp_path, rows, list(range(held)))
    assert len(set(_contents(whole)[("impressions", 0)])) == len(set(rows.splitlines()))  # the x are byte-identical
    summary = publish(table, kafka, "log", resume=True)
    assert (summary.skipped[kafka.impressions_topic], summary.impressions) == (held, rows.count("\n") - held)
    assert _contents(kafka) == _contents(whole)


def test_resume_refuses_a_partition_whose_messages_match_several_positions_of_its_share(
        kafka: KafkaSettings, tmp_path: Path) -> None:
    """x, x, x in a partition whose share is x, x (a whole replay, then one message of a rerun without --resume):
    two positions fit; which is unknowable, so nothing is sent."""
    table, _ = _holding(kafka, tmp_path, X + X, [0, 1, 0])
    with pytest.raises(ConfigError, match=rf"3 message\(s\) of topic {kafka.impressions_topic} partition 0 .*whole "
                                          r"partition, match 2 positions.*repeated events.*fresh topics"):
        publish(table, kafka, "log", resume=True)
    assert _delivered(kafka) == 3


def test_resume_refuses_an_event_log_that_gained_a_row_before_the_delivered_prefix(
        kafka: KafkaSettings, tmp_path: Path) -> None:
    """a, b delivered of a, b, c; the log then gains x between a and b in event time. b's content is found at
    position 2 of the new share, but the partition holds 2 messages (offsets 0-1): refused, nothing sent. Matching
    the last message alone resumed after b and never sent x."""
    _holding(kafka, tmp_path, A + B + C, [0, 1])
    grown = _repeated_rows(tmp_path, A + X + B + C)
    with pytest.raises(ConfigError, match=rf"topic {kafka.impressions_topic} partition 0 holds 2 message\(s\) "
                                          r"\(offsets 0-1, nothing trimmed\).*must be event 1 .*matches event 2: the "
                                          r"input changed since the first run.*same input.*fresh topics"):
        publish(grown, kafka, "log", resume=True)
    assert _delivered(kafka) == 2


def test_resume_of_a_partition_trimmed_by_retention_warns_once_per_topic_that_the_count_is_not_checked(
        kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A low watermark > 0 (retention trimmed the partition; reported so here) leaves the count unknown: the resume
    goes by the last messages' content and says, once for the topic, that the prefix length is not verified."""
    table, whole = _holding(kafka, tmp_path, A + B + C, [0, 1])
    real = resume_module.watermarks

    def trimmed(settings: KafkaSettings, topic: str, *args: Any, **kwargs: Any) -> dict[int, tuple[int, int]]:
        return {p: (1 if high > 1 else low, high) for p, (low, high) in real(settings, topic, *args, **kwargs).items()}

    monkeypatch.setattr(resume_module, "watermarks", trimmed)
    with caplog.at_level("WARNING", logger="streamrec.replay"):
        summary = publish(table, kafka, "log", resume=True)
    assert (summary.skipped[kafka.impressions_topic], summary.impressions) == (2, 1)
    warned = [r.getMessage() for r in caplog.records if "cannot verify" in r.getMessage()]
    assert len(warned) == 1 and f"topic {kafka.impressions_topic} partition(s) 0 " in warned[0]
    assert _contents(kafka) == _contents(whole)


def _foreign_transaction(kafka: KafkaSettings) -> None:
    """Another producer's committed transaction of one message in partition 0 of the impressions topic: the message,
    then its commit marker (an offset no consumer gets a record at)."""
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers,
                         "transactional.id": f"{kafka.impressions_topic}-foreign"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(kafka.impressions_topic, b"foreign", b"f", partition=0)
    producer.commit_transaction(30)


def test_resume_refuses_a_partition_whose_last_message_before_a_transaction_marker_is_another_producers(
        kafka: KafkaSettings, tmp_path: Path) -> None:
    """a, b of a, b, c delivered, then another producer's transaction (its message, its commit marker). The last
    offset is the marker: the read back goes past it to the foreign message and refuses. Reading from the marker
    alone found nothing, took the partition for empty and sent a, b, c again."""
    _holding(kafka, tmp_path, A + B + C, [0, 1])
    _foreign_transaction(kafka)
    marks = resume_module.watermarks(kafka, kafka.impressions_topic)[0]
    assert marks == (0, 4)  # a, b, the foreign message, its marker
    with pytest.raises(ConfigError, match=rf"last 1 message\(s\) of topic {kafka.impressions_topic} partition 0 "
                                          r"\(offsets 2-2\), the last with key b?'?f'?.* are not this replay's events"):
        publish(_repeated_rows(tmp_path, A + B + C), kafka, "log", resume=True)
    assert _delivered(kafka) == 3


def test_the_read_back_past_a_transaction_marker_starts_earlier_each_time_and_ends_refusing(
        kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another producer's transaction (its message, its marker), then x of a share x, x, b: x matches two positions,
    and the partition's count (3) neither. The reads back went by the messages read (high - 2 x 1) and read the
    marker's offset, holding x alone, again for ever; now each starts earlier, reaches the foreign message and
    refuses (x at position 0, not 2)."""
    _fresh(kafka, partitions=1, suffix="")
    _foreign_transaction(kafka)
    table = _repeated_rows(tmp_path, X + X + B)
    whole = _fresh(kafka, partitions=1)
    publish(table, whole, "log")
    key, value = _contents(whole)[("impressions", 0)][0]
    producer = AckedProducer(kafka)
    producer.send(kafka.impressions_topic, value, key, partition=0)
    producer.flush_answered()
    starts: list[int] = []
    real = resume_module._read_from

    def read_from(settings: KafkaSettings, topic: str, p: int, offset: int) -> list[Any]:
        assert not starts or offset < starts[-1], f"read from offset {offset} again after {starts}"
        starts.append(offset)
        return real(settings, topic, p, offset)

    monkeypatch.setattr(resume_module, "_read_from", read_from)
    with pytest.raises(ConfigError, match=r"partition 0 holds 3 message\(s\).*must be event 2 .*matches event 0"):
        publish(table, kafka, "log", resume=True)
    assert starts == [2, 1, 0]


def test_resume_refuses_a_partition_retention_trimmed_empty_where_the_replay_has_events(
        kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """a, b of a, b, c delivered, then retention trimmed the partition empty (low = high = 2; reported so here): how
    many of its share it held is gone, so the resume refuses. It skipped the partition as empty and sent a, b, c
    again."""
    table, _ = _holding(kafka, tmp_path, A + B + C, [0, 1])
    real = resume_module.watermarks

    def emptied(settings: KafkaSettings, topic: str, *args: Any, **kwargs: Any) -> dict[int, tuple[int, int]]:
        return {p: (high, high) for p, (_low, high) in real(settings, topic, *args, **kwargs).items()}

    monkeypatch.setattr(resume_module, "watermarks", emptied)
    with pytest.raises(ConfigError, match=rf"topic {kafka.impressions_topic} partition 0 held messages \(offsets "
                                          r"up to 1\) but has none to read now \(low watermark 2: retention.*fresh "
                                          r"topics"):
        publish(table, kafka, "log", resume=True)
    assert _delivered(kafka) == 2


def test_a_partition_nothing_was_trimmed_from_that_has_no_record_to_read_holds_none_of_the_runs_events(
        kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offsets no consumer gets a record at (another producer's aborted transaction and its marker; every read made
    empty here) with low watermark 0: none of them is this replay's (its messages are no transaction's), so the
    resume sends the partition's whole share, not a refusal as for a partition trimmed empty."""
    table, whole = _holding(kafka, tmp_path, A + B + C, [0, 1])
    monkeypatch.setattr(resume_module, "_read_from", lambda *_args: [])
    summary = publish(table, kafka, "log", resume=True)
    assert (summary.skipped[kafka.impressions_topic], summary.impressions) == (0, 3)
    assert _delivered(kafka) == 5
