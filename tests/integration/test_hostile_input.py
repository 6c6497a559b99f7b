"""Hostile input mixed into a real replay, for both joiner drivers, checked from the raw topics.

Every valid impression must get exactly one sample with the label recomputed independently from the
source table, and every hostile message must be in its topic's DLQ with its reason. Then the failure
path: a message that makes the join (or training) raise is isolated and dead-lettered after
``poison_after`` failed runs, and nothing of a failed batch is ever committed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import orjson
import pytest
import redis
from confluent_kafka import Consumer, TopicPartition

from stream.config import KafkaSettings
from stream.kafka_producer import AckedProducer
from stream.kafka_topics import ensure_topics
from stream.replay.config import ClickDelay, SyntheticSettings
from stream.replay.publisher import publish
from stream.replay.resume import key_partitions
from stream.replay.synthetic import build_synthetic
from stream.replay.table import CLICK, IMPRESSION, EventTable, RawMessage
from stream.samples import SampleBatch
from tests.integration.test_joiner import expected_join, join_env
from tests.kafka_io import produce_raw_header_key, read_topic

WINDOW_S = 60.0
PARTITIONS = 4
SYN = SyntheticSettings(impressions=3000, users=2000, items=400, impressions_per_s=20.0, base_ctr=0.25,
                        attribution_window_s=WINDOW_S, late_click_share=0.03, duplicate_click_share=0.03,
                        orphan_click_share=0.01, malformed_share=0.0)


def key_on(partition: int, stem: str) -> str:
    """A key with ``stem`` that the producer's partitioner puts on ``partition``."""
    keys = np.array([f"{stem}-{n}" for n in range(10_000)], object)
    return str(keys[np.flatnonzero(key_partitions(keys, PARTITIONS) == partition)[0]])


def _imp(key: str, ts: int, **fields: object) -> dict:
    return {"schema_version": 1, "impression_id": key, "ts": ts, "user_id": "u1", "item_id": 7, **fields}


def hostile_messages(ts: int, now_ms: int) -> list[tuple[int, str, bytes | None, str]]:
    """(topic kind, key stem, value, expected DLQ kind) of every hostile class."""
    cut = orjson.dumps(_imp("x", ts))
    nested = cut[:-1] + b',"context":{"a":' + b"[" * 900 + b"1" + b"]" * 900 + b"}}"  # ~2 KB, parses
    too_deep = cut[:-1] + b',"context":{"a":' + b"[" * 1100 + b"1" + b"]" * 1100 + b"}}"  # beyond the parser
    return [
        (IMPRESSION, "nested", nested, "invalid_field"),
        (IMPRESSION, "toodeep", too_deep, "bad_json"),
        (IMPRESSION, "keys20k", orjson.dumps(_imp("k", ts, context={f"k{i}": i for i in range(20_000)})), "too_large"),
        (IMPRESSION, "keys100", orjson.dumps(_imp("k", ts, context={f"k{i}": i for i in range(100)})),
         "too_many_keys"),
        (IMPRESSION, "longkey", orjson.dumps(_imp("k", ts, context={"k" * 500: 1})), "invalid_field"),
        (IMPRESSION, "future", orjson.dumps(_imp("k", 4_000_000_000_000)), "future_ts"),
        (IMPRESSION, "future2h", orjson.dumps(_imp("k", now_ms + 7_200_000)), "future_ts"),
        (IMPRESSION, "f32", orjson.dumps(_imp("k", ts, dense={"price": 1e39})), "invalid_field"),
        (IMPRESSION, "utf8", b'{"schema_version":1,"impression_id":"\xff\xfe","ts":5,"user_id":1,"item_id":2}',
         "bad_json"),
        (IMPRESSION, "truncated", cut[: len(cut) // 2], "bad_json"),
        (IMPRESSION, "deeptype", orjson.dumps(_imp("k", ts, context={"tags": [1, {"x": 2}]})), "invalid_field"),
        (IMPRESSION, "hugestr", orjson.dumps(_imp("k", ts, user_id="u" * 100_000)), "too_large"),
        (IMPRESSION, "longstr", orjson.dumps(_imp("k", ts, context={"city": "c" * 1000})), "invalid_field"),
        (IMPRESSION, "nan", cut[:-1] + b',"dense":{"x":NaN}}', "bad_json"),
        (IMPRESSION, "inf", cut[:-1] + b',"dense":{"x":1e999}}', "bad_json"),
        (IMPRESSION, "negid", orjson.dumps(_imp("k", ts, user_id=-5)), "invalid_field"),
        (IMPRESSION, "hugeid", cut.replace(b'"item_id":7', b'"item_id":1180591620717411303424'), "invalid_field"),
        (IMPRESSION, "dupkey", cut[:-1] + b',"item_id":8}', "duplicate_key"),
        (IMPRESSION, "tombstone", None, "empty"),
        (CLICK, "cfuture", orjson.dumps({"schema_version": 1, "impression_id": "k", "ts": 4_000_000_000_000}),
         "future_ts"),
        (CLICK, "ctrunc", b'{"schema_version":1,"impression_id":"k","ts":', "bad_json"),
        (CLICK, "ctype", orjson.dumps({"schema_version": 1, "impression_id": "k", "ts": "soon"}), "invalid_field"),
    ]


def with_hostile(table: EventTable) -> tuple[EventTable, dict[bytes, str], dict[str, int]]:
    """``table`` plus every hostile class in the middle of every partition. Returns the table, the expected
    DLQ kind per hostile key, and the extra valid impressions (a client clock years ahead, within the
    bound) with their labels."""
    mid = int(table.ts[len(table.ts) // 2])
    now_ms = int(time.time() * 1000)
    expected: dict[bytes, str] = {}
    skewed: dict[str, int] = {}
    for p in range(PARTITIONS):
        for kind, stem, value, dlq_kind in hostile_messages(mid, now_ms):
            key = key_on(p, f"hostile-{stem}")
            if value is not None and value.startswith(b"{") and b'"impression_id":"k"' in value:
                value = value.replace(b'"impression_id":"k"', b'"impression_id":"' + key.encode() + b'"')
            table.raw.append(RawMessage(kind, mid, key.encode(), value))
            expected[key.encode()] = dlq_kind
        # Valid, but from a client whose clock is years ahead of the replayed data: it must not move event time.
        key = key_on(p, "skewed")
        table.raw.append(RawMessage(IMPRESSION, mid, key.encode(), orjson.dumps(_imp(key, now_ms))))
        skewed[key] = 0
        click_key = key_on(p, "skewed-orphan")
        table.raw.append(RawMessage(CLICK, mid, click_key.encode(),
                                    orjson.dumps({"schema_version": 1, "impression_id": click_key, "ts": now_ms})))
    return table, expected, skewed


def join_cmd(app_id: str, driver: str, module: str = "streamrec.cli") -> list[str]:
    return [sys.executable, "-m", module, "join", "--app-id", app_id, "--driver", driver, "--window-s",
            str(WINDOW_S), "--lateness-s", "0", "--exit-when-idle", "4", "--drain", "--json"]


def sample_rows(kafka: KafkaSettings) -> list[tuple[str, int]]:
    rows = []
    for rec in read_topic(kafka, kafka.samples_topic):
        b = SampleBatch.decode(rec.value)
        rows.extend(zip(b.impression_ids, b.column("label").tolist(), strict=True))
    return rows


def dead_letters(kafka: KafkaSettings, topic: str) -> dict[bytes, dict[str, str]]:
    return {r.key: {k: v.decode() for k, v in r.headers} for r in read_topic(kafka, kafka.dlq_topic(topic))}


@pytest.mark.parametrize("driver", ["kafka", "faust"])
def test_hostile_messages_in_every_partition_are_dead_lettered_and_every_valid_impression_joins_once(
        driver: str, kafka: KafkaSettings, stack, group_id: str) -> None:
    table, hostile, skewed = with_hostile(build_synthetic(SYN, ClickDelay(median_s=15.0), seed=11))
    publish(table, kafka, "synthetic")
    env = join_env(kafka, stack.redis_url, group_id)
    out = subprocess.run(join_cmd(group_id, driver), env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])

    want = expected_join(table, int(WINDOW_S * 1000))
    rows = sample_rows(kafka)
    assert Counter(Counter(i for i, _ in rows).values()) == {1: len(want.labels) + len(skewed)}  # once each
    # Labels as the source says: a watermark moved by the skewed clocks would have expired everything.
    assert dict(rows) == {**want.labels, **skewed}
    dlq = {**dead_letters(kafka, kafka.impressions_topic), **dead_letters(kafka, kafka.clicks_topic)}
    assert {k: dlq[k]["dlq.kind"] for k in hostile if k in dlq} == hostile, "a hostile message is not in a DLQ"
    assert all(dlq[k]["dlq.reason"] for k in hostile)
    assert len(dlq) == len(hostile) == summary["dead_lettered"]
    assert {int(dlq[k]["dlq.source.partition"]) for k in hostile} == set(range(PARTITIONS))
    late = Counter(json.loads(r.value)["reason"] for r in read_topic(kafka, f"late-{kafka.samples_topic}"))
    assert late["orphan"] == want.orphan + PARTITIONS  # the skewed clicks, given up at the end, not lost


def committed(kafka: KafkaSettings, group: str) -> dict[tuple[str, int], int]:
    c = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": group})
    try:
        tps = [TopicPartition(t, p) for t in (kafka.impressions_topic, kafka.clicks_topic) for p in range(PARTITIONS)]
        return {(tp.topic, tp.partition): tp.offset for tp in c.committed(tps, timeout=10)}
    finally:
        c.close()


# faust: -m slow (~30 s). Strikes and poison are the pipeline's, shared by both drivers (the kafka variant runs in CI);
# the faust driver's side, a failed batch exits 1 with nothing of it committed, runs in CI in
# test_faust_delivery.py::test_faust_commits_nothing_of_a_batch_that_failed_and_exits_with_status_1.
@pytest.mark.parametrize("driver", ["kafka", pytest.param("faust", marks=pytest.mark.slow)])
def test_a_message_that_keeps_failing_the_join_is_dead_lettered_after_poison_after_runs_and_nothing_is_lost(
        driver: str, kafka: KafkaSettings, stack, group_id: str) -> None:
    s = SyntheticSettings(impressions=1500, users=800, items=200, impressions_per_s=20.0,
                          attribution_window_s=WINDOW_S, malformed_share=0.0)
    table = build_synthetic(s, ClickDelay(median_s=15.0), seed=12)
    mid = int(table.ts[len(table.ts) // 2])
    poison_key = key_on(1, "poison")
    table.raw.append(RawMessage(IMPRESSION, mid, poison_key.encode(), orjson.dumps(_imp(poison_key, mid))))
    publish(table, kafka, "synthetic")
    env = join_env(kafka, stack.redis_url, group_id)
    env["STREAMREC_JOINER_POISON_AFTER"] = "2"
    failures = 0
    for _ in range(5):
        out = subprocess.run(join_cmd(group_id, driver, module="tests.fault_hooks"), env=env, capture_output=True,
                             text=True, timeout=300)
        if out.returncode == 0:
            break
        failures += 1
        assert "injected fault" in out.stderr
        if failures == 1:  # the failed batch's offsets were not committed, not even by close() in finally
            poison_offset = max(r.offset for r in read_topic(kafka, kafka.impressions_topic)
                                if r.key == poison_key.encode())
            assert committed(kafka, group_id).get((kafka.impressions_topic, 1), -1) <= poison_offset
            strikes = redis.Redis.from_url(stack.redis_url).hgetall(f"{group_id}:strikes:{group_id}")
            assert any(k.decode() == f"{kafka.impressions_topic}:1:{poison_offset}" for k in strikes)
    # One failure with the whole batch, then poison_after - 1 with the poison alone, then dead-lettered.
    assert out.returncode == 0 and failures == 2, out.stderr[-3000:]
    dlq = dead_letters(kafka, kafka.impressions_topic)
    assert dlq[poison_key.encode()]["dlq.kind"] == "poison"
    assert "injected fault" in dlq[poison_key.encode()]["dlq.reason"]
    rows = sample_rows(kafka)
    want = expected_join(table, int(WINDOW_S * 1000))
    assert set(i for i, _ in rows) == set(want.labels), "an impression of a failed batch was lost"
    assert {i: label for i, label in rows} == want.labels
    assert not redis.Redis.from_url(stack.redis_url).hgetall(f"{group_id}:strikes:{group_id}")  # cleared


@pytest.mark.parametrize("driver", ["kafka", "faust"])
def test_an_impression_and_a_click_with_a_header_key_not_utf8_are_dead_lettered_once_and_the_others_join(
        driver: str, kafka: KafkaSettings, stack, group_id: str) -> None:
    """Another producer's header key that is not UTF-8: confluent-kafka's ``Message.headers()`` raised SystemError for
    it in the kafka driver's batch decode (or handed back a pair whose read segfaults), and the worker failed the same
    batch at every restart. Each is dead-lettered as ``bad_header`` without its headers; its neighbours join."""
    ensure_topics(kafka, [kafka.impressions_topic, kafka.clicks_topic], partitions=PARTITIONS)
    ts = 1_700_000_000_000
    a, hostile, b = (key_on(0, stem) for stem in ("hdr-a", "hdr-hostile", "hdr-b"))
    p = AckedProducer(kafka)
    p.send(kafka.impressions_topic, orjson.dumps(_imp(a, ts)), a, partition=0)
    p.flush()
    produce_raw_header_key(kafka, kafka.impressions_topic, 0, hostile.encode(), orjson.dumps(_imp(hostile, ts)),
                           b"\xff\xfeimp")
    p.send(kafka.impressions_topic, orjson.dumps(_imp(b, ts + 1)), b, partition=0, headers=[("trace", b"t")])
    click = orjson.dumps({"schema_version": 1, "impression_id": a, "ts": ts + 5_000})
    produce_raw_header_key(kafka, kafka.clicks_topic, 0, a.encode(), click, b"\xc3(click")
    p.send(kafka.clicks_topic, click, a, partition=0)
    p.flush()
    out = subprocess.run(join_cmd(group_id, driver), env=join_env(kafka, stack.redis_url, group_id),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["dead_lettered"] == 2
    assert sorted(sample_rows(kafka)) == sorted([(a, 1), (b, 0)])
    for topic, key, value in ((kafka.impressions_topic, hostile, orjson.dumps(_imp(hostile, ts))),
                              (kafka.clicks_topic, a, click)):
        [rec] = read_topic(kafka, kafka.dlq_topic(topic))
        assert (rec.key, rec.value) == (key.encode(), value)  # replayable as it came
        assert all(k.startswith("dlq.") for k, _ in rec.headers)  # its own headers not kept
        assert dict(rec.headers)["dlq.kind"] == b"bad_header" and b"not UTF-8" in dict(rec.headers)["dlq.reason"]
    # Every record committed, the hostile ones too: a restarted worker, which starts from the group's committed
    # offsets, reads none of them again (it failed the same batch at every restart). What a second run that found
    # nothing to join or dead-letter proved, without the second run.
    done = committed(kafka, group_id)
    assert (done[(kafka.impressions_topic, 0)], done[(kafka.clicks_topic, 0)]) == (3, 2)
