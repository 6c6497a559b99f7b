"""The faust driver makes no topic of its own: faust declares none (the pipeline creates the topics it needs) and runs
no leader election, whose topic ``<app_id>-__assignor-__leader`` the broker auto-created with its own defaults. faust's
environment names win over the arguments its App is given, so these hold whatever they say. On the real broker:
tests/integration/test_join_driver_parity.py::test_the_faust_driver_makes_no_topic_the_kafka_driver_does_not."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from stream.config import KafkaSettings
from stream.idle_clock import IdleClock
from stream.joiner.config import JoinerSettings
from stream.joiner.worker import FaustJoinWorker


@pytest.mark.parametrize("env", [{}, {"TOPIC_ALLOW_DECLARE": "true", "TOPIC_DISABLE_LEADER": "false"}],
                         ids=["no_env", "faust_env_says_otherwise"])
def test_the_faust_driver_neither_declares_topics_nor_subscribes_a_leader_topic(monkeypatch: pytest.MonkeyPatch,
                                                                                 env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    pipeline = SimpleNamespace(held_counts={}, engines={}, processed={}, awake=IdleClock(1.0, 0.0))
    worker = FaustJoinWorker(pipeline, KafkaSettings(bootstrap_servers="127.0.0.1:9"),  # type: ignore[arg-type]
                             JoinerSettings())
    shutil.rmtree(worker._datadir, ignore_errors=True)
    assert (worker.app.conf.topic_allow_declare, worker.app.conf.topic_disable_leader) == (False, True)
