"""A fresh learner's wait for its first samples (``infer_feature_config``, ``first_samples_clock``) on a fake clock:
a stall is no waiting. A learner stopped (SIGSTOP, a long GC pause) past its probe or its ``exit_when_idle_s`` before
any sample came woke to end its run "no samples arrived", with the samples that came during the stall unread."""

from __future__ import annotations

from typing import Any

import pytest

import learner.daemon as daemon
from learner.config import LearnerSettings
from stream.config import KafkaSettings
from tests.unit.learner.test_sample_dataset import Clock, Msg, sample


class Topic:
    partitions = {0: None}


class Metadata:
    topics: dict[str, Topic] = {}

    def __init__(self, topic: str) -> None:
        self.topics = {topic: Topic()}


class ProbeAfterStall:
    """The probe's consumer: the first poll is where the process was stopped for ``stall_s`` (nothing comes back);
    the samples that arrived meanwhile come with the next poll. An empty poll waits out its timeout."""

    def __init__(self, clock: Clock, stall_s: float) -> None:
        self.clock, self.stall_s, self.polls = clock, stall_s, 0
        self.waiting = [sample(k, n=4) for k in range(2)]

    def list_topics(self, topic: str, timeout: float) -> Metadata:
        return Metadata(topic)

    def assign(self, tps: list[Any]) -> None: ...

    def consume(self, n: int, timeout: float) -> list[Msg]:
        self.polls += 1
        if self.polls == 1:
            self.clock.t += self.stall_s
            return []
        out, self.waiting = [Msg(0, k, v) for k, v in enumerate(self.waiting)], []
        self.clock.t += 0.05 if out else timeout
        return out

    def close(self) -> None: ...


def test_a_stall_in_the_probe_is_no_waiting_and_the_samples_of_the_stall_make_the_config(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(daemon.time, "monotonic", clock)
    consumer = ProbeAfterStall(clock, stall_s=12.0)
    monkeypatch.setattr(daemon, "new_consumer", lambda *a, **k: consumer)
    cfg = daemon.infer_feature_config(KafkaSettings(), LearnerSettings(), timeout_s=5.0)
    assert cfg is not None and {"user_id", "item_id", "history"} <= {f.name for f in cfg.fields}
    assert consumer.polls == 3  # the stall, the samples, one empty poll: decided on what came


def test_a_probe_without_a_stall_or_samples_gives_up_after_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(daemon.time, "monotonic", clock)
    consumer = ProbeAfterStall(clock, stall_s=0.0)
    consumer.waiting = []
    monkeypatch.setattr(daemon, "new_consumer", lambda *a, **k: consumer)
    assert daemon.infer_feature_config(KafkaSettings(), LearnerSettings(), timeout_s=5.0) is None
    assert clock.t == pytest.approx(5.0)


def test_a_stall_between_probes_counts_as_one_probe_against_exit_when_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(daemon.time, "monotonic", clock)
    waited = daemon.first_samples_clock()
    clock.t += daemon.PROBE_S + 12.0  # a probe with a 12 s stall in it, with --exit-when-idle 10
    assert waited.tick() == pytest.approx(daemon.PROBE_S)
    clock.t += daemon.PROBE_S  # then two ordinary empty probes reach the limit
    clock.t += 0.3
    assert waited.tick() >= 10.0


def test_a_learner_stopped_by_a_signal_before_its_first_samples_says_signal_not_no_samples(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """SIGTERM while a fresh learner waits for its first samples ended its run "no samples arrived": the operator's
    stop read as an empty topic."""
    learner = daemon.Learner(KafkaSettings(), LearnerSettings(checkpoint_dir=tmp_path / "ckpt"))

    def stopped_in_the_probe(*args: Any, **kwargs: Any) -> None:
        learner._stop = True  # (what the SIGTERM handler sets)
        return None

    monkeypatch.setattr(daemon, "infer_feature_config", stopped_in_the_probe)
    monkeypatch.setattr(daemon, "take_stop_signals", lambda *a: None)
    try:
        assert learner.run()["reason"] == "signal"
    finally:
        learner.close()
