"""The joiner against the real broker and Redis: exact labels, crash recovery, two workers, no leaks."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import pytest
import redis

from stream.config import KafkaSettings
from stream.counts import DailyCounts
from stream.features import hash_value
from stream.replay.config import ClickDelay, SyntheticSettings
from stream.replay.publisher import publish
from stream.replay.synthetic import build_synthetic
from stream.replay.table import EventTable
from stream.samples import NO_WATERMARK, SampleBatch, watermark_of
from tests.bounded_teardown import Reaper, kill_and_reap
from tests.kafka_io import read_topic

WINDOW_S = 600.0
SYN = SyntheticSettings(impressions=6000, users=5000, items=800, impressions_per_s=20.0, base_ctr=0.2,
                        attribution_window_s=WINDOW_S, late_click_share=0.05, duplicate_click_share=0.05,
                        orphan_click_share=0.02, malformed_share=0.01)


@dataclass(frozen=True)
class Expected:
    labels: dict[str, int]
    late: int
    orphan: int
    duplicate: int


def expected_join(table: EventTable, window_ms: int) -> Expected:
    """The labels and click outcomes the join must produce, computed independently from the table."""
    imp_ts = dict(zip(table.impression_id.tolist(), table.ts.tolist(), strict=True))
    clicks: dict[str, list[int]] = defaultdict(list)
    for i, t in zip(table.click_impression_id.tolist(), table.click_ts.tolist(), strict=True):
        clicks[i].append(t)
    labels, late, orphan, dup = {}, 0, 0, 0
    for imp, ts in imp_ts.items():
        times = sorted(clicks.get(imp, []))
        on_time = [t for t in times if 0 <= t - ts <= window_ms]
        labels[imp] = int(bool(on_time))
        if on_time:
            dup += len(times) - 1  # every other click on a positive impression is a duplicate
        else:
            late += len(times)
    orphan = sum(len(v) for k, v in clicks.items() if k not in imp_ts)
    return Expected(labels, late, orphan, dup)


def join_env(kafka: KafkaSettings, redis_url: str, prefix: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "STREAMREC_KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "STREAMREC_KAFKA_IMPRESSIONS_TOPIC": kafka.impressions_topic,
        "STREAMREC_KAFKA_CLICKS_TOPIC": kafka.clicks_topic,
        "STREAMREC_KAFKA_SAMPLES_TOPIC": kafka.samples_topic,
        "STREAMREC_JOINER_LATE_CLICKS_TOPIC": f"late-{kafka.samples_topic}",
        "STREAMREC_REDIS_URL": redis_url,
        "STREAMREC_REDIS_PREFIX": prefix,
        # These tests check the wait policy's output: one sample per impression with its final label.
        # tests/integration/test_join_policies.py covers every policy, the default included.
        "STREAMREC_JOINER_EMISSION": "wait",
    })
    return env


def join_cmd(app_id: str, driver: str, idle_s: float = 4.0, window_s: float = WINDOW_S) -> list[str]:
    """``window_s``: the window the app id's join state was written under, where a test wrote some (the restore refuses
    another while impressions are pending: ``pipeline.JoinPipeline._check_emission``)."""
    return [sys.executable, "-m", "streamrec.cli", "join", "--app-id", app_id, "--driver", driver,
            "--window-s", str(window_s), "--lateness-s", "0", "--exit-when-idle", str(idle_s), "--drain", "--json"]


def run_join(env: dict[str, str], app_id: str, driver: str) -> dict:
    out = subprocess.run(join_cmd(app_id, driver), env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_join(env: dict[str, str], app_id: str, driver: str) -> subprocess.Popen[str]:
    """``streamrec join`` (``join_cmd``) started, to run beside others; :func:`join_summary` waits for it."""
    return subprocess.Popen(join_cmd(app_id, driver), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def join_summary(proc: subprocess.Popen[str], what: str) -> dict:
    """The JSON summary of a run of :func:`start_join` (``what`` names it if it failed)."""
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, f"{what}: {err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def own_outputs(kafka: KafkaSettings, tag: str) -> KafkaSettings:
    """``kafka`` with a samples topic (and so, in ``join_env``, a late clicks topic) of its own: runs side by side
    over one input topic set each write their own."""
    return dataclasses.replace(kafka, samples_topic=f"{kafka.samples_topic}-{tag}")


def read_samples(kafka: KafkaSettings) -> list[tuple[str, int, int, list[int], int]]:
    """(impression_id, label, user, history, ts) of every sample row in the samples topic."""
    rows = []
    for rec in read_topic(kafka, kafka.samples_topic):
        b = SampleBatch.decode(rec.value)
        values, offsets = b.lists("history")
        for i, (imp, label, user, ts) in enumerate(zip(b.impression_ids, b.column("label").tolist(),
                                                        b.column("user_id").tolist(), b.column("ts").tolist(),
                                                        strict=True)):
            rows.append((imp, label, user, values[offsets[i]:offsets[i + 1]].tolist(), ts))
    return rows


@pytest.fixture
def stream_table(kafka: KafkaSettings) -> EventTable:
    table = build_synthetic(SYN, ClickDelay(median_s=60.0), seed=5)
    publish(table, kafka, "synthetic")
    return table


def test_both_drivers_give_every_impression_one_sample_with_the_right_label_and_redis_day_counts_match_the_stream(
        kafka: KafkaSettings, stack, stream_table: EventTable, group_id: str, reaper: Reaper) -> None:
    """The two drivers read the stream side by side, each with its own group, samples topic and Redis prefix (a run's
    start, group join and idle exit take seconds, spent at once so); each run's samples topic (labels, click
    outcomes, watermarks), late clicks topic and Redis day counts are checked."""
    procs = {}
    for driver in ("faust", "kafka"):
        name, out = f"{group_id}-{driver}", own_outputs(kafka, driver)
        procs[driver] = out, name, reaper.add(start_join(join_env(out, stack.redis_url, name), name, driver))
    for driver, (out, name, proc) in procs.items():
        assert_one_sample_per_impression(out, join_summary(proc, f"{driver} driver"), stream_table, f"{driver} driver")
        assert_day_counts_match(stack.redis_url, name, stream_table)


def assert_one_sample_per_impression(kafka: KafkaSettings, summary: dict, stream_table: EventTable, what: str) -> None:
    """The samples (with watermarks) and late clicks topics of ``kafka`` and the run's ``summary`` are the join of
    ``stream_table`` under the wait policy: one sample per impression with its true label."""
    want = expected_join(stream_table, int(WINDOW_S * 1000))
    rows = read_samples(kafka)
    got = Counter(r[0] for r in rows)
    assert len(got) == len(want.labels) == SYN.impressions and set(got.values()) == {1}, what  # exactly once
    assert {r[0]: r[1] for r in rows} == want.labels, what
    assert summary["samples"] == SYN.impressions and summary["positives"] == sum(want.labels.values()), what
    assert (summary["late_clicks"], summary["orphan_clicks"], summary["duplicate_clicks"]) == (
        want.late, want.orphan, want.duplicate), what
    assert summary["dead_lettered"] == stream_table.stats["malformed"] > 0, what
    assert summary["click_coverage"] == pytest.approx(sum(want.labels.values()) / stream_table.n_clicks, abs=1e-6)
    # late and orphan clicks are written down, not just counted
    late = read_topic(kafka, f"late-{kafka.samples_topic}")
    assert Counter(json.loads(r.value)["reason"] for r in late) == {"late": want.late, "orphan": want.orphan}, what
    # each samples message carries its partition's join watermark, and no sample comes after a message whose watermark
    # closed its impression (ts + window <= it): what served quality in the learner waits for (learner/served.py)
    closed: dict[int, int] = {}  # partition -> the newest watermark of its messages so far
    for rec in sorted(read_topic(kafka, kafka.samples_topic), key=lambda r: (r.partition, r.offset)):
        wm = watermark_of(rec.headers)
        assert wm is not None, what
        assert min(SampleBatch.decode(rec.value).column("ts").tolist()) + WINDOW_S * 1000 > closed.get(
            rec.partition, NO_WATERMARK), what
        closed[rec.partition] = max(closed.get(rec.partition, wm), wm)
    assert closed and min(closed.values()) > NO_WATERMARK, what


def assert_day_counts_match(redis_url: str, prefix: str, stream_table: EventTable) -> None:
    """The joiner's Redis day counts (under ``prefix``) give the stream's five most shown items."""
    client = redis.Redis.from_url(redis_url)
    try:
        top = DailyCounts(client, prefix=prefix).top("item", "impression", days=2, k=5)
    finally:
        client.close()
    want = Counter(str(hash_value(i)) for i in stream_table.item_id.tolist())
    assert top == [(i, float(n)) for i, n in want.most_common(5)] or [n for _, n in top] == [
        float(n) for _, n in want.most_common(5)]  # ties may order differently


def test_history_is_as_of_impression_time_and_never_leaks_the_future(kafka: KafkaSettings, stack,
                                                                      group_id: str) -> None:
    s = SyntheticSettings(impressions=6000, users=300, items=500, impressions_per_s=20.0, base_ctr=0.3,
                          attribution_window_s=WINDOW_S)
    stream_table = build_synthetic(s, ClickDelay(median_s=60.0), seed=6)
    publish(stream_table, kafka, "synthetic")
    run_join(join_env(kafka, stack.redis_url, group_id), group_id, "kafka")
    rows = read_samples(kafka)
    # Joined clicks per user: (click time, item hash) from the ground truth.
    window = int(WINDOW_S * 1000)
    imp = {i: (u, it, t) for i, u, it, t in zip(stream_table.impression_id.tolist(), stream_table.user_id.tolist(),
                                                 stream_table.item_id.tolist(), stream_table.ts.tolist(), strict=True)}
    first_click: dict[str, int] = {}
    for i, t in sorted(zip(stream_table.click_impression_id.tolist(), stream_table.click_ts.tolist(),
                           strict=True), key=lambda x: x[1]):
        if i in imp and 0 <= t - imp[i][2] <= window:
            first_click.setdefault(i, t)
    clicks_of: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for i, t in first_click.items():
        u, it, _ = imp[i]
        clicks_of[hash_value(u)].append((t, hash_value(it)))
    with_history = exact = 0
    for imp_id, _label, user, history, ts in rows:
        before = Counter(item for t, item in clicks_of[user] if t < ts)
        exact += history == [item for t, item in sorted(clicks_of[user]) if t < ts][-50:]
        assert not Counter(history) - before, f"{imp_id}: history holds clicks from its future"
        if imp_id in first_click:
            own = hash_value(imp[imp_id][1])
            assert Counter(history)[own] <= before[own]  # its own click never counts
        with_history += bool(history)
    assert with_history > len(rows) // 2  # the check above had something to check
    # Attached at emission, when this partition's event time has passed the impression; clicks on
    # partitions a fast replay consumes later can still be missing (never a future one).
    print(f"\nhistories complete: {exact / len(rows):.1%}")
    assert exact >= 0.6 * len(rows), f"only {exact} of {len(rows)} histories complete"


def test_sigkill_mid_stream_loses_no_impression(kafka: KafkaSettings, stack, group_id: str) -> None:
    # 800 s of event time (past the 600 s window, so samples go out mid-stream) in ~20 batches of 1,000 records
    s = SyntheticSettings(impressions=20_000, users=20_000, items=2000, impressions_per_s=25.0,
                          attribution_window_s=WINDOW_S, malformed_share=0.0)
    table = build_synthetic(s, ClickDelay(median_s=60.0), seed=9)
    publish(table, kafka, "synthetic")
    env = join_env(kafka, stack.redis_url, group_id)
    env["STREAMREC_JOINER_BATCH_MAX"] = "1000"
    kills = 0
    for _ in range(2):
        proc = subprocess.Popen(join_cmd(group_id, "kafka"), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            n = len(read_topic(kafka, kafka.samples_topic))
            if n >= 3 * (kills + 1):  # some batches out, surely not all
                break
            time.sleep(0.2)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            kills += 1
    assert kills >= 1
    summary = run_join(env, group_id, "kafka")  # the survivor finishes the stream
    rows = read_samples(kafka)
    got = Counter(r[0] for r in rows)
    want = expected_join(table, int(WINDOW_S * 1000))
    assert set(got) == set(want.labels), "an impression was lost"
    labels: dict[str, set[int]] = defaultdict(set)
    for imp_id, label, *_ in rows:
        labels[imp_id].add(label)
    assert all(labels[i] == {want.labels[i]} for i in want.labels)  # duplicates agree with the truth
    dup_rate = (len(rows) - len(got)) / len(got)
    print(f"\nSIGKILL x{kills}: {len(rows) - len(got)} duplicate samples, rate {dup_rate:.4%}; "
          f"restart summary {summary}")
    assert dup_rate < 0.5


def test_two_workers_split_the_partitions_and_match_one(kafka: KafkaSettings, stack, stream_table: EventTable,
                                                        group_id: str) -> None:
    env = join_env(kafka, stack.redis_url, group_id)
    procs = [subprocess.Popen(join_cmd(group_id, "kafka", idle_s=6.0), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    summaries = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert all(s["events"] > 0 for s in summaries), "both workers must have had partitions"
    two = {r[0]: r[1] for r in read_samples(kafka)}
    assert len(two) == SYN.impressions and two == expected_join(stream_table, int(WINDOW_S * 1000)).labels


def wait_for_samples(kafka: KafkaSettings, at_least: int, procs: list[subprocess.Popen], timeout_s: float = 90) -> int:
    """Wait until the samples topic holds ``at_least`` messages; fails if a worker exits meanwhile."""
    deadline = time.monotonic() + timeout_s
    while (n := len(read_topic(kafka, kafka.samples_topic))) < at_least:
        assert all(p.poll() is None for p in procs), "a worker exited early"
        assert time.monotonic() < deadline, f"only {n} samples messages after {timeout_s:g} s"
        time.sleep(0.3)
    return n


# Three members over a stream in three parts: ~70 s, so under -m slow (make test-all). CI runs the two-member case
# (tests/integration/test_faults.py::test_a_joiner_joining_mid_stream_and_another_dying_rebalance_without_loss).
@pytest.mark.slow
@pytest.mark.parametrize("driver", ["kafka", "faust"])
def test_a_worker_joining_and_one_killed_mid_stream_move_the_partitions_and_each_impression_keeps_its_label(
        driver: str, kafka: KafkaSettings, stack, group_id: str) -> None:
    # The stream comes in three parts, contiguous in event time: two workers join the first, a third joins the group
    # as the second arrives (a rebalance), and one of the first two is SIGKILLed as the third arrives (its partitions
    # move to the survivors once its session times out). A kill may re-emit a batch's samples (same impression id,
    # the learner drops them); no impression may be lost or labelled otherwise than the truth. The survivors' idle
    # exit (which drains what they hold) must come after the group has given them the killed worker's partitions:
    # at 12 s it once did not (3,697 impressions of the killed worker's partitions never emitted), so 25 s.
    parts = [build_synthetic(dataclasses.replace(SYN, impressions=3000, malformed_share=0.0,
                                                 start_ts_ms=SYN.start_ts_ms + k * 150_000),
                             ClickDelay(median_s=60.0), seed=20 + k) for k in range(3)]
    env = join_env(kafka, stack.redis_url, group_id)
    env["STREAMREC_JOINER_BATCH_MAX"] = "500"
    publish(parts[0], kafka, "synthetic")

    def start() -> subprocess.Popen:
        return subprocess.Popen([*join_cmd(group_id, driver, idle_s=25.0), "--log-level", "info"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first, second = start(), start()
    procs = [first, second]
    try:
        n = wait_for_samples(kafka, 3, procs)
        third = start()
        procs.append(third)
        publish(parts[1], kafka, "synthetic")
        n = wait_for_samples(kafka, n + 3, procs)
        os.kill(first.pid, signal.SIGKILL)
        first.communicate(timeout=30)
        publish(parts[2], kafka, "synthetic")
        outs = [p.communicate(timeout=240) for p in (second, third)]
    finally:
        for p in procs:
            kill_and_reap(p)
    assert second.returncode == 0 and third.returncode == 0, [o[1][-2000:] for o in outs]
    summaries = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert all(s["events"] > 0 for s in summaries), "the worker that joined mid-stream must have had partitions"
    if driver == "kafka":  # after the kill, the survivors' last assignments cover all four partitions between them
        last = [[line for line in o[1].splitlines() if "INFO streamrec.join: assigned" in line][-1] for o in outs]
        assert all(any(f"('{kafka.impressions_topic}', {p})" in line for line in last) for p in range(4)), last
    want: dict[str, int] = {}
    for table in parts:
        want.update(expected_join(table, int(WINDOW_S * 1000)).labels)
    labels: dict[str, set[int]] = defaultdict(set)
    for imp_id, label, *_ in read_samples(kafka):
        labels[imp_id].add(label)
    assert set(labels) == set(want), f"{len(set(want) - set(labels))} impressions lost"
    assert {i: ls for i, ls in labels.items() if ls != {want[i]}} == {}  # duplicates (after the kill) agree


def test_the_join_state_topic_is_created_compacted_and_an_existing_one_is_made_compacted(
        kafka: KafkaSettings, stack, group_id: str) -> None:
    from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

    from stream.config import RedisSettings
    from stream.joiner.config import JoinerSettings
    from stream.joiner.pipeline import JoinPipeline
    from stream.joiner.state_log import state_topic
    from stream.kafka_topics import ensure_topics

    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})

    def policy(topic: str) -> str | None:
        configs = next(iter(admin.describe_configs([ConfigResource(ResourceType.TOPIC, topic)]).values())).result()
        return configs["cleanup.policy"].value if "cleanup.policy" in configs else None

    rs = RedisSettings(url=stack.redis_url, prefix=group_id)
    JoinPipeline(kafka, rs, JoinerSettings(app_id=group_id)).close()
    assert policy(state_topic(group_id)) == "compact"
    old = f"{group_id}-old"
    ensure_topics(kafka, [state_topic(old)])  # as an earlier version created it: delete policy
    assert policy(state_topic(old)) != "compact"
    JoinPipeline(kafka, rs, JoinerSettings(app_id=old)).close()
    assert policy(state_topic(old)) == "compact"


def test_a_join_state_topic_compacted_and_deleted_by_retention_is_made_compacted_only(kafka: KafkaSettings) -> None:
    """cleanup.policy=compact,delete passed the check (it holds "compact"): retention then deletes live chunks (an
    impression's chunk, an idle partition's newest chunk with its offsets, the claim that fences a stale owner) once
    they are retention.ms old, and a restore without them loses their impressions and the fencing."""
    from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

    from stream.kafka import admin_config
    from stream.kafka_topics import ensure_compacted

    admin = AdminClient(admin_config(kafka))
    topic = f"{kafka.client_id}-join-state"
    for fut in admin.create_topics([NewTopic(topic, 1, 1, config={"cleanup.policy": "compact,delete"})]).values():
        fut.result()
    ensure_compacted(kafka, topic)
    configs = next(iter(admin.describe_configs([ConfigResource(ResourceType.TOPIC, topic)]).values())).result()
    assert configs["cleanup.policy"].value == "compact"


@pytest.mark.parametrize("driver", ["kafka", "faust"])
def test_a_joiner_restarted_under_another_emission_policy_stops_naming_both_rather_than_mislabel_its_pending(
        kafka: KafkaSettings, stack, group_id: str, driver: str) -> None:
    """A joiner run under `wait` leaves impressions pending (a bounded run without --drain); restarted under
    fake_negative it took them as emitted already, and they never got a sample (a `wait` restart of fake_negative
    state would emit them twice). It now stops at the restore: exit 2, one line naming both policies and the fix."""
    publish(build_synthetic(dataclasses.replace(SYN, impressions=300, malformed_share=0.0), ClickDelay(median_s=60.0),
                            seed=12), kafka, "synthetic")
    env = join_env(kafka, stack.redis_url, group_id)  # emission = "wait"
    cmd = [c for c in join_cmd(group_id, driver, idle_s=2.0) if c != "--drain"]  # impressions left in their window
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    # more input: the faust driver restores a partition's state with its first batch (with none, nothing is restored
    # and nothing labelled: it ends idle), the kafka driver at the assignment
    publish(build_synthetic(dataclasses.replace(SYN, impressions=50, malformed_share=0.0), ClickDelay(median_s=60.0),
                            seed=13), kafka, "synthetic")
    again = subprocess.run(cmd, env={**env, "STREAMREC_JOINER_EMISSION": "fake_negative"}, capture_output=True,
                           text=True, timeout=240)
    assert again.returncode == 2, (again.returncode, again.stderr[-3000:])
    assert "was written under [joiner] emission = 'wait', and this joiner runs 'fake_negative'" in again.stderr
    assert "Traceback" not in again.stderr, again.stderr[-3000:]
