"""The joiner's partition layout (stream/joiner/partitions.py): impressions and clicks with one partition count, the
outputs it writes by partition number with at least as many; checked again when a rebalance brings a partition
number past the count it started with (partitions added to the inputs while it runs)."""

from __future__ import annotations

import logging

import pytest

from stream.config import KafkaSettings
from stream.errors import ConfigError
from stream.joiner.partitions import Layout, check_layout

IMP, CLK, SAMPLES, LATE, STATE = "impressions", "clicks", "samples", "late_clicks", "app-join-state"


def test_inputs_with_other_partition_counts_are_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"impressions has 4 partitions and topic clicks has 1: the join needs the "
                                          r"same number"):
        check_layout({IMP: 4, CLK: 1, SAMPLES: 4}, IMP, CLK, [SAMPLES])
    with pytest.raises(ConfigError, match="impressions has 2 partitions and topic clicks has 3"):
        check_layout({IMP: 2, CLK: 3, SAMPLES: 4}, IMP, CLK, [SAMPLES])


def test_an_output_with_fewer_partitions_than_the_inputs_is_refused_naming_each() -> None:
    with pytest.raises(ConfigError, match=r"samples has 1, app-join-state has 3: add partitions to each .*"
                                          r"--partitions 4"):
        check_layout({IMP: 4, CLK: 4, SAMPLES: 1, LATE: 4, STATE: 3}, IMP, CLK, [SAMPLES, LATE, STATE])


def test_outputs_with_as_many_or_more_partitions_pass() -> None:
    assert check_layout({IMP: 4, CLK: 4, SAMPLES: 4, LATE: 8, STATE: 5}, IMP, CLK, [SAMPLES, LATE, STATE]) == 4


class Counts:
    """The broker's partition counts, changed by the test; counts the metadata requests."""

    def __init__(self, **counts: int) -> None:
        self.now = {IMP: 4, CLK: 4, SAMPLES: 4, LATE: 4, STATE: 4, **counts}
        self.asked = 0

    def __call__(self, kafka: KafkaSettings, topics: list[str]) -> dict[str, int]:
        self.asked += 1
        return {t: self.now[t] for t in topics}


def _layout(counts: Counts) -> Layout:
    kafka = KafkaSettings(impressions_topic=IMP, clicks_topic=CLK, samples_topic=SAMPLES)
    return Layout(kafka, [SAMPLES, LATE], STATE, 4, counts)


def test_an_assignment_within_the_known_partitions_asks_the_broker_nothing() -> None:
    counts = Counts()
    _layout(counts).assigned([0, 3, 3, 1])
    assert counts.asked == 0


def test_partitions_added_to_the_inputs_only_stop_the_worker_at_the_rebalance() -> None:
    counts = Counts(impressions=8)  # the operator grew impressions, not clicks (nor the outputs)
    with pytest.raises(ConfigError, match="impressions has 8 partitions and topic clicks has 4"):
        _layout(counts).assigned([5, 6])
    counts.now[CLK] = 8  # both inputs now, the outputs still 4
    with pytest.raises(ConfigError, match="samples has 4, late_clicks has 4, app-join-state has 4"):
        _layout(counts).assigned([7])


def test_partitions_added_to_every_topic_are_taken_with_a_warning_about_the_keys_before(
        caplog: pytest.LogCaptureFixture) -> None:
    counts = Counts(impressions=6, clicks=6, samples=6, late_clicks=6, **{STATE: 6})
    layout = _layout(counts)
    with caplog.at_level(logging.WARNING, logger="streamrec.join"):
        layout.assigned([5])
    assert layout.partitions == 6 and counts.asked == 1
    assert "6 partitions now (4 at start)" in caplog.text and "orphan" in caplog.text
    layout.assigned([5, 0])  # known now: not asked again
    assert counts.asked == 1


def test_a_missing_input_is_made_with_the_other_inputs_count_not_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from stream.joiner import partitions

    broker = {IMP: 8}  # the operator made impressions with 8 partitions; clicks' producers have not started yet

    def ensure_topics(kafka: KafkaSettings, topics: list[str], partitions: int | None = None) -> None:
        broker.update({t: partitions or kafka.partitions for t in topics if t not in broker})

    monkeypatch.setattr(partitions, "ensure_topics", ensure_topics)
    monkeypatch.setattr(partitions, "ensure_compacted", lambda kafka, t, partitions=None: ensure_topics(
        kafka, [t], partitions))
    kafka = KafkaSettings(impressions_topic=IMP, clicks_topic=CLK, samples_topic=SAMPLES, partitions=4)
    assert partitions.ensure_layout(kafka, [SAMPLES, LATE], STATE,
                                    lambda _, topics: {t: broker.get(t, 0) for t in topics}) == 8
    assert broker == {IMP: 8, CLK: 8, SAMPLES: 8, LATE: 8, STATE: 8}


@pytest.mark.parametrize(("inputs", "made_with"), [({IMP: 8, CLK: 8}, 8), ({IMP: 6}, 6), ({}, None)])
def test_a_learner_started_first_makes_the_samples_topic_with_the_inputs_count(
        monkeypatch: pytest.MonkeyPatch, inputs: dict[str, int], made_with: int | None) -> None:
    """It made it with [kafka] partitions (4): beside inputs of 8 the joiner then refused it (exit 2)."""
    from stream.joiner import partitions

    made: list[tuple[list[str], int | None]] = []
    monkeypatch.setattr(partitions, "ensure_topics", lambda kafka, topics, partitions=None: made.append(
        (list(topics), partitions)))
    kafka = KafkaSettings(impressions_topic=IMP, clicks_topic=CLK, samples_topic=SAMPLES, partitions=4)
    partitions.ensure_samples(kafka, lambda _, topics: {t: inputs.get(t, 0) for t in topics})
    assert made == [([SAMPLES], made_with)]  # None: ensure_topics' default, [kafka] partitions
