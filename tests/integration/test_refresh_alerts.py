"""The refresh's own alerts when the broker is down at alert time (cache_refresh/alerts.py), against the session broker.

The broker is reached through a TCP relay on a port of its own: closed, the refresh cannot bootstrap (Kafka is down
for it); opened, the client bootstraps through it and then talks to the broker it advertises.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from cache_refresh import job
from cache_refresh.alerts import RefreshAlerts
from cache_refresh.settings import RefreshSettings
from monitor.alerts import SinkSettings
from stream.config import KafkaSettings, RedisSettings
from streamrec.stack import free_port
from tests.kafka_io import read_topic


class Relay:
    """Forwards ``127.0.0.1:<port>`` to ``upstream`` once :meth:`open` ran; until then nothing listens there."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.port = free_port()
        self._server: socket.socket | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def open(self) -> None:
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._server.settimeout(0.2)
        self._spawn(self._accept)

    def _spawn(self, target, *args) -> None:  # noqa: ANN001
        t = threading.Thread(target=target, args=args, name="test-relay", daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                conn.close()
                continue
            self._spawn(self._pump, conn, up)

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([a, b], [], [], 0.2)
                for src in ready:
                    data = src.recv(65536)
                    if not data:
                        return
                    (b if src is a else a).sendall(data)
        except OSError:
            return
        finally:
            a.close()
            b.close()

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.close()
        for t in self._threads:
            t.join(5)


def alerts_in(kafka: KafkaSettings, topic: str) -> list[dict]:
    try:
        return [json.loads(r.value) for r in read_topic(kafka, topic, timeout_s=10)]
    except Exception:  # noqa: BLE001 - the topic does not exist yet: no alert
        return []


def wait_for_alert(kafka: KafkaSettings, topic: str, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := alerts_in(kafka, topic):
            return got
        time.sleep(0.5)
    return []


def test_a_scheduled_runs_alert_raised_while_kafka_is_down_reaches_the_topic_once_it_is_back(
        stack, kafka: KafkaSettings, tmp_path: Path) -> None:
    """The scheduler's run fails (no checkpoint) while the broker cannot be reached: its ``refresh_failed`` alert is
    logged and stays queued, and arrives in the alerts topic when the broker is back. Before, the refresh made one
    Kafka attempt, wrote "could not write the alert" to the log and the alert was lost."""
    relay = Relay(kafka.bootstrap_servers)
    topic = f"alerts-{uuid.uuid4().hex[:8]}"
    cfg = tmp_path / "c.toml"
    now = dt.datetime.now(dt.timezone.utc)  # the run due this minute is caught up at start; the next one is tomorrow
    cfg.write_text(f'[kafka]\nbootstrap_servers = "{relay.address}"\n'
                   f'[redis]\nurl = "redis://127.0.0.1:{free_port()}/0"\n'
                   f'[refresh]\ncheckpoint_dir = "{tmp_path / "none"}"\npublish_root = "{tmp_path / "serving"}"\n'
                   f'schedule = "{now.minute} {now.hour} * * *"\nmisfire_grace_s = 600\nalerts_topic = "{topic}"\n')
    proc = subprocess.Popen([sys.executable, "-m", "streamrec.cli", "refresh", "--config", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), name="test-stderr", daemon=True)  # type: ignore[arg-type]
    reader.start()
    kafka_failed = re.compile(r"alert sink kafka: attempt failed|could not write the alert to Kafka")
    try:
        deadline = time.monotonic() + 90
        while not any(kafka_failed.search(ln) for ln in list(lines)) and time.monotonic() < deadline:
            assert proc.poll() is None, "".join(lines)
            time.sleep(0.2)
        text = "".join(lines)
        assert "refresh failed at checkpoint" in text and kafka_failed.search(text), text[-3000:]
        relay.open()  # the broker is back
        got = wait_for_alert(kafka, topic, 90)
        assert [(a["rule"], a["labels"]["stage"]) for a in got] == [("refresh_failed", "checkpoint")], \
            "".join(lines)[-3000:]
        assert "no checkpoint in" in got[0]["message"]
    finally:
        proc.terminate()
        proc.wait(30)
        reader.join(10)
        relay.close()
    assert proc.returncode == 0


def test_a_one_shot_runs_alert_waits_for_delivery_and_what_kafka_never_took_is_counted_and_logged(
        stack, kafka: KafkaSettings, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``run_once`` without the scheduler's alerts opens its own and closes it before it returns: the alert is in
    the topic when the run's error reaches the caller; with the broker unreachable the run still fails with its
    own error (not the alert's), and the undelivered alert is logged as such when the run gives up on it."""
    topic = f"alerts-{uuid.uuid4().hex[:8]}"
    rs = RefreshSettings(checkpoint_dir=tmp_path / "none", publish_root=tmp_path / "serving", alerts_topic=topic)
    rds = RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(job.RefreshError, match="at checkpoint: no checkpoint"):
        job.run_once(rs, kafka, rds)
    assert [a["labels"]["stage"] for a in alerts_in(kafka, topic)] == ["checkpoint"]

    down = KafkaSettings(bootstrap_servers=f"127.0.0.1:{free_port()}")
    quick = RefreshAlerts(down, topic, SinkSettings(kafka_topic=topic, kafka_timeout_s=1, close_timeout_s=1))
    with caplog.at_level("ERROR", logger="streamrec.alerts"), pytest.raises(job.RefreshError, match="at checkpoint"):
        try:
            job.run_once(rs, down, rds, alerts=quick)
        finally:
            assert quick.pending == 1 and quick.close() == 1
    assert any("closed with 1 alert(s) undelivered" in r.getMessage() for r in caplog.records)
