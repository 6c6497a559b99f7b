"""End to end on the real broker: a burst of brand-new users through the real learner fires the
cold-start alert on the Kafka alerts topic, and it resolves once returning users dominate again.

learner (streamrec train, dynamic ids, --metrics-port) -> /metrics -> streamrec monitor -> alerts topic.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from monitor.alerts import Alert, AlertState
from stream.config import KafkaSettings
from stream.kafka_producer import AckedProducer
from stream.kafka_topics import ensure_topics
from stream.samples import SampleBatch
from streamrec.stack import free_port
from tests.bounded_teardown import kill_and_reap
from tests.kafka_io import read_topic
from tests.monitoring_io import alerts_so_far, metric, scrape

REPO = Path(__file__).resolve().parents[2]
ROWS = 100


def samples(users: np.ndarray, start: int, rng: np.random.Generator) -> bytes:
    n = len(users)
    items = rng.integers(0, 50, n)
    return SampleBatch.from_columns(
        impression_id=[f"i{start + k}" for k in range(n)], ts=1_700_000_000_000 + np.arange(start, start + n) * 10,
        label=(rng.random(n) < 0.3).astype(np.int8), label_delay_ms=np.zeros(n), user_id=users, item_id=items,
        history=[[] for _ in range(n)], context={"device": rng.integers(0, 3, n)}).encode()


def scraped(url: str, series: str) -> float | None:
    return metric(scrape(url), series)


def bucket_share(url: str) -> float | None:
    return scraped(url, 'streamrec_learner_bucket_share{field="user_id"}')


def wait_for(cond, what: str, procs: list[subprocess.Popen], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args[3]} exited early ({p.returncode}): {p.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_a_burst_of_new_users_fires_the_cold_start_alert_and_it_resolves(kafka: KafkaSettings,
                                                                        tmp_path: Path) -> None:
    ensure_topics(kafka, [kafka.samples_topic])
    alerts = f"alerts-{uuid.uuid4().hex[:10]}"
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), STREAMREC_KAFKA_BOOTSTRAP_SERVERS=kafka.bootstrap_servers,
               STREAMREC_KAFKA_SAMPLES_TOPIC=kafka.samples_topic, STREAMREC_LEARNER_BUCKETS="64",
               STREAMREC_LEARNER_ID_CAPACITY="5000", STREAMREC_LEARNER_ADMIT_AFTER="2",
               STREAMREC_LEARNER_CTX_BUCKETS="16", STREAMREC_LEARNER_MLP="16",
               STREAMREC_LEARNER_METRICS_WINDOW="2000",  # bucket share over ~ the last 200 lookups
               STREAMREC_LEARNER_GROUP_ID=f"learner-{kafka.samples_topic}")
    rules = tmp_path / "rules.toml"
    rules.write_text(f"""
interval_s = 0.25
[sources]
learner = "http://127.0.0.1:{port}/metrics"
[sinks]
log = true
kafka_topic = "{alerts}"
[[rule]]
name = "cold_start_share"
expr = 'streamrec_learner_bucket_share{{field="user_id"}}'
op = ">"
threshold = 0.5
for_s = 1
severity = "warning"
""")
    rng = np.random.default_rng(0)
    producer = AckedProducer(kafka)
    sent = 0

    def send(users: np.ndarray) -> None:
        nonlocal sent
        producer.send(kafka.samples_topic, samples(users, sent, rng), "k", partition=0)
        producer.flush()
        sent += len(users)

    returning = np.arange(1, 21)  # 20 users who keep coming back: admitted after their second sighting
    for _ in range(5):
        send(rng.choice(returning, ROWS))
    learner = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "train", "--checkpoint-dir",
                                str(tmp_path / "ckpt"), "--batch-rows", str(ROWS), "--metrics-port", str(port)],
                               env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    monitor = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "monitor", "--rules", str(rules),
                                "--bootstrap-servers", kafka.bootstrap_servers, "--json"],
                               env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [learner, monitor]
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        share = lambda: bucket_share(url)  # noqa: E731
        wait_for(lambda: (s := share()) is not None and s < 0.5, "the learner's steady bucket share", procs)
        # the window AUC is published beside the progressive one (it read 0, never set, before)
        wait_for(lambda: (scraped(url, "streamrec_learner_window_auc") or 0.0) > 0.0, "the window AUC", procs)
        assert 0.0 < scraped(url, "streamrec_learner_window_auc") < 1.0  # type: ignore[operator]
        new_user, burst_batches = 10_000_000, 0
        while burst_batches < 5 or not alerts_so_far(kafka, alerts):
            send(np.arange(new_user, new_user + ROWS))  # a burst: every user brand new
            new_user += ROWS
            burst_batches += 1
            assert burst_batches < 200, "no alert during the burst"
            time.sleep(0.2)
        peak = share()
        burst_end = sent  # samples sent up to the end of the burst
        while len(alerts_so_far(kafka, alerts)) < 2:
            send(rng.choice(returning, ROWS))  # returning users again
            time.sleep(0.2)
            assert sent < 2_000_000
        for p in procs:
            p.send_signal(signal.SIGTERM)
        out, err = monitor.communicate(timeout=30)
        learner.communicate(timeout=60)
    finally:
        for p in procs:
            kill_and_reap(p)
    assert monitor.returncode == 0 and learner.returncode == 0, err[-3000:]
    records = [Alert.from_json(r.value) for r in read_topic(kafka, alerts)]
    assert [(a.rule, a.state) for a in records] == [("cold_start_share", AlertState.FIRING),
                                                     ("cold_start_share", AlertState.RESOLVED)]
    assert records[0].value > 0.5 and records[1].value <= 0.5 and peak is not None and peak > 0.5
    assert json.loads(out)["alerts"] == {"firing": 1, "resolved": 1}
    # The learner's user buckets forget (user_bucket_half_life_s, 60 s by default), and its checkpoint brings
    # every bucket's decay up to the newest event time, so an artifact built from it holds today's buckets.
    from learner.checkpoint_read import load_latest

    ckpt = load_latest(tmp_path / "ckpt")
    assert ckpt is not None
    users = next(f for f in ckpt["meta"]["feature_config"]["fields"] if f["name"] == "user_id")
    assert users["bucket_half_life_s"] == 60.0
    seen = ckpt["id_maps"]["user_id"]["bucket_seen"].numpy()
    used = seen[np.isfinite(seen)]
    assert used.size > 1 and np.all(used == used.max())  # all brought to one clock at the checkpoint
    # ... the newest trained sample's: after the burst (returning users, admitted, touch no bucket after it)
    assert (1_700_000_000_000 + (burst_end - 1) * 10) / 1000.0 < used.max()
    assert used.max() <= (1_700_000_000_000 + (sent - 1) * 10) / 1000.0
