"""Replay against the real broker: exact counts, event-time order, co-partitioning, pacing."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from confluent_kafka import KafkaError
from confluent_kafka.admin import AdminClient, NewTopic

from stream import kafka_producer
from stream.config import KafkaSettings
from stream.errors import BrokerUnreachable, ConfigError
from stream.event_reader import EventReader
from stream.events import decode_click, decode_impression
from stream.kafka import admin_config
from stream.kafka_producer import AckedProducer
from stream.kafka_topics import ensure_topics
from stream.metrics import EVENTS
from stream.replay import publisher as publisher_module
from stream.replay.column_map import ColumnMap
from stream.replay.config import ClickDelay, SyntheticSettings
from stream.replay.eventlog import load_eventlog
from stream.replay.movielens import CLICK_MIN_RATING, load_movielens, read_movielens
from stream.replay.publisher import publish
from stream.replay.synthetic import build_synthetic
from streamrec.cli import main
from streamrec.stack import free_port, tansu_binary
from tests.bounded_teardown import kill_and_reap
from tests.integration.test_faults import Service
from tests.kafka_io import read_topic
from tests.monitoring_io import metric, scrape


def test_ml100k_counts_order_and_copartitioning(kafka: KafkaSettings) -> None:
    table = load_movielens("ml-100k", ClickDelay(), seed=1)
    summary = publish(table, kafka, "ml-100k")
    assert (summary.impressions, summary.clicks) == (100_000, 55_375)  # ratings >= 4 in ml-100k
    assert summary.acked == {kafka.clicks_topic: 55_375, kafka.impressions_topic: 100_000}

    imps = read_topic(kafka, kafka.impressions_topic)
    clicks = read_topic(kafka, kafka.clicks_topic)
    assert (len(imps), len(clicks)) == (100_000, 55_375)
    where: dict[str, tuple[int, int]] = {}
    last_ts: dict[int, int] = defaultdict(int)
    for r in sorted(imps, key=lambda r: (r.partition, r.offset)):
        ev = decode_impression(r.value)
        assert r.key == ev.impression_id.encode()
        assert ev.ts >= last_ts[r.partition], "impressions must be in event-time order per partition"
        last_ts[r.partition] = ev.ts
        where[ev.impression_id] = (r.partition, ev.ts)
        assert {"gender", "age", "occupation", "zip", "year", "genres"} <= ev.context.keys()
    for r in clicks:
        c = decode_click(r.value)
        partition, imp_ts = where[c.impression_id]
        assert r.partition == partition, "a click must land on its impression's partition"
        assert c.ts > imp_ts


def test_ml1m_cli_publishes_exact_counts(kafka: KafkaSettings, group_id: str, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI path over ML-1M's earliest 100 k ratings (the whole set takes 97 s here and is `make demo`'s):
    one impression per rating, one click per rating >= 4, none dead-lettered, every one readable from the broker."""
    limit = 100_000
    tables = read_movielens("ml-1m")
    assert len(tables.ratings()) == 1_000_209  # the packaged data set, whole
    ratings = tables.ratings()[np.argsort(tables.ts_ms(), kind="stable")[:limit]]  # the replay's order and limit
    want_clicks = int((ratings >= CLICK_MIN_RATING).sum())
    monkeypatch.setenv("STREAMREC_KAFKA_IMPRESSIONS_TOPIC", kafka.impressions_topic)
    monkeypatch.setenv("STREAMREC_KAFKA_CLICKS_TOPIC", kafka.clicks_topic)
    rc = main(["replay", "--dataset", "ml-1m", "--limit", str(limit), "--json", "--no-progress",
               "--bootstrap-servers", kafka.bootstrap_servers])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["impressions"], out["clicks"], out["dead_lettered"]) == (limit, want_clicks, 0)
    assert limit // 3 < want_clicks < limit  # the count means something
    decoders = {kafka.impressions_topic: decode_impression, kafka.clicks_topic: decode_click}
    with EventReader(kafka, group_id, decoders) as reader:
        reader.read_to_end()
        assert dict(reader.valid) == {kafka.impressions_topic: limit, kafka.clicks_topic: want_clicks}
        assert reader.dead_letters.total == 0


def test_rate_limits_wall_clock_throughput(kafka: KafkaSettings) -> None:
    table = build_synthetic(SyntheticSettings(impressions=300, base_ctr=0.0001), ClickDelay(), seed=3)
    t0 = time.monotonic()
    summary = publish(table, kafka, "synthetic", rate=1000)
    events = summary.impressions + summary.clicks
    assert time.monotonic() - t0 >= 0.8 * (events - 1) / 1000  # a lower bound: pacing must slow it down


def test_speed_follows_event_time(kafka: KafkaSettings) -> None:
    s = SyntheticSettings(impressions=100, impressions_per_s=50.0, base_ctr=0.0001, duplicate_click_share=0,
                          orphan_click_share=0, late_click_share=0)
    table = build_synthetic(s, ClickDelay(), seed=5)
    span_s = (table.ts.max() - table.ts.min()) / 1000
    t0 = time.monotonic()
    publish(table, kafka, "synthetic", speed=4.0)
    assert time.monotonic() - t0 >= 0.8 * span_s / 4.0


@pytest.mark.parametrize(("setting", "value"), [("rate", 1e-300), ("speed", 1e-300), ("speed", 1.0)])
def test_a_pace_over_a_year_is_refused_before_anything_is_sent(setting: str, value: float, kafka: KafkaSettings,
                                                                tmp_path: Path) -> None:
    """A rate or speed that paces the replay over a year of wall clock: tiny ones (the first wait raised
    OverflowError from time.sleep after the first event was sent), or speed 1 over event times 22 years apart (the
    replay slept 22 years). Now a ConfigError naming the setting, and nothing sent."""
    log = tmp_path / "log.csv"
    log.write_text("user_id,item_id,ts,clicked\n1,2,1000000000000,0\n1,3,1000000001000,0\n1,4,1700000000000,0\n")
    table = load_eventlog(log, ColumnMap(), ClickDelay(), seed=1)
    rate, speed = (value, None) if setting == "rate" else (None, value)
    with pytest.raises(ConfigError, match=rf"\[replay\] {setting} .* a paced replay may take at most a year"):
        publish(table, kafka, "log", rate=rate, speed=speed)
    assert read_topic(kafka, kafka.impressions_topic) == []


def _recorded_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The publisher's pacing sleeps, recorded (each slept 10 ms at most)."""
    sleeps: list[float] = []
    real_sleep = time.sleep

    def sleep(s: float) -> None:
        sleeps.append(s)
        real_sleep(min(s, 0.01))

    monkeypatch.setattr(publisher_module.time, "sleep", sleep)
    return sleeps


def test_a_speed_paced_log_of_only_rejected_rows_paces_from_its_first_row_not_the_epoch(
        kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file whose every row is rejected (negative user ids) but has a valid time: its dead letters were paced from
    event time 0 (the first accepted event's time, of which there was none), so --speed 1 slept 54 years before the
    first of them. Now event time counts from the first row's own time: two rows 1 s apart at speed 1 wait ~1 s."""
    log = tmp_path / "log.csv"
    log.write_text("user_id,item_id,ts,clicked\n-1,2,1700000000000,1\n-1,3,1700000001000,0\n")
    table = load_eventlog(log, ColumnMap(), ClickDelay(), seed=1)
    sleeps = _recorded_sleeps(monkeypatch)
    summary = publish(table, kafka, "log", speed=1.0)
    assert summary.dead_lettered == 2
    assert sleeps and max(sleeps) < 2.0, sleeps


def test_a_row_rejected_for_a_time_ahead_of_the_wall_clock_does_not_pace_the_replay(
        kafka: KafkaSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row dated 2099 (a typo) is rejected at the source as future_ts, but its dead letter kept that time in the
    replay order: --speed counted the replay's event time up to it, so at speed 1 a log of one second was refused as
    pacing over a year, and at a speed that let it through the replay slept for months after its last event before
    sending that dead letter. Its time is no usable time now (as one out of range): it paces nothing."""
    log = tmp_path / "log.csv"
    log.write_text("user_id,item_id,ts,clicked\n1,2,1700000000000,0\n3,4,4000000000000,0\n5,6,1700000000500,0\n")
    table = load_eventlog(log, ColumnMap(), ClickDelay(), seed=1)
    sleeps = _recorded_sleeps(monkeypatch)
    summary = publish(table, kafka, "log", speed=1.0)
    assert (summary.impressions, summary.dead_lettered) == (2, 1)
    assert table.raw[0].error is not None and table.raw[0].error.kind == "future_ts"  # type: ignore[attr-defined]
    assert max(sleeps, default=0.0) < 2.0, sleeps


def test_synthetic_replay_is_deterministic_by_seed(kafka: KafkaSettings) -> None:
    s = SyntheticSettings(impressions=2000)
    publish(build_synthetic(s, ClickDelay(), seed=11), kafka, "synthetic")
    first = sorted(r.value for r in read_topic(kafka, kafka.impressions_topic))
    again = build_synthetic(s, ClickDelay(), seed=11)
    assert [orjson.loads(v)["impression_id"] for v in first][:3] == sorted(again.impression_id.tolist())[:3]
    assert len(first) == 2000


def test_a_paced_replay_serves_its_event_counts_while_it_runs(kafka: KafkaSettings) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "replay", "--dataset", "ml-100k", "--limit", "400",
                             "--rate", "100", "--no-progress", "--metrics-port", str(port),
                             "--bootstrap-servers", kafka.bootstrap_servers],
                            env={**os.environ, "STREAMREC_KAFKA_IMPRESSIONS_TOPIC": kafka.impressions_topic,
                                 "STREAMREC_KAFKA_CLICKS_TOPIC": kafka.clicks_topic},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    series = f'streamrec_events_total{{stage="replay",topic="{kafka.impressions_topic}"}}'
    seen: list[float] = []
    try:
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:  # ~600 events at 100/s: ~6 s
            value = metric(scrape(f"http://127.0.0.1:{port}/metrics"), series)  # None while not listening yet
            if value is not None:
                seen.append(value)
            time.sleep(0.5)
        assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    # counted as the events go out, not once at the end: several distinct values were scraped mid-run
    assert len(set(seen)) >= 3 and seen == sorted(seen) and 0 < seen[-1] <= 400


def _replay_config(tmp_path: Path, kafka: KafkaSettings, extra: str = "") -> Path:
    """A config file replaying into ``kafka``'s topics (``extra``: a [kafka.extra] body)."""
    cfg = tmp_path / "replay.toml"
    cfg.write_text(
        f'[kafka]\nbootstrap_servers = "{kafka.bootstrap_servers}"\nimpressions_topic = "{kafka.impressions_topic}"\n'
        f'clicks_topic = "{kafka.clicks_topic}"\n' + (f"[kafka.extra]\n{extra}\n" if extra else "")
        + "[replay]\nprogress = false\n")
    return cfg


def _create(kafka: KafkaSettings, topic: str, max_message_bytes: int) -> None:
    admin = AdminClient(admin_config(kafka))
    for fut in admin.create_topics([NewTopic(topic, 1, 1, config={"max.message.bytes": str(max_message_bytes)})],
                                   operation_timeout=10).values():
        fut.result()


@pytest.mark.parametrize("where", ["topic max.message.bytes", "[kafka.extra] message.max.bytes"])
def test_a_replay_event_over_its_topic_limit_exits_2_naming_the_topic_and_the_limit(
        where: str, kafka: KafkaSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An event log of ten impressions, the sixth with a context of ~9.5 kB, into an impressions topic created with
    ``max.message.bytes=8000`` (the local broker reports it by DescribeConfigs but takes larger records all the same;
    Apache Kafka refuses them at delivery), or through a producer whose own limit is 8000 (librdkafka refuses a
    larger record at produce). The replay learns the limit at start and stops with a MessageLimitError (exit 2)
    naming the topic, the event, the limit and what to raise, before sending the chunk. It wrote the event over the
    topic's limit (exit 0 here; exit 1 at Apache Kafka's refusal), or failed with exit 1 at the producer's refusal."""
    n, big = 10, 5
    log = tmp_path / "log.parquet"
    pq.write_table(pa.table({
        "imp": [f"imp{i}" for i in range(n)], "user_id": list(range(n)), "item_id": list(range(n)),
        "ts": [1_700_000_000_000 + i for i in range(n)], "clicked": [0] * n,
        "tags": pa.array([["t" * 90] * 100 if i == big else ["a"] for i in range(n)], pa.list_(pa.string()))}), log)
    if where == "topic max.message.bytes":
        _create(kafka, kafka.impressions_topic, 8000)
        cfg, fix = _replay_config(tmp_path, kafka), f"--entity-name {kafka.impressions_topic}"
    else:
        cfg, fix = _replay_config(tmp_path, kafka, '"message.max.bytes" = "8000"'), f"raise {where}"
    assert main(["replay", "--config", str(cfg), "--dataset", str(log), "--time-unit", "ms", "--impression-id-col",
                 "imp", "--feature-cols", "tags"]) == 2
    err = capsys.readouterr().err
    topic = re.escape(kafka.impressions_topic)
    assert re.search(rf"an event for {topic} \(key 'imp{big}'\) is 9\d\d\d bytes, over the 6936 bytes a record of "
                     rf"{topic} may be \(its limit 8000 bytes, {re.escape(where)}\)", err), err
    assert fix in err and "\n" not in err.strip()
    assert read_topic(kafka, kafka.impressions_topic) == []  # nothing of the chunk was sent


class _Refused:
    """What librdkafka's delivery report carries for a record the broker refused as too large."""

    def __init__(self, topic: str, value: bytes, key: bytes) -> None:
        self._topic, self._value, self._key = topic, value, key

    def topic(self) -> str:
        return self._topic

    def value(self) -> bytes:
        return self._value

    def key(self) -> bytes:
        return self._key


def test_a_replay_message_the_broker_refuses_as_too_large_exits_2_naming_the_topic_and_its_learned_limit(
        kafka: KafkaSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A broker that refuses an impression at delivery (MSG_SIZE_TOO_LARGE in the delivery report) although it was
    under the 100000 bytes its topic reported (a limit lowered since, a broker whose own limit is lower; the local
    broker does not enforce limits, so the report is given here, on the replay's send_run path). The flush raised
    MessageTooLarge: a generic failure, exit 1. Now it is a MessageLimitError (exit 2) in the joiner's and the dead
    letters' words, naming the topic, the limit learned for it and what to set."""
    _create(kafka, kafka.impressions_topic, 100_000)

    class RefusingProducer(AckedProducer):
        def send_run(self, topics: list[str], values: list[bytes | None], keys: list[Any],
                     partitions: list[int]) -> None:
            super().send_run(topics, values, keys, partitions)
            at = topics.index(kafka.impressions_topic)
            key = keys[at].encode() if isinstance(keys[at], str) else keys[at]
            self._on_error(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE),
                           _Refused(topics[at], values[at] or b"", key or b""))

    monkeypatch.setattr(publisher_module, "AckedProducer", RefusingProducer)
    assert main(["replay", "--config", str(_replay_config(tmp_path, kafka)), "--dataset", "synthetic",
                 "--syn-impressions", "50"]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"{re.escape(kafka.impressions_topic)} was refused by the broker as too large.*sized under "
                     rf"100000 bytes, the limit learned for it \(topic max\.message\.bytes\).*--entity-name "
                     rf"{re.escape(kafka.impressions_topic)}", err)


def test_an_encoder_failure_mid_replay_delivers_the_chunks_sent_before_it_and_says_how_many(
        kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An exception from the encoder in the second chunk (a bug, a table it cannot encode) left the first chunk's
    4096 events produced but never flushed: the error escaped with the producer unflushed, so what it still held was
    lost when it was destroyed, and nothing said how many events had gone out. Now the replay flushes what it sent
    before the error goes on, and logs the events acknowledged per topic and those not sent."""
    from stream.replay.encoding import EventEncoder

    table = build_synthetic(SyntheticSettings(impressions=6000, base_ctr=0.0001, duplicate_click_share=0,
                                              orphan_click_share=0), ClickDelay(), seed=3)
    real, calls = EventEncoder.impressions, [0]

    def failing(self: EventEncoder, rows: np.ndarray) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise ValueError("cannot encode this chunk")
        return real(self, rows)

    monkeypatch.setattr(EventEncoder, "impressions", failing)
    with pytest.raises(ValueError, match="cannot encode this chunk"):
        publish(table, kafka, "synthetic", linger_ms=5000)  # the first chunk waits in the producer
    notes = caplog.text
    imps = read_topic(kafka, kafka.impressions_topic)
    clicks = read_topic(kafka, kafka.clicks_topic)
    assert len(imps) + len(clicks) == publisher_module.CHUNK  # the whole first chunk, nothing of the second
    counts = {kafka.clicks_topic: len(clicks), kafka.impressions_topic: len(imps)}
    assert f"acknowledged per topic {({t: n for t, n in sorted(counts.items()) if n})}" in notes
    unsent = table.n_impressions + table.n_clicks - publisher_module.CHUNK
    assert f"{unsent} events not sent or not acknowledged" in notes


def test_a_sigterm_mid_replay_delivers_what_was_sent_says_how_many_and_exits_143(kafka: KafkaSettings,
                                                                                 tmp_path: Path) -> None:
    """A paced replay stopped by SIGTERM (a process manager's stop: systemd, docker, kubernetes) died at once: the
    events it had produced (counted as replayed on /metrics) were lost with the producer, which a 5 s linger still
    held, and nothing said how many went out. Now it stops as an error stops it: what was sent is flushed, the
    events acknowledged per topic are logged, and the exit status is a SIGTERM's (128 + 15)."""
    cfg = _replay_config(tmp_path, kafka)
    cfg.write_text(cfg.read_text() + "linger_ms = 5000\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "replay", "--config", str(cfg), "--dataset",
                             "synthetic", "--syn-impressions", "2000", "--rate", "100", "--metrics-port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    series = f'streamrec_events_total{{stage="replay",topic="{kafka.impressions_topic}"}}'
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:  # until some events went out (well within 5 s)
            if (metric(scrape(f"http://127.0.0.1:{port}/metrics"), series) or 0) > 0:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the replay ended before it was stopped"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 128 + signal.SIGTERM, (rc, err)
    imps, clicks = read_topic(kafka, kafka.impressions_topic), read_topic(kafka, kafka.clicks_topic)
    assert imps, err  # what was sent before the signal is delivered, not lost with the producer
    counts = {t: n for t, n in sorted({kafka.clicks_topic: len(clicks), kafka.impressions_topic: len(imps)}.items())
              if n}
    assert f"acknowledged per topic {counts}" in err, err


@contextmanager
def _own_broker(kafka: KafkaSettings) -> Iterator[tuple[Service, KafkaSettings]]:
    """A Tansu broker of the test's own (one it may freeze or stop), and ``kafka`` pointed at it; thawed and stopped
    at the end."""
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    broker = Service([str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
                      "--storage-engine", "memory://tansu/"], port)
    broker.start()
    try:
        yield broker, dataclasses.replace(kafka, bootstrap_servers=f"127.0.0.1:{port}")
    finally:
        if broker.proc is not None:
            broker.proc.send_signal(signal.SIGCONT)
        broker.stop()


def _stopped_while_its_flush_waits(kafka: KafkaSettings, tmp_path: Path, second: signal.Signals) -> tuple[int, str]:
    """A paced replay against a broker of its own, frozen (SIGSTOP) once events went out, then stopped by SIGTERM,
    and by ``second`` once it says its stop's flush waits: its exit status and stderr."""
    with _own_broker(kafka) as (broker, own):
        return _stopped_on(broker, own, tmp_path, second)


def _stopped_on(broker: Service, own: KafkaSettings, tmp_path: Path, second: signal.Signals) -> tuple[int, str]:
    """:func:`_stopped_while_its_flush_waits` on ``broker``, which ``own`` points at."""
    metrics_port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "replay", "--config", str(_replay_config(
        tmp_path, own)), "--dataset", "synthetic", "--syn-impressions", "2000", "--rate", "100", "--metrics-port",
        str(metrics_port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        # (an ignored SIGINT is inherited: a test run started in the background ignores it, and so would the replay)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    series = f'streamrec_events_total{{stage="replay",topic="{own.impressions_topic}"}}'
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:  # until some events went out
            if (metric(scrape(f"http://127.0.0.1:{metrics_port}/metrics"), series) or 0) > 0:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the replay ended before it was stopped"
        assert broker.proc is not None and proc.stderr is not None
        broker.proc.send_signal(signal.SIGSTOP)  # nothing sent from now on is acknowledged: the stop's flush waits
        proc.send_signal(signal.SIGTERM)
        for line in proc.stderr:  # until it says it waits
            lines.append(line)
            if "stopping (Terminated): waiting up to" in line:
                proc.send_signal(second)
                break
        rc = proc.wait(timeout=60)
        return rc, "".join(lines) + proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_second_sigterm_cuts_the_stop_flush_short_and_still_logs_the_acknowledged_counts_and_exits_143(
        kafka: KafkaSettings, tmp_path: Path) -> None:
    """The first SIGTERM flushes what was sent for up to 30 s; a second one (a process manager that stops again, or
    an operator who will not wait) was raised out of that flush: the counts were never logged. Here the replay's own
    broker is frozen (SIGSTOP) before the first SIGTERM, so the flush waits; the second SIGTERM, sent once the replay
    says it is waiting, ends it with the per-topic line (a lower bound) and a SIGTERM's status."""
    rc, err = _stopped_while_its_flush_waits(kafka, tmp_path, signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, (rc, err)
    assert "Traceback" not in err, err
    assert re.search(r"\[replay\] stopped \(Terminated\) after sending part of its \d+ events: acknowledged per "
                     r"topic \{.*\}; \d+ events not sent or not acknowledged \(its flush cut short by a SIGTERM\)",
                     err), err


def test_a_ctrl_c_during_the_stop_flush_cuts_it_short_and_still_logs_the_acknowledged_counts(
        kafka: KafkaSettings, tmp_path: Path) -> None:
    """The stop's flush after an error or a SIGTERM waits up to 30 s; an operator at the terminal presses Ctrl-C to
    stop waiting. That KeyboardInterrupt was raised out of the flush past the handler that counts: the per-topic line
    was never logged and the first stop's status was lost (exit 130). Now a Ctrl-C cuts the wait short as a second
    SIGTERM does: the line is logged (a lower bound) and the first stop's status goes on (143). The replay's own
    broker is frozen (SIGSTOP) so that the flush waits."""
    rc, err = _stopped_while_its_flush_waits(kafka, tmp_path, signal.SIGINT)
    assert "Traceback" not in err, err
    assert re.search(r"\[replay\] stopped \(Terminated\) after sending part of its \d+ events: acknowledged per "
                     r"topic \{.*\}; \d+ events not sent or not acknowledged \(its flush cut short by a Ctrl-C\)",
                     err), err
    assert rc == 128 + signal.SIGTERM, (rc, err)


def test_the_replays_last_flush_waits_for_librdkafkas_answer_to_every_message_not_a_fixed_minute(
        kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The end of a replay flushed for 60 s while librdkafka retries a message for its delivery timeout (300 s by
    default): a broker away for 1-5 minutes at the end made the replay report as unacknowledged (exit 1) messages
    librdkafka went on to deliver, and the rerun the error advises sent them twice. The last flush now waits for the
    producer's delivery timeout (here ``[kafka.extra] message.timeout.ms`` = 90 s) and a margin."""
    waits: list[float] = []
    wait = AckedProducer._wait_told  # the last flush's wait (the one that says it waits)

    def recorded(self: AckedProducer, timeout_s: float) -> Any:
        waits.append(timeout_s)
        return wait(self, timeout_s)

    monkeypatch.setattr(AckedProducer, "_wait_told", recorded)
    slow = dataclasses.replace(kafka, extra={"message.timeout.ms": "90000"})
    summary = publish(build_synthetic(SyntheticSettings(impressions=200), ClickDelay(), seed=1), slow, "synthetic")
    assert sum(summary.acked.values()) == summary.impressions + summary.clicks > 0
    assert waits and waits[-1] >= 90 + 5, waits
    forever = AckedProducer(dataclasses.replace(kafka, extra={"message.timeout.ms": "0"}))  # 0: librdkafka never
    assert forever.delivery_timeout_s == float("inf")  # times out, so neither does the flush
    assert AckedProducer(dataclasses.replace(kafka, extra={"delivery.timeout.ms": "120000"})).delivery_timeout_s == 120


def _freeze(proc: subprocess.Popen) -> None:
    """SIGSTOP ``proc`` and return once it is stopped (the signal takes effect when it is next scheduled: a broker
    still running for a moment acknowledged what was sent right after)."""
    proc.send_signal(signal.SIGSTOP)
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.01)


class _OnLine(logging.Handler):
    """Calls ``then()`` at the first record of its logger whose message holds ``text``."""

    def __init__(self, text: str, then: Any) -> None:
        super().__init__()
        self.text, self.then, self.done = text, then, False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.done and self.text in record.getMessage():
            self.done = True
            self.then()


def test_the_replays_last_flush_says_what_it_waits_for_and_how_many_stay_unanswered_while_it_waits(
        kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The replay's last flush (``flush_answered``) waits up to the producer's delivery timeout and a margin (~305 s
    by default) with a broker slow or down, and said nothing all that time: an operator could not tell a hung replay
    from a waiting one. Now a wait past a few seconds is told (how many messages, how long at most), then how many
    are still unanswered every few seconds. Here the broker is frozen (SIGSTOP) with ten messages unanswered, and
    thawed at the first "still waiting" line: the flush then ends with every message acknowledged. (The quiet
    and telling intervals are shortened; without the lines the flush would run out its 20 s delivery timeout.)"""
    monkeypatch.setattr(kafka_producer, "FLUSH_QUIET_S", 0.2)
    monkeypatch.setattr(kafka_producer, "FLUSH_TELL_S", 0.2)
    with _own_broker(kafka) as (broker, own):
        topic = own.impressions_topic
        ensure_topics(own, [topic])
        producer = AckedProducer(dataclasses.replace(own, extra={"message.timeout.ms": "20000"}))
        producer.send(topic, b"first", "k")
        producer.flush(30)  # connected, the topic's leader known
        assert broker.proc is not None
        proc = broker.proc
        thaw = _OnLine("still waiting", lambda: proc.send_signal(signal.SIGCONT))
        kafka_log = logging.getLogger("streamrec.kafka")
        kafka_log.addHandler(thaw)
        try:
            _freeze(proc)
            for n in range(10):
                producer.send(topic, b"waits", str(n))
            report = producer.flush_answered()
        finally:
            kafka_log.removeHandler(thaw)
    assert report.acked == {topic: 11} and report.failed == 0
    said = [r.getMessage() for r in caplog.records if r.name == "streamrec.kafka"]
    assert any(re.match(rf"waiting for 10 message\(s\) to be acknowledged by {own.bootstrap_servers} \(up to \d+ s "
                        r"more: the producer's delivery timeout and a margin\)", m) for m in said), said
    assert any(re.match(r"still waiting for \d+ message\(s\) to be acknowledged by .* \(up to \d+ s more\)", m)
               for m in said), said


def test_a_paced_replay_serves_librdkafkas_reports_while_it_paces_not_every_5000_events(
        kafka: KafkaSettings) -> None:
    """A paced replay served the producer's callbacks (a poll) only every 5,000 events: at ``--rate 10`` every 500 s,
    so librdkafka's reports of a broker gone (its log lines, a fatal error) came minutes late, here only at the last
    flush. Now it serves them at each paced sleep. A replay of ~240 events at 60/s into a broker of its own, stopped
    once events went out: librdkafka's first line about it is logged while the replay still sends."""
    table = build_synthetic(SyntheticSettings(impressions=200), ClickDelay(), seed=1)
    total = table.n_impressions + table.n_clicks
    sent_at_first_line: list[float] = []

    def sent() -> float:
        return sum(EVENTS.labels("replay", t)._value.get() for t in (kafka.impressions_topic, kafka.clicks_topic))

    told = _OnLine("", lambda: sent_at_first_line.append(sent()))
    rdkafka_log = logging.getLogger("streamrec.kafka.librdkafka")
    failed: list[BaseException] = []
    with _own_broker(kafka) as (broker, own):
        fast_fail = dataclasses.replace(own, extra={"message.timeout.ms": "3000"})  # the last flush gives up soon

        def replay() -> None:
            try:
                publish(table, fast_fail, "synthetic", rate=60)
            except Exception as exc:  # noqa: BLE001 - the broker is gone: the replay fails, as it should
                failed.append(exc)

        thread = threading.Thread(target=replay)
        thread.start()
        try:
            while sent() < 20 and thread.is_alive():  # until events went out (well within a second)
                time.sleep(0.02)
            rdkafka_log.addHandler(told)
            assert broker.proc is not None
            # killed, not stopped: a SIGTERM'd broker may finish serving its open connections first, and the replay
            # then succeeded (1 run in ~10 failed so)
            kill_and_reap(broker.proc)
            thread.join()
        finally:
            rdkafka_log.removeHandler(told)
            thread.join()
    assert failed, "the replay into a stopped broker succeeded"
    assert sent_at_first_line and sent_at_first_line[0] < total, (sent_at_first_line, total)


def test_a_paced_replays_progress_moves_while_it_paces_not_every_5000_events(
        kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A paced replay's progress (the bar) moved only every 5,000 events: at ``--rate 10`` every 500 s. Now the
    pacer's sleeps move it, at most every PROGRESS_S (0.3 s here): a ~200-event replay at 100/s reports part of its
    events while it still sends, never twice within PROGRESS_S, and all of them by the end."""
    monkeypatch.setattr(publisher_module, "PROGRESS_S", 0.3)
    table = build_synthetic(SyntheticSettings(impressions=200, base_ctr=0.0001), ClickDelay(), seed=3)
    total = table.n_impressions + table.n_clicks + len(table.raw)
    reports: list[tuple[float, int]] = []  # (when, events reported so far)

    def progress(n: int) -> None:
        reports.append((time.monotonic(), (reports[-1][1] if reports else 0) + n))

    publish(table, kafka, "synthetic", rate=100, progress=progress)
    assert reports[-1][1] == total
    mid_run = [r for r in reports if r[1] < total]
    assert len(mid_run) >= 2, reports
    gaps = [b[0] - a[0] for a, b in zip(mid_run, mid_run[1:], strict=False)]
    assert min(gaps) >= 0.3, gaps


def test_a_paced_replay_into_a_broker_gone_stops_at_the_first_failed_delivery_not_at_its_last_flush(
        kafka: KafkaSettings, caplog: pytest.LogCaptureFixture) -> None:
    """A delivery the producer reported failed (here timed out: the replay's broker killed once events went out, a
    2 s ``message.timeout.ms``) was raised only at the replay's last flush: a paced replay sending into a topic it
    cannot write went on for its whole length (hours at a low ``--rate``) before it said anything. Now the pacer's
    poll raises it: the ~2,000-event replay at 50/s (~40 s) stops after a fraction of its events, not after all of
    them, with the stop's per-topic counts; the error is the broker watch's BrokerUnreachable (a DeliveryFailed naming
    the limit that ran out: here the 2 s delivery timeout), not the timeouts' generic DeliveryFailed."""
    table = build_synthetic(SyntheticSettings(impressions=2000, base_ctr=0.0001), ClickDelay(), seed=1)
    total = table.n_impressions + table.n_clicks + len(table.raw)

    def sent() -> float:
        return sum(EVENTS.labels("replay", t)._value.get() for t in (kafka.impressions_topic, kafka.clicks_topic))

    failed: list[tuple[BaseException, float]] = []  # (the error, the events sent when it came)
    with _own_broker(kafka) as (broker, own):
        fast_fail = dataclasses.replace(own, extra={"message.timeout.ms": "2000"})

        def replay() -> None:
            try:
                publish(table, fast_fail, "synthetic", rate=50)
            except Exception as exc:  # noqa: BLE001 - the broker is gone: the replay fails, as it should
                failed.append((exc, sent()))

        thread = threading.Thread(target=replay)
        thread.start()
        try:
            while sent() < 20 and thread.is_alive():  # until events went out
                time.sleep(0.02)
            assert broker.proc is not None
            kill_and_reap(broker.proc)
        finally:
            thread.join()
    assert failed, "the replay into a killed broker succeeded"
    (exc, sent_when_stopped), = failed
    assert type(exc) is BrokerUnreachable, exc  # the broker silent: said as such, not as the timeouts it caused
    assert re.match(rf"Kafka at {own.bootstrap_servers} acknowledged nothing for \d+ s and messages waited the "
                    r"replay's limit \(\[kafka.extra\] message.timeout.ms = 2 s\).*Is the broker up", str(exc)), exc
    assert sent_when_stopped < total / 2, (sent_when_stopped, total)
    assert re.search(rf"\[replay\] stopped \(BrokerUnreachable\) after sending part of its {total} events: "
                     r"acknowledged per topic \{.*\}; \d+ events not sent or not acknowledged", caplog.text), \
        caplog.text


def test_an_unpaced_replay_into_a_broker_gone_stops_at_the_chunk_after_the_first_failed_delivery(
        kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unpaced side of the test above: its broker killed as the second chunk is encoded, a producer queue of
    3,000 messages (each chunk then waits for the dead broker's timeouts, 2 s) went on through every chunk and raised
    only at its last flush. Now the per-chunk poll raises the first failed delivery: it stops within a chunk or two of
    it, long before its twelve chunks went out."""
    from stream.replay.encoding import EventEncoder

    table = build_synthetic(SyntheticSettings(impressions=12 * publisher_module.CHUNK, base_ctr=0.0001,
                                              duplicate_click_share=0, orphan_click_share=0), ClickDelay(), seed=2)
    total = table.n_impressions + table.n_clicks + len(table.raw)

    def sent() -> float:
        return sum(EVENTS.labels("replay", t)._value.get() for t in (kafka.impressions_topic, kafka.clicks_topic))

    with _own_broker(kafka) as (broker, own):
        real, calls = EventEncoder.impressions, [0]

        def killing(self: EventEncoder, rows: np.ndarray) -> Any:
            calls[0] += 1
            if calls[0] == 2:  # the first chunk went out
                assert broker.proc is not None
                kill_and_reap(broker.proc)
            return real(self, rows)

        monkeypatch.setattr(EventEncoder, "impressions", killing)
        fast_fail = dataclasses.replace(own, extra={"message.timeout.ms": "2000",
                                                     "queue.buffering.max.messages": "3000"})
        with pytest.raises(BrokerUnreachable, match="the replay stopped with \\d+ message\\(s\\) unacknowledged"):
            publish(table, fast_fail, "synthetic")
    assert sent() <= 4 * publisher_module.CHUNK < total / 2, (sent(), total)


def _replay_on_a_broker_gone(kafka: KafkaSettings, tmp_path: Path, fault: signal.Signals) -> tuple[int, str]:
    """A paced CLI replay (``--broker-wait-s 6``) into a broker of its own, which gets ``fault`` (SIGKILL or SIGSTOP)
    once events went out: its exit status and stderr. Waited for up to 60 s, a hang guard: librdkafka's own delivery
    timeout, which alone bounded such a replay, is 300 s."""
    with _own_broker(kafka) as (broker, own):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "replay", "--config",
                                 str(_replay_config(tmp_path, own)), "--dataset", "synthetic", "--syn-impressions",
                                 "2000", "--rate", "100", "--broker-wait-s", "6", "--metrics-port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        series = f'streamrec_events_total{{stage="replay",topic="{own.impressions_topic}"}}'
        try:
            while proc.poll() is None:  # until some events went out
                if (metric(scrape(f"http://127.0.0.1:{port}/metrics"), series) or 0) > 0:
                    break
                time.sleep(0.05)
            assert proc.poll() is None and broker.proc is not None, "the replay ended before its broker's fault"
            if fault is signal.SIGKILL:
                kill_and_reap(broker.proc)
            else:
                _freeze(broker.proc)
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                rc = None
            proc.kill()
            return rc, proc.stderr.read() if proc.stderr else ""
        finally:
            if proc.poll() is None:
                proc.kill()


def test_a_replay_whose_broker_is_killed_says_it_cannot_reach_it_and_exits_1_after_broker_wait_s(
        kafka: KafkaSettings, tmp_path: Path) -> None:
    """The replay's broker killed (SIGKILL) mid-replay: the replay went on for librdkafka's delivery timeout (300 s),
    saying nothing of its own. Now librdkafka's report of the broker gone (error_cb: all brokers down, connection
    refused) is said at once, naming the limit, and the replay fails (exit 1) once its ``--broker-wait-s`` passed
    without an acknowledgement, with an error naming the broker and the setting, and the acknowledged counts."""
    rc, err = _replay_on_a_broker_gone(kafka, tmp_path, signal.SIGKILL)
    assert rc == 1, (rc, err)
    said = re.search(r"\[replay\] Kafka at \S+ cannot be reached \(.*\); \d+ message\(s\) wait for it: the replay "
                     r"waits up to 6 s for an acknowledgement \(\[replay\] broker_wait_s \(--broker-wait-s\)\)", err)
    stopped = re.search(r"\[replay\] stopped \(BrokerUnreachable\) after sending part of its \d+ events: "
                        r"acknowledged per topic \{.*\}; \d+ events not sent or not acknowledged", err)
    assert said and stopped and said.start() < stopped.start(), err
    assert re.search(r"Kafka at \S+ acknowledged nothing for \d+ s and messages waited the replay's limit \(\[replay\] "
                     r"broker_wait_s \(--broker-wait-s\) = 6 s\)", err), err


def test_a_replay_whose_broker_is_frozen_says_it_waits_on_it_and_exits_1_after_broker_wait_s(
        kafka: KafkaSettings, tmp_path: Path) -> None:
    """A frozen broker (SIGSTOP: its connections stay open, librdkafka reports nothing until its socket timeout, 60 s)
    held the replay silently for librdkafka's delivery timeout (300 s). Now the replay says it waits once nothing was
    acknowledged for a few seconds, and fails (exit 1) after its ``--broker-wait-s``."""
    rc, err = _replay_on_a_broker_gone(kafka, tmp_path, signal.SIGSTOP)
    assert rc == 1, (rc, err)
    said = re.search(r"\[replay\] Kafka at \S+ has acknowledged nothing for \d+ s; \d+ message\(s\) wait for it: the "
                     r"replay waits up to 6 s", err)
    stopped = re.search(r"\[replay\] stopped \(BrokerUnreachable\) after sending part of its \d+ events", err)
    assert said and stopped and said.start() < stopped.start(), err


def test_a_broker_frozen_and_thawed_within_broker_wait_s_loses_and_duplicates_nothing(
        kafka: KafkaSettings, caplog: pytest.LogCaptureFixture) -> None:
    """A broker frozen (SIGSTOP) mid-replay and thawed within ``broker_wait_s``: the replay says it waits (a log line,
    its progress status), says the broker answers again, and goes on; every event is delivered once (the idempotent
    producer's retries), the acknowledged counts are the topics' own. Thawed at the replay's "waits" line."""
    table = build_synthetic(SyntheticSettings(impressions=600, base_ctr=0.05), ClickDelay(), seed=4)
    statuses: list[str | None] = []
    with _own_broker(kafka) as (broker, own):
        assert broker.proc is not None
        proc = broker.proc
        frozen: list[bool] = []

        def progress(_n: int) -> None:
            if not frozen:  # the first events went out (progress moves at most every 2 s while it paces)
                frozen.append(True)
                _freeze(proc)

        thaw = _OnLine("wait for it", lambda: proc.send_signal(signal.SIGCONT))
        replay_log = logging.getLogger("streamrec.replay")
        replay_log.addHandler(thaw)
        try:
            summary = publish(table, own, "synthetic", rate=60, broker_wait_s=60, progress=progress,
                              status=statuses.append)
        finally:
            replay_log.removeHandler(thaw)
        imps, clicks = read_topic(own, own.impressions_topic), read_topic(own, own.clicks_topic)
    assert frozen and thaw.done, caplog.text
    assert re.search(r"Kafka at \S+ acknowledges again after \d+ s; the replay goes on", caplog.text), caplog.text
    assert any(s and s.startswith("waiting for the broker") for s in statuses) and statuses[-1] is None, statuses
    assert len(imps) == table.n_impressions and len(clicks) == table.n_clicks, (len(imps), len(clicks))
    assert len({r.value for r in imps}) == len(imps) and len({r.value for r in clicks}) == len(clicks)
    assert summary.acked == {own.clicks_topic: len(clicks), own.impressions_topic: len(imps)}


def test_a_replay_whose_bootstrap_also_names_a_broker_down_does_not_say_it_waits_on_the_broker(
        kafka: KafkaSettings, caplog: pytest.LogCaptureFixture) -> None:
    """One broker of the bootstrap list refusing connections while another acknowledges every message (a cluster with
    a broker down) is no broker gone: the replay says no wait and its progress line never waits. librdkafka's
    error_cb reports each refused connection; connections to every broker listed (sparse connections off) make the
    refusal certain to happen during the replay."""
    table = build_synthetic(SyntheticSettings(impressions=200, base_ctr=0.05), ClickDelay(), seed=5)
    bootstrap = f"{kafka.bootstrap_servers},127.0.0.1:{free_port()}"
    settings = dataclasses.replace(kafka, bootstrap_servers=bootstrap,
                                   extra={**kafka.extra, "enable.sparse.connections": "false"})
    statuses: list[str | None] = []
    with caplog.at_level(logging.WARNING, logger="streamrec.replay"):
        summary = publish(table, settings, "synthetic", rate=100, broker_wait_s=60, status=statuses.append)
    assert summary.impressions == table.n_impressions
    assert "cannot be reached" not in caplog.text and "acknowledged nothing" not in caplog.text, caplog.text
    assert not any(s and s.startswith("waiting for the broker") for s in statuses), statuses


def test_a_broker_frozen_at_the_replays_final_flush_is_said_once_and_ends_it_as_unreachable_naming_the_unacked(
        kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Every event handed to the producer, its broker frozen (SIGSTOP) before they were acknowledged: the final flush
    (``flush_answered``) waited without the broker watch, so the replay said nothing of its own while it waited, and
    gave up with the timeouts' generic DeliveryFailed, whose stop then waited
    :data:`~stream.replay.publisher.STOP_FLUSH_S` more. Now the final flush is watched: one line says it waits for the
    broker at the final flush, and the watch's BrokerUnreachable, naming how many messages were not acknowledged, ends
    it (exit 1 from the CLI, as for a broker gone mid-replay)."""
    monkeypatch.setattr(publisher_module, "CHUNK", 100)  # the broker frozen after the first of three chunks
    table = build_synthetic(SyntheticSettings(impressions=300, base_ctr=0.0001), ClickDelay(), seed=1)
    with _own_broker(kafka) as (broker, own):
        assert broker.proc is not None
        proc = broker.proc
        frozen: list[int] = []

        def freeze_once(n: int) -> None:  # progress, after a chunk went out: the rest is sent to a frozen broker
            if not frozen:
                frozen.append(n)
                _freeze(proc)

        with pytest.raises(BrokerUnreachable) as caught:
            publish(table, own, "synthetic", broker_wait_s=3, progress=freeze_once)
    unacked = re.search(r"the replay stopped at its final flush with (\d+) message\(s\) unacknowledged",
                        str(caught.value))
    assert unacked and int(unacked[1]) >= 200, caught.value  # the two chunks sent to the frozen broker at least
    said = [r.getMessage() for r in caplog.records if "at its final flush" in r.getMessage()]
    assert len(said) == 1 and re.match(rf"\[replay\] Kafka at {own.bootstrap_servers} has acknowledged nothing for "
                                       r"\d+ s; \d+ message\(s\) wait for it at its final flush", said[0]), said
