"""How long ``streamrec refresh`` may take to stop: the stop grace for the run in progress (scheduler.STOP_GRACE_S),
then the alert drain (``close_timeout_s``, plus the queue's join grace). It was 20 + 10 (+ 0.5) s: past the 30 s after
which Kubernetes (terminationGracePeriodSeconds' default) and compose (``stop_grace_period: 30s``) SIGKILL the
process, which could cut the drain, and the abandonment alert with it. The defaults must leave a margin."""

from __future__ import annotations

from pathlib import Path

import yaml

from cache_refresh.alerts import RefreshAlerts
from cache_refresh.scheduler import STOP_GRACE_S
from monitor.delivery import QueuedSink
from stream.config import KafkaSettings

ROOT = Path(__file__).resolve().parents[3]
MARGIN_S = 5.0  # the shutdown's polling slices, logging, and the interpreter's exit


def longest_stop_s() -> float:
    return STOP_GRACE_S + RefreshAlerts(KafkaSettings(), "").settings.close_timeout_s + QueuedSink.JOIN_GRACE_S


def test_the_refresh_stops_within_kubernetes_default_termination_grace_with_a_margin() -> None:
    assert longest_stop_s() + MARGIN_S <= 30.0, longest_stop_s()


def test_the_refresh_stops_within_the_compose_stop_grace_period_with_a_margin() -> None:
    compose = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
    grace = compose["services"]["refresh"]["stop_grace_period"]
    assert grace.endswith("s") and longest_stop_s() + MARGIN_S <= float(grace[:-1]), (grace, longest_stop_s())
