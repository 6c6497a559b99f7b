"""A label regex runs on label values no longer than ``regex_value_max`` (``monitor/expr.py``: REGEX_VALUE_MAX): the
load-time check refuses only the exponential shapes, and ``.*a.*b`` takes time quadratic in the value's length (a
40k-character value of a's: two seconds an evaluation), so one hostile label value stalled every evaluation. A longer
value does not match the regex (=~ leaves its series out, !~ keeps it), counted and said once. The work is measured
as the characters handed to the regex engine, not by a clock."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest

from monitor import expr
from monitor.rule_engine import REGEX_VALUES_SKIPPED, RuleEngine
from monitor.rules import loads_rules
from monitor.scrape import Snapshot

HOSTILE = "a" * 40_000


class CountingRe:
    """``re`` as monitor.expr uses it, recording the length of every value a regex is run on; one longer than any
    bound is not run (the test measures what would have been scanned, without spending the seconds)."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def fullmatch(self, pattern: str, string: str) -> Any:
        self.lengths.append(len(string))
        return re.fullmatch(pattern, string) if len(string) <= 10_000 else None

    def __getattr__(self, name: str) -> Any:  # the rest of re (the parser's compile, error)
        return getattr(re, name)


def rules(regex_op: str, setting: str = "") -> str:
    return (f"{setting}\n[[rule]]\nname = \"paths\"\nexpr = 'sum(streamrec_x{{path{regex_op}\".*a.*b\"}})'\n"
            "op = \">\"\nthreshold = 0\nfor_s = 0\n")


def scrape() -> Snapshot:
    return Snapshot.from_texts({"app": f'streamrec_x{{path="{HOSTILE}"}} 1\nstreamrec_x{{path="xaxb"}} 2\n'})


@pytest.mark.parametrize(("op", "total"), [("=~", 2.0), ("!~", 1.0)])
def test_a_label_value_longer_than_regex_value_max_never_reaches_the_regex_and_does_not_match(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, op: str, total: float) -> None:
    counting = CountingRe()
    monkeypatch.setattr(expr, "re", counting)
    engine = RuleEngine.of(loads_rules(rules(op)))
    before = REGEX_VALUES_SKIPPED.labels("streamrec_x", "path")._value.get()
    caplog.set_level(logging.WARNING, "streamrec.monitor")
    for now in (0.0, 15.0):
        engine.evaluate(scrape(), now)
        assert [s.value for s in engine.status()] == [total]  # only the short value is matched (=~) / excluded (!~)
    assert counting.lengths == [4, 4]  # before: [40000, 4, 40000, 4], the 40000 quadratic in .*a.*b
    assert REGEX_VALUES_SKIPPED.labels("streamrec_x", "path")._value.get() - before == 2
    said = [r.getMessage() for r in caplog.records if "regex_value_max" in r.getMessage()]
    assert said == ["metric streamrec_x: a value of label path is 40000 characters, more than regex_value_max=4096: "
                    "a regex matcher does not run on it and it does not match (counted in "
                    "streamrec_monitor_regex_values_skipped_total; said once)"]


def test_regex_value_max_is_a_setting_of_the_rules_file(monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingRe()
    monkeypatch.setattr(expr, "re", counting)
    engine = RuleEngine.of(loads_rules(rules("=~", "regex_value_max = 50000")))
    engine.evaluate(scrape(), 0.0)
    assert sorted(counting.lengths) == [4, 40_000]  # raised by the operator: the long value is matched again
