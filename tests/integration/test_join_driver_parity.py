"""The joiner's two drivers against the real broker and Redis on the same input: the same samples (labels and
times), the same late and orphan clicks, the same closing watermark per partition, and the same dead letters, each
with its source message's Kafka headers (confluent-kafka's ``Message.headers()`` for ``--driver kafka``: a list, None
for none; aiokafka's ``record.headers`` for ``--driver faust``: a tuple, () for none)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from stream.config import KafkaSettings
from stream.dlq import DeadLetter
from stream.kafka_producer import AckedProducer
from stream.replay.config import ClickDelay, SyntheticSettings
from stream.replay.publisher import publish
from stream.replay.synthetic import build_synthetic
from stream.samples import SampleBatch, watermark_of
from tests.bounded_teardown import Reaper
from tests.integration.test_joiner import WINDOW_S, join_cmd, join_env, run_join
from tests.kafka_io import read_topic

SYN = SyntheticSettings(impressions=300, users=100, items=40, impressions_per_s=20.0, base_ctr=0.3,
                        attribution_window_s=WINDOW_S, late_click_share=0.05, duplicate_click_share=0.05,
                        orphan_click_share=0.03, malformed_share=0.02)
# Malformed events with headers of every shape: a null value, an empty one, a name twice (order kept), one of our
# names forged.
HEADERS = [("trace-id", b"t-1"), ("nil", None), ("empty", b""), ("dup", b"1"), ("dup", b"2"),
           ("dlq.reason", b"forged")]


def _start(kafka: KafkaSettings, stack, app_id: str, driver: str, err: Path) -> subprocess.Popen:
    """``driver``'s join, its log to ``err`` (two at once: a pipe left unread while the other is awaited could fill)."""
    with err.open("w") as log:
        return subprocess.Popen(join_cmd(app_id, driver), env=join_env(kafka, stack.redis_url, app_id),
                                stdout=subprocess.PIPE, stderr=log, text=True)


def _outputs(kafka: KafkaSettings, proc: subprocess.Popen, err: Path) -> dict:
    stdout, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, err.read_text()[-3000:]
    samples: dict[str, tuple[int, int]] = {}
    closing: dict[int, int] = {}  # partition -> the newest watermark its samples messages carry
    for rec in read_topic(kafka, kafka.samples_topic):
        b = SampleBatch.decode(rec.value)
        # (not its history: the clicks of other partitions a sample's history holds depend on how the partitions
        # were interleaved in batches, README "history")
        samples.update(zip(b.impression_ids, zip(b.column("label").tolist(), b.column("ts").tolist(), strict=True),
                           strict=True))
        wm = watermark_of(rec.headers)
        assert wm is not None
        closing[rec.partition] = max(closing.get(rec.partition, wm), wm)
    late = Counter(tuple(sorted(json.loads(r.value or b"").items()))
                   for r in read_topic(kafka, f"late-{kafka.samples_topic}"))
    dead = {}
    for kind, topic in (("impressions", kafka.impressions_topic), ("clicks", kafka.clicks_topic)):
        letters = []
        for r in read_topic(kafka, kafka.dlq_topic(topic)):
            dl = DeadLetter.from_headers(r.headers)
            # (a keyless event's partition is the producer's random pick: where it went is no driver's doing)
            letters.append((dl.kind, r.key, r.value, dl.original_headers,
                            [h for h in r.headers if not h[0].startswith("dlq.source.")]))
        dead[kind] = sorted(letters, key=repr)
    summary = json.loads(stdout.strip().splitlines()[-1])
    return {"samples": samples, "closing": closing, "late": late, "dead": dead,
            "counts": {k: summary[k] for k in ("samples", "positives", "late_clicks", "orphan_clicks",
                                               "duplicate_clicks", "dead_lettered")}}


def test_both_drivers_give_the_same_samples_late_clicks_watermarks_and_dead_letters_with_headers(
        kafka: KafkaSettings, stack, group_id: str, monkeypatch: pytest.MonkeyPatch, reaper: Reaper,
        tmp_path: Path) -> None:
    # Small batches and a tight hold: the drivers cut the input differently (held records, clicks a batch before their
    # impressions); the outputs must not depend on it (the closing watermarks did: engine drain)
    monkeypatch.setenv("STREAMREC_JOINER_BATCH_MAX", "5")
    monkeypatch.setenv("STREAMREC_JOINER_MAX_INPUT_DRIFT_S", "1")
    table = build_synthetic(SYN, ClickDelay(median_s=60.0), seed=11)
    topics, procs = {}, {}
    for driver in ("kafka", "faust"):
        k = dataclasses.replace(kafka, impressions_topic=f"{kafka.impressions_topic}-{driver}",
                                clicks_topic=f"{kafka.clicks_topic}-{driver}",
                                samples_topic=f"{kafka.samples_topic}-{driver}")
        publish(table, k, "synthetic")
        producer = AckedProducer(k)
        producer.send(k.impressions_topic, b"{not json", b"bad-imp", HEADERS)
        producer.send(k.clicks_topic, b"{not json", b"bad-click", HEADERS)
        producer.send(k.clicks_topic, b'{"impression_id": 5}', b"no-headers")  # no headers at all
        producer.flush()
        topics[driver] = k
    # Both at once, each on its own topics and group: their start-ups and idle exits overlap (this test took one
    # after the other's, ~27 s)
    for driver, k in topics.items():
        procs[driver] = reaper.add(_start(k, stack, f"{group_id}-{driver}", driver, tmp_path / f"{driver}.err"))
    runs = {driver: _outputs(topics[driver], proc, tmp_path / f"{driver}.err") for driver, proc in procs.items()}
    ours, faust = runs["kafka"], runs["faust"]
    assert len(ours["samples"]) == SYN.impressions and ours["counts"]["dead_lettered"] > 3
    for part in ("counts", "samples", "late", "closing"):
        assert faust[part] == ours[part], part
    assert faust["dead"] == ours["dead"]
    for kind, key in (("impressions", b"bad-imp"), ("clicks", b"bad-click"), ("clicks", b"no-headers")):
        [letter] = [d for d in ours["dead"][kind] if d[1] == key]
        assert list(letter[3]) == (HEADERS if key != b"no-headers" else [])


def test_the_faust_driver_makes_no_topic_the_kafka_driver_does_not(kafka: KafkaSettings, stack, group_id: str) -> None:
    """faust's leader assignor subscribed to ``<app_id>-__assignor-__leader``, which the broker then auto-created with
    its own defaults (4 partitions on the local broker; ``topic_allow_declare = False`` does not stop a subscription's
    metadata request), a topic no setting names and the kafka driver never makes; nothing of the joiner uses it."""
    from confluent_kafka.admin import AdminClient

    table = build_synthetic(dataclasses.replace(SYN, impressions=40, malformed_share=0.0), ClickDelay(median_s=5.0),
                            seed=3)
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    made = {}
    for driver in ("kafka", "faust"):
        k = dataclasses.replace(kafka, impressions_topic=f"{kafka.impressions_topic}-{driver}",
                                clicks_topic=f"{kafka.clicks_topic}-{driver}",
                                samples_topic=f"{kafka.samples_topic}-{driver}")
        publish(table, k, "synthetic")
        before = set(admin.list_topics(timeout=10).topics)
        app_id = f"{group_id}-{driver}"
        run_join(join_env(k, stack.redis_url, app_id), app_id, driver)
        made[driver] = {t.replace(app_id, "<app_id>").replace(k.samples_topic, "<samples>")
                        for t in set(admin.list_topics(timeout=10).topics) - before}
    assert "<app_id>-join-state" in made["kafka"]
    assert made["faust"] == made["kafka"]
