"""Backpressure between the inputs, against the real broker: clicks that run ahead of their impressions are held
back instead of given up past ``max_waiting_per_partition`` (``stream/joiner/backpressure.py``).

The stream: a synthetic log at a 50% click rate whose impressions carry ~1.5 KB of context each (a click is
~150 bytes), copied into the test's topics in small record batches and read by a consumer that fetches at
most 64 KB per partition per request: every fetch brings the clicks of ~25x as many impressions as it brings
impressions, so clicks run ahead whatever the interleaving of fetches. It spans eight attribution windows, so
an impression expires while the run goes on. Without the gate (``backpressure = false``) the waiting
clicks pass the cap and the furthest are given up as ``overflow`` (their impressions become negatives): the
first test shows the stream is hostile enough, for each driver. With it, every impression has exactly its label. The
64 KB fetch limit is librdkafka's ``max.partition.fetch.bytes``, which the faust driver maps onto faust's own fetch
size (until 2026-12-03 it ignored it, fetched 8 MB per partition, and this stream was not hostile for it at all).
``tests/integration/test_join_pipeline.py`` shows a held click input is not taken for an idle one.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections import Counter

import pytest
from confluent_kafka import OFFSET_BEGINNING, Producer, TopicPartition

from stream.config import KafkaSettings
from stream.joiner.backpressure import CLICKS, IMPRESSIONS
from stream.joiner.config import JoinerSettings
from stream.joiner.kafka_driver import KafkaJoinWorker
from stream.kafka import producer_config
from stream.kafka_topics import ensure_topics
from stream.replay.config import ClickDelay, SyntheticSettings
from stream.replay.publisher import publish
from stream.replay.synthetic import build_synthetic
from stream.replay.table import EventTable
from stream.samples import DELAYED_POSITIVE, SampleBatch
from stream.unfetched import UNFETCHED_GRACE_S
from tests.integration.test_joiner import expected_join, join_cmd, join_env, read_samples
from tests.joiner_stubs import assigning_pipeline
from tests.kafka_io import read_topic

WINDOW = 30.0  # attribution window (s); the stream spans 250 s of event time
# (10_000 until 2026-12-06: the clicks run ~25x ahead in every fetch whatever the stream's length, so half of it
# is as hostile, in half the time)
SYN = SyntheticSettings(impressions=5_000, users=2_500, items=500, impressions_per_s=20.0, base_ctr=0.5,
                        attribution_window_s=WINDOW, malformed_share=0.0)
CAP = 100  # max_waiting_per_partition
BATCH = 20  # batch_max: the gate pauses at min(80% of the cap, cap - one batch)
PAD = list(range(300))  # ~1.5 KB of context on every impression


def _publish_hostile(kafka: KafkaSettings, syn: SyntheticSettings, heavy: str = "impressions",
                     orphan_burst: int = 0) -> EventTable:
    """``syn`` on the test's topics with every event of the ``heavy`` input ~1.5 KB: a fetch of the same bytes
    then brings ~25x more event time of the other input. Impressions are padded in their context, clicks
    (whose schema has no room) in a header. ``orphan_burst``: that many clicks on impressions that never come, at
    one event time, in the middle of each click partition (the table does not hold them)."""
    table = build_synthetic(syn, ClickDelay(median_s=5.0), seed=11)
    staging = dataclasses.replace(kafka, impressions_topic=f"{kafka.impressions_topic}-staging",
                                  clicks_topic=f"{kafka.clicks_topic}-staging")
    publish(table, staging, "synthetic")
    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic])
    producer = Producer(producer_config(kafka, **{"batch.num.messages": 20, "linger.ms": 0}))
    for source, target in ((staging.clicks_topic, kafka.clicks_topic),
                           (staging.impressions_topic, kafka.impressions_topic)):
        recs = read_topic(kafka, source)
        middle = {p: n // 2 for p, n in Counter(r.partition for r in recs).items()}
        seen: Counter[int] = Counter()
        for rec in recs:
            seen[rec.partition] += 1
            if target == kafka.clicks_topic and orphan_burst and seen[rec.partition] == middle[rec.partition]:
                ts = json.loads(rec.value)["ts"]
                for k in range(orphan_burst):
                    orphan = {"schema_version": 1, "impression_id": f"orphan-{rec.partition}-{k}", "ts": ts}
                    producer.produce(target, value=json.dumps(orphan).encode(), key=orphan["impression_id"].encode(),
                                     partition=rec.partition)
                    producer.poll(0)
            value, headers = rec.value, None
            if target == kafka.impressions_topic and heavy == "impressions" and value is not None:
                event = json.loads(value)  # SYN has no malformed messages: every value is an event
                event.setdefault("context", {})["pad"] = PAD
                value = json.dumps(event).encode()
            elif target == kafka.clicks_topic and heavy == "clicks":
                headers = [("pad", json.dumps(PAD).encode())]
            producer.produce(target, value=value, key=rec.key, partition=rec.partition, headers=headers)
            producer.poll(0)
    assert producer.flush(60) == 0
    return table


def _join(kafka: KafkaSettings, redis_url: str, app_id: str, driver: str, backpressure: bool,
          lateness_s: float = 0.0, **env_extra: str) -> dict:
    env = join_env(kafka, redis_url, app_id)
    env.update({"STREAMREC_JOINER_MAX_WAITING_PER_PARTITION": str(CAP), "STREAMREC_JOINER_BATCH_MAX": str(BATCH),
                "STREAMREC_JOINER_BACKPRESSURE": str(backpressure).lower(),
                "STREAMREC_KAFKA_EXTRA": "max.partition.fetch.bytes=65536"})
    env.update(env_extra)
    cmd = join_cmd(app_id, driver)
    cmd[cmd.index("--window-s") + 1] = str(WINDOW)
    cmd[cmd.index("--lateness-s") + 1] = str(lateness_s)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("driver", ["kafka", pytest.param("faust", marks=pytest.mark.slow)])  # (faust: -m slow)
def test_without_backpressure_clicks_ahead_of_their_impressions_overflow(driver: str, kafka: KafkaSettings, stack,
                                                                         group_id: str) -> None:
    _publish_hostile(kafka, SYN)
    summary = _join(kafka, stack.redis_url, group_id, driver, backpressure=False)
    assert summary["overflow_clicks"] > 0 and sum(summary["input_pauses"].values()) == 0
    assert summary["click_coverage"] < 1.0


# Until 2026-12-03 faust's gate was the waiting-click cap only (two of three runs failed here on 2026-12-01); then,
# once its fetches honoured the 64 KB limit, one fresh-clone CI run of three gave up 24 clicks as overflow: what a
# driver has in hand when the gate pauses the clicks (the rest of a fetch, clicks held past their frontier) joined in
# full. Now a partition's clicks join only as far as the cap has room while its impressions have more to read
# (backpressure.click_room), for either driver. In five local runs of both drivers after the change the rule never had
# to act here (``clicks_held_at_cap`` 0): it is the bound that holds when the pauses' margins do not; the orphan-burst
# test below makes it act (and fails without it).
@pytest.mark.parametrize("driver", ["kafka", "faust"])
def test_with_backpressure_every_impression_has_exactly_its_label(driver: str, kafka: KafkaSettings, stack,
                                                                   group_id: str) -> None:
    stream = _publish_hostile(kafka, SYN)
    want = expected_join(stream, int(WINDOW * 1000))
    summary = _join(kafka, stack.redis_url, group_id, driver, backpressure=True)
    # the gate or the hold did the work, not luck: clicks paused, or held past their partition's frontier
    assert summary["input_pauses"]["clicks"] + summary["held_back"] > 0
    assert summary["overflow_clicks"] == 0 and summary["orphan_clicks"] == want.orphan
    rows = read_samples(kafka)
    assert set(Counter(r[0] for r in rows).values()) == {1} and len(rows) == SYN.impressions
    assert {r[0]: r[1] for r in rows} == want.labels
    assert summary["click_coverage"] == pytest.approx(sum(want.labels.values()) / stream.n_clicks, abs=1e-6)


@pytest.mark.parametrize("driver", ["kafka", pytest.param("faust", marks=pytest.mark.slow)])  # (faust: -m slow)
def test_a_burst_of_orphan_clicks_past_the_cap_neither_stops_the_join_nor_costs_a_real_click(
        driver: str, kafka: KafkaSettings, stack, group_id: str) -> None:
    # Three caps' worth of clicks on impressions that never come, at one event time, halfway through each click
    # partition, with 10 s of allowed lateness, a cap of 10 and batches of up to 150: a batch can bring more clicks
    # than the cap has room for, whatever the gate paused after the batch before, so the clicks past the cap's room
    # are held (backpressure.click_room) and the orphans cannot expire while the click input's time stands still.
    # (With the file's cap of 100 the same batches had to bring 50 or more clicks of one partition at once: a loaded
    # broker's smaller batches brought fewer, and one fresh-clone CI run on 2026-12-06 held none. With 10, six runs
    # beside each other held 1,175-1,650 clicks each, and all six lost real clicks with the cap alone.) The join must
    # still finish: the impressions are read on (the gate pauses the clicks, so they do not hold the impressions
    # back), and once they are read to the end the held clicks join, the cap gives up orphans, and every impression
    # has exactly its label. Giving the furthest clicks up as overflow at the burst instead (the cap alone) gives up
    # real clicks whose impressions had not been read yet.
    cap = 10
    burst = 3 * cap
    stream = _publish_hostile(kafka, SYN, orphan_burst=burst)
    want = expected_join(stream, int(WINDOW * 1000))
    summary = _join(kafka, stack.redis_url, group_id, driver, backpressure=True, lateness_s=10.0,
                    STREAMREC_JOINER_BATCH_MAX="150",
                    STREAMREC_JOINER_MAX_WAITING_PER_PARTITION=str(cap))
    rows = read_samples(kafka)
    assert set(Counter(r[0] for r in rows).values()) == {1} and len(rows) == SYN.impressions
    assert {r[0]: r[1] for r in rows} == want.labels
    injected = burst * kafka.partitions
    assert summary["overflow_clicks"] + summary["orphan_clicks"] == want.orphan + injected
    assert summary["clicks_held_at_cap"] > 0, summary  # the cap's room held clicks back


# faust: -m slow (~20 s). The hold is the pipeline's, shared by both drivers (the kafka variant runs in CI); the faust
# driver's side of it runs in CI in test_faust_delivery.py (this stream and hold: held_back > 0, no commit past a held
# record: test_faust_never_commits_records_the_join_holds_back_before_it_joins_them) and test_join_driver_parity.py (a
# tight hold: the same samples as the kafka driver's).
@pytest.mark.parametrize("driver", ["kafka", pytest.param("faust", marks=pytest.mark.slow)])
def test_impressions_a_fetch_brings_ahead_of_their_clicks_are_held_so_samples_keep_event_time(
        driver: str, kafka: KafkaSettings, stack, group_id: str) -> None:
    # Heavy clicks: every fetch brings ~25x more event time of impressions than of clicks, so a batch holds
    # impressions minutes ahead of the clicks read so far. Joined whole (the pause rule alone acts between
    # batches), they would go out as observed 0s before the delayed positives of older impressions. Held back
    # (hold_limits), the samples of each partition keep event time to within the drift, and every impression
    # still has exactly one observed 0 and, when clicked in its window, one delayed positive.
    stream = _publish_hostile(kafka, SYN, heavy="clicks")
    want = expected_join(stream, int(WINDOW * 1000))
    drift_s = 3.0
    # A quorum of 1: an input's time is its newest event, so the bound is the drift alone (with the default, a
    # partition's time may pass the frontier by up to quorum - 1 events: no lone event holds the rest back).
    summary = _join(kafka, stack.redis_url, group_id, driver, backpressure=True,
                    STREAMREC_JOINER_EMISSION="fake_negative", STREAMREC_JOINER_MAX_INPUT_DRIFT_S=str(drift_s),
                    STREAMREC_JOINER_WATERMARK_QUORUM="1")
    assert summary["held_back"] > 0  # the hold did the work
    assert 0 < summary["held_peak"] <= summary["held_back"]  # the most records held at once: the hold's memory
    late_ms, newest = [], {}
    for rec in read_topic(kafka, kafka.samples_topic):  # each partition in offset order
        b = SampleBatch.decode(rec.value)
        for ts, delay, kind in zip(b.column("ts").tolist(), b.column("label_delay_ms").tolist(),
                                   b.column("kind").tolist(), strict=True):
            at = ts + delay if kind == DELAYED_POSITIVE else ts  # the event time it was emitted at
            newest[rec.partition] = max(newest.get(rec.partition, at), at)
            late_ms.append(newest[rec.partition] - at)
    assert max(late_ms) <= 2 * drift_s * 1000, sorted(late_ms)[-5:]
    rows = [(r[0], r[1]) for r in read_samples(kafka)]
    assert Counter(i for i, label in rows if label == 0) == Counter(list(want.labels))  # one observed 0 each
    assert {i for i, label in rows if label == 1} == {i for i, y in want.labels.items() if y}
    assert len(rows) == len(want.labels) + sum(want.labels.values())


def test_an_input_not_fetched_since_its_assignment_holds_the_other_back_for_a_while_only(kafka: KafkaSettings) -> None:
    # Right after an assignment one input's first fetch can come a round (under load, seconds) before the other's.
    # Counted as "nothing more to read" meanwhile, the input fetched first was joined whole: a fresh worker on a
    # backlog sent out impressions as observed 0s far ahead of the clicks still on their way (this file's hold test
    # failed once so under load, samples 154 s of event time behind). Counted as "more" for good, an input whose
    # fetch never comes would hold the other back for ever. librdkafka's own answers, no fetch possible (no broker
    # at that address), then read to the end of the real broker's topics.
    nowhere = dataclasses.replace(kafka, bootstrap_servers="127.0.0.1:9")
    now = [0.0]
    for settings, records in ((nowhere, 0), (kafka, 2)):
        if records:
            ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic])
            producer = Producer(producer_config(kafka))
            for topic in (kafka.impressions_topic, kafka.clicks_topic):
                producer.produce(topic, value=b"{}", partition=0)
            assert producer.flush(30) == 0
        w = KafkaJoinWorker(assigning_pipeline(), settings, JoinerSettings())  # type: ignore[arg-type]
        try:
            now[0] = 0.0
            w.unfetched.clock = lambda: now[0]  # noqa: B023 - called within this iteration only
            w.consumer.assign([TopicPartition(t, 0, OFFSET_BEGINNING) for t in (kafka.impressions_topic,
                                                                                 kafka.clicks_topic)])
            if not records:
                assert w._behind(IMPRESSIONS, 0) and w._behind(CLICKS, 0)  # not fetched: the end is unknown
                now[0] = UNFETCHED_GRACE_S - 0.001
                assert w._behind(CLICKS, 0)
                now[0] = UNFETCHED_GRACE_S
                assert not w._behind(IMPRESSIONS, 0) and not w._behind(CLICKS, 0)  # still unknown: no stall
                w.unfetched.forget([0])  # what a revoke or an assignment of partition 0 does
                assert w._behind(CLICKS, 0)  # assigned again: its grace starts afresh
                continue
            got: list[str] = []
            while len(got) < records:  # what the fetcher says is believed once it said it: read to the end
                got += [m.topic() for m in w.consumer.consume(records, timeout=1.0) if m.error() is None]
            now[0] = 0.0  # within the grace, too
            assert not w._behind(IMPRESSIONS, 0) and not w._behind(CLICKS, 0)
        finally:
            w.consumer.close()
