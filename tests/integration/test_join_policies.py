"""The emission policies through the real joiner (broker, Redis, both drivers, a SIGKILL): every impression
ends with exactly its true label in view, ``(impression_id, kind)`` is unique, and the kinds are the policy's."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import defaultdict

from stream.config import KafkaSettings
from stream.replay.config import ClickDelay, SyntheticSettings
from stream.replay.publisher import publish
from stream.replay.synthetic import build_synthetic
from stream.samples import DELAYED_POSITIVE, FINAL, OBSERVED, SampleBatch
from tests.bounded_teardown import Reaper
from tests.integration.test_joiner import (
    SYN,
    WINDOW_S,
    expected_join,
    join_cmd,
    join_env,
    join_summary,
    own_outputs,
    run_join,
    start_join,
)
from tests.kafka_io import read_topic


def read_kinds(kafka: KafkaSettings) -> list[tuple[str, int, int]]:
    """(impression_id, label, kind) of every sample row."""
    rows = []
    for rec in read_topic(kafka, kafka.samples_topic):
        b = SampleBatch.decode(rec.value)
        rows += zip(b.impression_ids, b.column("label").tolist(), b.kinds.tolist(), strict=True)
    return rows


def final_labels(rows: list[tuple[str, int, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for imp, label, kind in rows:
        out[imp] = max(out.get(imp, 0), label) if kind == DELAYED_POSITIVE else max(out.get(imp, label), label)
    return out


def policy_env(kafka: KafkaSettings, redis_url: str, group_id: str, policy: str) -> dict[str, str]:
    env = join_env(kafka, redis_url, group_id)
    env.update(STREAMREC_JOINER_EMISSION=policy, STREAMREC_JOINER_ELAPSED_S="20")
    return env


# Every policy, and the default one (fake_negative) with both drivers. The four runs read one published stream side by
# side, each with its own group, samples topic and Redis prefix: a run's start, group join and idle exit take
# seconds, which they spend at once instead of one after the other.
RUNS = [("fake_negative", "faust"), ("fake_negative", "kafka"), ("es_dfm", "kafka"), ("window", "kafka")]


def test_each_policy_with_each_driver_gives_every_impression_its_true_label_once_per_kind(
        kafka: KafkaSettings, stack, group_id: str, reaper: Reaper) -> None:
    table = build_synthetic(SYN, ClickDelay(median_s=60.0), seed=5)
    publish(table, kafka, "synthetic")
    want = expected_join(table, int(WINDOW_S * 1000)).labels
    procs = {}
    for policy, driver in RUNS:
        name = f"{group_id}-{policy}-{driver}"
        out = own_outputs(kafka, f"{policy}-{driver}")
        procs[(policy, driver)] = out, reaper.add(start_join(policy_env(out, stack.redis_url, name, policy), name,
                                                             driver))
    for (policy, driver), (out, proc) in procs.items():
        run = f"{policy} policy, {driver} driver"
        summary = join_summary(proc, run)
        rows = read_kinds(out)
        assert len({(i, k) for i, _, k in rows}) == len(rows), run  # (impression_id, kind) is unique
        assert final_labels(rows) == want, run
        kinds = {k for _, _, k in rows}
        if policy == "window":
            assert kinds == {FINAL}, run
        else:
            assert {OBSERVED, DELAYED_POSITIVE} <= kinds, run
            delayed = sum(1 for _, _, k in rows if k == DELAYED_POSITIVE)
            assert summary["delayed_positives"] == delayed > 0, run
            assert all(label == 1 for _, label, k in rows if k == DELAYED_POSITIVE), run
        if policy == "fake_negative":  # every impression went out at once as a 0
            assert sum(1 for _, label, k in rows if k == OBSERVED and label == 0) == len(want), run


def test_a_sigkilled_es_dfm_joiner_restarts_without_losing_or_mislabelling(kafka: KafkaSettings, stack,
                                                                          group_id: str) -> None:
    # 600 s of event time in ~20 batches of 1,000 records: the kill comes a few batches in
    s = SyntheticSettings(impressions=15_000, users=20_000, items=2000, impressions_per_s=25.0,
                          attribution_window_s=WINDOW_S, malformed_share=0.0)
    table = build_synthetic(s, ClickDelay(median_s=60.0), seed=9)
    publish(table, kafka, "synthetic")
    env = policy_env(kafka, stack.redis_url, group_id, "es_dfm")
    env["STREAMREC_JOINER_BATCH_MAX"] = "1000"
    proc = subprocess.Popen(join_cmd(group_id, "kafka"), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and len(read_topic(kafka, kafka.samples_topic)) < 4:
        time.sleep(0.2)
    assert proc.poll() is None, "the joiner finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    run_join(env, group_id, "kafka")
    rows = read_kinds(kafka)
    want = expected_join(table, int(WINDOW_S * 1000)).labels
    seen: dict[tuple[str, int], set[int]] = defaultdict(set)
    for imp, label, kind in rows:
        seen[(imp, kind)].add(label)
    assert all(len(v) == 1 for v in seen.values())  # a redelivered sample repeats its label, never another
    assert final_labels(rows) == want
    # no impression has both a FINAL and an OBSERVED sample (a restored impression keeps its history)
    by_imp: dict[str, set[int]] = defaultdict(set)
    for imp, kind in seen:
        by_imp[imp].add(kind)
    assert all(ks in ({FINAL}, {OBSERVED}, {OBSERVED, DELAYED_POSITIVE}) for ks in by_imp.values())
