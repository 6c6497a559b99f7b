"""A source that keeps failing is warned about once (``Monitor.step``), not once per interval: its reason often
quotes what the source answered (the line that does not parse, the line a cut answer ends in), which changes
with every scrape, and a changed reason was logged again each time. A failure of another kind is said again."""

from __future__ import annotations

import logging

import pytest

from monitor.delivery import QueuedSink
from monitor.engine import Monitor
from monitor.rules import loads_rules
from monitor.scrape import Scraper

RULES = """
[sources]
learner = "http://learner:9100/metrics"

[[rule]]
name = "lagging"
expr = "streamrec_lag"
op = ">"
threshold = 100
"""


class NullSink:
    name, timeout_s, batch_max = "null", 1.0, 100

    def send(self, alerts: object, deadline: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def failures_said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.getMessage().startswith("scrape of source learner failed")]


def run(answers: list[str | Exception], caplog: pytest.LogCaptureFixture) -> list[str]:
    config = loads_rules(RULES)
    scraper = Scraper.of(config)
    queue = list(answers)

    def fetch(url: str) -> str:
        answer = queue.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    scraper.fetch = fetch  # type: ignore[method-assign]
    mon = Monitor(config, QueuedSink(NullSink(), config.sinks), scrape=scraper.scrape)
    try:
        with caplog.at_level(logging.WARNING, logger="streamrec.monitor"):
            for _ in answers:
                mon.step()
    finally:
        mon.close()
    return failures_said(caplog)


def test_a_source_whose_garbled_line_changes_every_scrape_is_warned_about_once(
        caplog: pytest.LogCaptureFixture) -> None:
    answers: list[str | Exception] = [f"streamrec_lag {n},5\n" for n in range(5)]  # a decimal comma
    said = run(answers, caplog)
    assert len(said) == 1, said
    assert "0,5" in said[0]


def test_a_source_cut_off_at_a_different_line_every_scrape_is_warned_about_once(
        caplog: pytest.LogCaptureFixture) -> None:
    answers: list[str | Exception] = [f"streamrec_lag 1\nstreamrec_other{{n=\"{n}\"}} 1" for n in range(4)]
    assert len(run(answers, caplog)) == 1


def test_a_failure_of_another_kind_and_one_after_an_answer_are_said_again(
        caplog: pytest.LogCaptureFixture) -> None:
    answers: list[str | Exception] = ["streamrec_lag 1,5\n", "streamrec_lag 2,5\n", OSError("HTTP 500 boom"),
                                      "streamrec_lag 3\n", "streamrec_lag 4,5\n"]
    said = run(answers, caplog)
    assert len(said) == 3, said
    assert "1,5" in said[0] and "HTTP 500" in said[1] and "4,5" in said[2]
