"""The faust driver's App runs on streamrec's settings, as the kafka driver's consumer does, whatever faust's
environment names say (they win over an App's arguments), and makes no topic of its own: faust declares none (the
pipeline creates the topics it needs) and runs no leader election, whose topic ``<app_id>-__assignor-__leader`` the
broker auto-created with its own defaults. The topics on the real broker:
tests/integration/test_join_driver_parity.py::test_the_faust_driver_makes_no_topic_the_kafka_driver_does_not."""

from __future__ import annotations

import logging
import shutil
from types import SimpleNamespace

import pytest

from stream.config import KafkaSettings
from stream.idle_clock import IdleClock
from stream.joiner.config import JoinerSettings
from stream.joiner.worker import FaustJoinWorker


def _app_conf(kafka: KafkaSettings) -> object:
    pipeline = SimpleNamespace(held_counts={}, engines={}, processed={}, awake=IdleClock(1.0, 0.0))
    worker = FaustJoinWorker(pipeline, kafka, JoinerSettings())  # type: ignore[arg-type]
    shutil.rmtree(worker._datadir, ignore_errors=True)
    return worker.app.conf


@pytest.mark.parametrize("prefix", ["", "SR_"], ids=["no_prefix", "app_env_prefix"])
def test_faust_environment_names_do_not_override_the_settings_the_worker_gives_and_are_said(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, prefix: str) -> None:
    # BROKER_URL took the faust driver to another broker than [kafka] bootstrap_servers, CONSUMER_AUTO_OFFSET_RESET a
    # new group past its backlog, APP_WEB_ENABLED opened faust's web server: the kafka driver reads none of them
    if prefix:
        monkeypatch.setenv("APP_ENV_PREFIX", prefix)
    for name, value in {"BROKER_URL": "kafka://elsewhere:1", "CONSUMER_AUTO_OFFSET_RESET": "latest",
                        "APP_WEB_ENABLED": "true", "PROCESSING_GUARANTEE": "exactly_once",
                        "BROKER_COMMIT_INTERVAL": "0.5"}.items():
        monkeypatch.setenv(prefix + name, value)
    with caplog.at_level(logging.WARNING, "streamrec.join"):
        conf = _app_conf(KafkaSettings(bootstrap_servers="127.0.0.1:9"))
    assert [str(u) for u in conf.broker] == ["kafka://127.0.0.1:9"]  # type: ignore[attr-defined]
    assert (conf.consumer_auto_offset_reset, conf.web_enabled) == ("earliest", False)  # type: ignore[attr-defined]
    assert str(conf.processing_guarantee.value) == "at_least_once"  # type: ignore[attr-defined]
    assert conf.broker_commit_interval == 0.5  # type: ignore[attr-defined]  # (one the worker leaves to faust)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert all(prefix + n in said for n in ("BROKER_URL", "CONSUMER_AUTO_OFFSET_RESET", "APP_WEB_ENABLED"))
    assert "BROKER_COMMIT_INTERVAL" not in said


@pytest.mark.parametrize("env", [{}, {"TOPIC_ALLOW_DECLARE": "true", "TOPIC_DISABLE_LEADER": "false"}],
                         ids=["no_env", "faust_env_says_otherwise"])
def test_the_faust_driver_neither_declares_topics_nor_subscribes_a_leader_topic(monkeypatch: pytest.MonkeyPatch,
                                                                                 env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    conf = _app_conf(KafkaSettings(bootstrap_servers="127.0.0.1:9"))
    assert (conf.topic_allow_declare, conf.topic_disable_leader) == (False, True)  # type: ignore[attr-defined]
