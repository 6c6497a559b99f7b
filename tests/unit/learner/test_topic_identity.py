"""Which samples topic a checkpoint's offsets are of (``learner.checkpoint_format.same_topic``, the single-process
daemon's ``_check_topic_ids``): a topic id differing from the one of the topic's name now drops the offsets; a
checkpoint or a broker without an id resumes as before. The real broker's case:
``tests/integration/test_learner.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

import learner.daemon as daemon
from learner import checkpoint
from learner.config import Device, LearnerSettings
from stream.config import KafkaSettings


@pytest.mark.parametrize(("recorded", "now", "same"), [
    ({"topic_id": "A", "cluster_id": "c"}, {"topic_id": "A", "cluster_id": "c"}, True),
    ({"topic_id": "A", "cluster_id": "c"}, {"topic_id": "B", "cluster_id": "c"}, False),
    ({}, {"topic_id": "B", "cluster_id": "c"}, True),  # a checkpoint written before topic ids were recorded
    ({"topic_id": "A"}, {"cluster_id": "c"}, True),  # a broker that gives no topic id (or an all-zero one)
    ({"topic_id": "A"}, {}, True),  # a broker that could not be asked
], ids=["same id", "another id", "no id recorded", "no id given", "broker not asked"])
def test_only_two_different_topic_ids_tell_another_topic(recorded: dict, now: dict, same: bool,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    assert checkpoint.same_topic(recorded, now, "samples") is same
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == (0 if same else 1)
    assert same or ("topic id A" in errors[0] and "topic id B" in errors[0])


def test_a_topic_id_of_another_type_is_a_damaged_meta() -> None:
    assert checkpoint.mistyped({"topic_id": 5}) is not None
    assert checkpoint.mistyped({"topic_id": "AaJKdeh4feKWXR7Turulgw", "cluster_id": "tansu_cluster"}) is None


def test_the_learner_drops_another_topics_offsets_and_strikes_and_keeps_the_recorded_id_where_the_broker_gives_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ls = LearnerSettings(checkpoint_dir=tmp_path / "ck", mlp=(8,), device=Device.CPU, deltas_every_s=0.0)
    learner = daemon.Learner(KafkaSettings(bootstrap_servers="127.0.0.1:9"), ls)  # never contacted
    try:
        learner.offsets, learner.topic_ids = {0: 5, 1: 7}, {"topic_id": "A", "cluster_id": "c"}
        monkeypatch.setattr(daemon, "topic_identity", lambda kafka, topic: {"cluster_id": "c"})
        learner._check_topic_ids()
        assert learner.offsets == {0: 5, 1: 7} and learner.topic_ids == {"topic_id": "A", "cluster_id": "c"}
        learner.strikes.failed([(learner.kafka.samples_topic, 0, 6)], ValueError("bad"))  # the old topic's message
        monkeypatch.setattr(daemon, "topic_identity", lambda kafka, topic: {"topic_id": "B", "cluster_id": "c"})
        learner._check_topic_ids()
        assert learner.offsets == {} and learner.topic_ids == {"topic_id": "B", "cluster_id": "c"}
        assert learner.strikes.counts == {}  # the new topic's offset 6 is another message
    finally:
        learner.close()
