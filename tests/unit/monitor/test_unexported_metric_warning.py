"""A rule whose expression names a metric no source exports is "no data" for ever: once every source has answered
at least once, the monitor says so in one warning per rule (naming the rule, the metric and the sources)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from monitor.delivery import QueuedSink
from monitor.engine import Monitor, evaluate_once
from monitor.rules import loads_rules
from monitor.scrape import Scraper, Snapshot
from tests.monitoring_io import NullSink

RULES = """interval_s = 1
[sources]
learner = "http://127.0.0.1:1/metrics"
serving = "http://127.0.0.1:2/metrics"
[sinks]
log = false
[[rule]]
name = "typo"
expr = 'streamrec_learner_lagg_samples'
op = ">"
threshold = 0
[[rule]]
name = "ratio"
expr = 'streamrec_learner_lag_samples / streamrec_serving_nothing_total'
op = ">"
threshold = 0
[[rule]]
name = "fine"
expr = 'max(streamrec_learner_lag_samples) + max(streamrec_serving_requests_total)'
op = ">"
threshold = 0
[[rule]]
name = "late_but_fine"
expr = 'streamrec_serving_requests_total'
op = ">"
threshold = 0
"""



def scrapes(rounds: list[dict[str, str | None]]) -> Callable[[], Snapshot]:
    """Each call the next round: source -> its text, or None for a failed scrape."""
    it = iter(rounds)

    def scrape() -> Snapshot:
        answers = next(it)
        snap = Snapshot.from_texts({s: t for s, t in answers.items() if t is not None})
        snap.errors.update({s: "connection refused" for s, t in answers.items() if t is None})
        return snap

    return scrape


def test_a_rule_on_a_metric_no_source_exports_is_warned_once_after_every_source_answered(
        caplog: pytest.LogCaptureFixture) -> None:
    learner = 'streamrec_learner_lag_samples{partition="0"} 3\n'
    serving = "streamrec_serving_requests_total 10\n"
    config = loads_rules(RULES)
    mon = Monitor(config, QueuedSink(NullSink(), config.sinks), scrape=scrapes(
        [{"learner": learner, "serving": None}] * 2 + [{"learner": learner, "serving": serving}] * 3))
    try:
        with caplog.at_level(logging.WARNING, logger="streamrec.monitor"):
            mon.step()
            mon.step()
            said = lambda: [r.message for r in caplog.records if "no source has exported" in r.message]  # noqa: E731
            assert said() == []  # serving has not answered yet: its metrics may still come
            for _ in range(3):
                mon.step()
        warned = said()
        assert len(warned) == 2, warned  # one per rule, not per evaluation
        typo, ratio = sorted(warned, key=lambda m: "ratio" in m)
        assert "typo" in typo and "streamrec_learner_lagg_samples" in typo
        assert "learner" in typo and "serving" in typo
        assert "ratio" in ratio and "streamrec_serving_nothing_total" in ratio
        assert "streamrec_learner_lag_samples" not in ratio  # exported: only the missing metric is named
    finally:
        mon.close(0)


def test_a_declared_metric_family_without_samples_yet_is_exported_and_not_warned_about(
        caplog: pytest.LogCaptureFixture) -> None:
    # a labelled counter that has not counted yet (streamrec_input_lost_to_retention_total{reader,topic}: a packaged
    # rule reads it) is exported as its # HELP and # TYPE lines only: a healthy system was warned about
    config = loads_rules(RULES.replace("streamrec_learner_lagg_samples", "streamrec_learner_lost_total")
                         .replace("streamrec_serving_nothing_total", "streamrec_serving_wait_seconds_bucket"))
    learner = ("# HELP streamrec_learner_lost_total records lost\n# TYPE streamrec_learner_lost counter\n"
               'streamrec_learner_lag_samples{partition="0"} 3\n')
    serving = ("# HELP streamrec_serving_wait_seconds a wait\n# TYPE streamrec_serving_wait_seconds histogram\n"
               "streamrec_serving_requests_total 10\n")
    mon = Monitor(config, QueuedSink(NullSink(), config.sinks), scrape=scrapes([{"learner": learner,
                                                                                  "serving": serving}] * 2))
    try:
        with caplog.at_level(logging.WARNING, logger="streamrec.monitor"):
            mon.step()
            mon.step()
        assert [r.message for r in caplog.records if "no source has exported" in r.message] == []
    finally:
        mon.close(0)


def test_monitor_once_warns_of_a_rule_on_a_metric_no_source_exports_as_the_daemon_does(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # `streamrec monitor --once` showed the misspelt rule as "no data" in silence: the check a user runs to try a new
    # rules file was the one place the warning did not come
    texts = {"http://127.0.0.1:1/metrics": 'streamrec_learner_lag_samples{partition="0"} 3\n',
             "http://127.0.0.1:2/metrics": "streamrec_serving_requests_total 10\n"}
    monkeypatch.setattr(Scraper, "fetch", lambda self, url: texts[url])
    with caplog.at_level(logging.WARNING, logger="streamrec.monitor"):
        evaluate_once(loads_rules(RULES))
    warned = sorted(r.message for r in caplog.records if "no source has exported" in r.message)
    assert len(warned) == 2 and "streamrec_learner_lagg_samples" in warned[1]
    assert "ratio" in warned[0] and "streamrec_serving_nothing_total" in warned[0]
