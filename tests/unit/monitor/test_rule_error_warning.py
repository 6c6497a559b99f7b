"""A rule whose expression evaluates to an error (``monitor/rule_engine.py``): the warning was logged at every
evaluation, one line per rule every interval for as long as the error lasted; it is said once per rule and error,
again when the error changes, and once more after it has cleared and come back."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from monitor.alerts import Severity
from monitor.expr import MetricStore, Node, Value
from monitor.rule_engine import RuleEngine
from monitor.rules import Op, Rule
from monitor.scrape import Snapshot


@dataclass(frozen=True)
class Scripted(Node):
    """An expression that raises what ``errors`` holds first (None: evaluates to 1)."""

    errors: list[Exception | None] = field(default_factory=list)

    def eval(self, store: MetricStore) -> Value:
        if (exc := self.errors.pop(0)) is not None:
            raise exc
        return 1.0


def warnings_said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "evaluates to an error" in r.getMessage()]


def test_a_rule_error_is_warned_once_until_it_changes_or_clears(caplog: pytest.LogCaptureFixture) -> None:
    overflow, other = OverflowError("math range error"), ValueError("bad value")
    tree = Scripted([overflow, overflow, overflow, other, other, None, overflow])
    engine = RuleEngine([Rule(name="r", expr="x", op=Op.GT, threshold=0.0, for_s=0.0, severity=Severity.WARNING,
                              description="", tree=tree)])
    caplog.set_level(logging.INFO, "streamrec.monitor")
    for now in range(3):  # the same error at three evaluations: said once
        engine.evaluate(Snapshot(), float(now))
    assert warnings_said(caplog) == ["rule r: x evaluates to an error: OverflowError: math range error "
                                     "(said once until it changes or clears)"]
    engine.evaluate(Snapshot(), 3.0)  # another error: said
    engine.evaluate(Snapshot(), 4.0)
    assert len(warnings_said(caplog)) == 2 and "ValueError: bad value" in warnings_said(caplog)[1]
    engine.evaluate(Snapshot(), 5.0)  # cleared: said, and the first error coming back is said again
    assert any(r.getMessage() == "rule r: x evaluates again" for r in caplog.records)
    engine.evaluate(Snapshot(), 6.0)
    assert len(warnings_said(caplog)) == 3 and "OverflowError" in warnings_said(caplog)[2]
