"""The packaged ``learner_trains_nothing`` rule (``monitor/default_rules.toml``) over the learner's own
``streamrec_learner_samples_total`` and ``streamrec_learner_lag_samples`` (``learner/daemon.py``,
``learner/lag.py``), read as ``streamrec monitor`` reads them: this process's Prometheus text scraped once a minute."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from learner.daemon import SAMPLES
from learner.lag import LAG
from monitor.alerts import AlertState
from tests.unit.learner.test_cold_start_metrics import default_rule, scraped


def alerts(minutes: list[tuple[int, int]]) -> list[tuple[int, AlertState]]:
    """The rule's alerts while, in minute k, the learner trains ``minutes[k][0]`` samples with ``minutes[k][1]``
    samples messages waiting in its topic (its lag gauge, one partition)."""
    engine = default_rule("learner_trains_nothing")
    LAG.clear()
    out = []
    for k, (trained, lag) in enumerate(minutes):
        SAMPLES.inc(trained)
        LAG.labels("0").set(lag)
        out += [(k, a.state) for a in engine.evaluate(scraped(), k * 60.0)]
    return out


@pytest.fixture(autouse=True)
def _no_lag_series_left() -> Iterator[None]:
    yield
    LAG.clear()


def test_the_learner_trains_nothing_rule_fires_when_nothing_is_trained_while_samples_wait() -> None:
    # Nothing alerted on a learner that trained no sample at all while its input piled up below learner_lag's 500
    # messages (a low-traffic stream), or while it was stuck. 20 minutes of training, then 30 of nothing with 40
    # messages waiting: the last samples trained in minute 19, none in the last 5 minutes from minute 24, and that for
    # the rule's 10 minutes at minute 34.
    got = alerts([(2000, 3)] * 20 + [(0, 40)] * 30)
    assert got == [(34, AlertState.FIRING)]


def test_the_learner_trains_nothing_rule_resolves_when_training_resumes() -> None:
    # Stuck from its start (the counter's increase is known from the second scrape, minute 1), training from minute 20
    got = alerts([(0, 40)] * 20 + [(500, 60)] * 5)
    assert got == [(11, AlertState.FIRING), (20, AlertState.RESOLVED)]


def test_the_learner_trains_nothing_rule_stays_quiet_on_an_idle_learner_with_nothing_to_read() -> None:
    # A quiet night: nothing trained because nothing arrived (lag 0): 0 / 0 is no data, not an alert.
    assert alerts([(2000, 0)] * 5 + [(0, 0)] * 60) == []


def test_the_learner_trains_nothing_rule_stays_quiet_while_training_progresses_behind_a_backlog() -> None:
    # A learner catching up on 100,000 waiting messages, slowly: that is learner_lag's alert, not this one.
    assert alerts([(10, 100_000)] * 60) == []
