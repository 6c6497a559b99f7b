"""End to end on the real broker: the learner's health monitors (``learner/health.py``) fire the shipped default
rules (``monitor/default_rules.toml``, their expression, operator and threshold as shipped, ``for_s`` shortened)
in the real monitor, onto a Kafka alerts topic.

learner (streamrec train --metrics-port) -> /metrics -> streamrec monitor -> alerts topic, for:
a zero learning rate (model_not_learning), a context feature that stops arriving (feature_stopped_arriving), a
stream of positives only (one_class_labels) and a learner that leaks memory (memory_growth; run as
``python -m tests.integration.test_health_alerts train ...``, which leaks on every batch and shortens the growth
window, test code only).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from monitor.alerts import Alert, AlertState
from monitor.rules import load_rules
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
LEAK_BYTES = 2 << 20  # per training batch, in the leaking learner
LEAK_BATCHES = 150  # at most (300 MiB)
LEAK_WINDOW_S = 6.0  # the leaking learner's growth window (10 minutes in production)


def samples(start: int, rng: np.random.Generator, label: float | None = 0.3, device: bool = True) -> bytes:
    """ROWS samples; ``label``: the click rate (1.0: positives only); ``device``: with the ctx.device column."""
    n = ROWS
    return SampleBatch.from_columns(
        impression_id=[f"i{start + k}" for k in range(n)], ts=1_700_000_000_000 + np.arange(start, start + n) * 10,
        label=(rng.random(n) < label).astype(np.int8), label_delay_ms=np.zeros(n),
        user_id=rng.integers(1, 30, n), item_id=rng.integers(1, 50, n), history=[[] for _ in range(n)],
        context={"device": rng.integers(1, 4, n)} if device else None).encode()


def shipped_rule(name: str, for_s: float = 1.0) -> str:
    """The default rule ``name`` as a [[rule]] table, with ``for_s`` shortened."""
    r = next(r for r in load_rules(None).rules if r.name == name)  # the packaged monitor/default_rules.toml
    assert "'" not in r.expr
    threshold = f"threshold = {r.threshold!r}\n" if r.threshold is not None else ""
    return (f'[[rule]]\nname = "{name}"\nexpr = \'{r.expr}\'\nop = "{r.op.value}"\n{threshold}'
            f'for_s = {for_s}\nseverity = "{r.severity.value}"\n')


def run_until_alert(kafka: KafkaSettings, tmp_path: Path, rule: str, send: Callable[[AckedProducer, int], None],
                    env: dict[str, str] | None = None, learner_module: str = "streamrec.cli",
                    timeout_s: float = 60.0, check: Callable[[str, int], None] | None = None) -> list[Alert]:
    """Start the learner (after 5 batches for it to infer its features from) and the monitor with the shipped
    ``rule``; ``send(producer, batch_no)`` a batch every 0.2 s until the rule fires; ``check(metrics text,
    learner pid)`` while it runs. Returns the alerts on the topic after both stopped cleanly."""
    ensure_topics(kafka, [kafka.samples_topic])
    topic = f"alerts-{uuid.uuid4().hex[:10]}"
    port = free_port()
    full_env = dict(os.environ, PYTHONPATH=str(REPO), STREAMREC_KAFKA_BOOTSTRAP_SERVERS=kafka.bootstrap_servers,
                    STREAMREC_KAFKA_SAMPLES_TOPIC=kafka.samples_topic, STREAMREC_LEARNER_BUCKETS="64",
                    STREAMREC_LEARNER_ID_CAPACITY="200", STREAMREC_LEARNER_CTX_BUCKETS="16",
                    STREAMREC_LEARNER_MLP="16", STREAMREC_LEARNER_METRICS_WINDOW="2000",
                    STREAMREC_LEARNER_GROUP_ID=f"learner-{kafka.samples_topic}", **(env or {}))
    rules = tmp_path / "rules.toml"
    rules.write_text(f'interval_s = 0.25\n[sources]\nlearner = "http://127.0.0.1:{port}/metrics"\n'
                     f'[sinks]\nlog = true\nkafka_topic = "{topic}"\n' + shipped_rule(rule))
    producer = AckedProducer(kafka)
    batch_no = 0

    def send_one() -> None:
        nonlocal batch_no
        send(producer, batch_no)
        producer.flush()
        batch_no += 1

    for _ in range(5):
        send_one()
    learner = subprocess.Popen([sys.executable, "-m", learner_module, "train", "--checkpoint-dir",
                                str(tmp_path / "ckpt"), "--batch-rows", str(ROWS), "--metrics-port", str(port)],
                               env=full_env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    monitor = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "monitor", "--rules", str(rules),
                                "--bootstrap-servers", kafka.bootstrap_servers, "--json"],
                               env=full_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [learner, monitor]
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + timeout_s
        while not alerts_so_far(kafka, topic):
            for p in procs:
                assert p.poll() is None, f"{p.args[3]} exited early ({p.returncode}): {p.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, f"no {rule} alert; the learner's metrics:\n" + "\n".join(
                line for line in scrape(url).splitlines() if "health" in line or "norm" in line or "coverage"
                in line or "positive" in line or "memory" in line or "rss" in line)
            send_one()
            if check is not None:
                check(scrape(url), learner.pid)
            time.sleep(0.2)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        out, err = monitor.communicate(timeout=30)
        _, learner_err = learner.communicate(timeout=60)
    finally:
        for p in procs:
            kill_and_reap(p)
    assert learner.returncode == 0, learner_err[-3000:]
    assert monitor.returncode == 0, err[-3000:]
    assert json.loads(out)["alerts"]["firing"] >= 1
    records = [Alert.from_json(r.value) for r in read_topic(kafka, topic)]
    assert records and all(a.rule == rule for a in records) and records[0].state is AlertState.FIRING
    return records


def test_a_zero_learning_rate_fires_model_not_learning(kafka: KafkaSettings, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    seen: dict[str, float] = {}

    def check(text: str, pid: int) -> None:
        for part in ("dense", "embedding"):
            for stat in ("count", "sum"):
                v = metric(text, f'streamrec_learner_grad_norm_{stat}{{part="{part}"}}')
                if v is not None:
                    seen[f"{part}_{stat}"] = v

    alerts = run_until_alert(kafka, tmp_path, "model_not_learning",
                             lambda p, i: p.send(kafka.samples_topic, samples(i * ROWS, rng), "k", partition=0),
                             env={"STREAMREC_LEARNER_LR_DENSE": "0", "STREAMREC_LEARNER_LR_SPARSE": "0"},
                             check=check)
    assert {dict(a.labels)["part"] for a in alerts} <= {"dense", "embedding"} and alerts[0].value == 0.0
    # the gradients are still there, as large as ever: a zero rate shows in the updates, not in the gradients
    assert seen["dense_count"] > 0 and seen["dense_sum"] / seen["dense_count"] > 1e-4
    assert seen["embedding_count"] > 0 and seen["embedding_sum"] / seen["embedding_count"] > 1e-6


def test_a_feature_that_stops_arriving_fires_feature_stopped_arriving(kafka: KafkaSettings, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    alerts = run_until_alert(
        kafka, tmp_path, "feature_stopped_arriving",  # ctx.device in the first 8 batches, then never again
        lambda p, i: p.send(kafka.samples_topic, samples(i * ROWS, rng, device=i < 8), "k", partition=0))
    assert [dict(a.labels)["field"] for a in alerts if a.state is AlertState.FIRING] == ["ctx.device"]
    assert alerts[0].value < 0.01


def test_a_stream_of_positives_only_fires_one_class_labels(kafka: KafkaSettings, tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    alerts = run_until_alert(
        kafka, tmp_path, "one_class_labels",
        lambda p, i: p.send(kafka.samples_topic, samples(i * ROWS, rng, label=1.0), "k", partition=0))
    assert alerts[0].value == 0.5  # |1.0 - 0.5|


def test_a_leaking_learner_fires_memory_growth(kafka: KafkaSettings, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    rss_seen: list[tuple[float, int]] = []

    def check(text: str, pid: int) -> None:
        rss = metric(text, "streamrec_learner_rss_bytes")
        status = Path(f"/proc/{pid}/status").read_text()
        vm_rss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]
        if rss is not None and rss > 0:
            rss_seen.append((rss, vm_rss))

    alerts = run_until_alert(
        kafka, tmp_path, "memory_growth",
        lambda p, i: p.send(kafka.samples_topic, samples(i * ROWS, rng), "k", partition=0),
        learner_module="tests.integration.test_health_alerts", check=check)
    assert dict(alerts[0].labels)["memory"] == "rss" and alerts[0].value > 512 * 2 ** 20
    # the RSS gauge is the process's (published once a second, so it trails /proc by up to a second of leaking)
    assert rss_seen
    first, vm_first = rss_seen[0]
    assert 100 * 2 ** 20 < first < 16 * 2 ** 30 and abs(first - vm_first) < 64 * 2 ** 20 + 0.1 * vm_first


if __name__ == "__main__":  # the leaking learner of test_a_leaking_learner_fires_memory_growth (test code only)
    import learner.health
    from learner.trainer import Trainer
    from streamrec.cli import main

    learner.health.MEMORY_WINDOW_S = LEAK_WINDOW_S
    _leaked: list[bytes] = []
    _test_then_train = Trainer.test_then_train

    def _leaking_step(self, batch):  # noqa: ANN001, ANN202 - a patch
        if len(_leaked) < LEAK_BATCHES:
            _leaked.append(b"\x01" * LEAK_BYTES)  # written, so resident
        return _test_then_train(self, batch)

    Trainer.test_then_train = _leaking_step  # type: ignore[method-assign]
    sys.exit(main(sys.argv[1:]))
