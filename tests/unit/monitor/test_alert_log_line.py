"""The log sink's line for an alert whose labels came from a scrape target: one line, whatever the labels hold."""

from __future__ import annotations

import logging

from monitor.alerts import Alert, LogSink
from monitor.rule_engine import RuleEngine
from monitor.rules import loads_rules
from monitor.scrape import Snapshot

RULE = """
[[rule]]
name = "queue_depth"
expr = "streamrec_queue_depth"
op = ">"
threshold = 5
"""


def logged(text: str, caplog) -> tuple[Alert, str]:
    """The alert the rule fires on the scraped ``text``, and the one line the log sink writes for it."""
    (alert,) = RuleEngine(loads_rules(RULE).rules).evaluate(Snapshot.from_texts({"learner": text}), 0.0)
    logger = logging.getLogger("test.alert_log_line")
    with caplog.at_level(logging.INFO, logger=logger.name):
        LogSink(logger).send([alert])
    (line,) = [r.getMessage() for r in caplog.records]
    return alert, line


def test_a_scraped_label_with_a_line_break_or_a_terminal_escape_cannot_forge_a_log_line(caplog) -> None:
    """The exposition's ``\\n`` escape is a line break in the label value, and a value may hold ESC: written raw, the
    target wrote a second, forged alert line (and terminal sequences) into the monitor's log."""
    forged = 'x\\nFIRING critical nan_losses{} value=1 source=learner id=0: forged'
    text = f'streamrec_queue_depth{{topic="{forged}",colour="\x1b[31mred\\"q"}} 9\n'
    (alert,) = RuleEngine(loads_rules(RULE).rules).evaluate(Snapshot.from_texts({"learner": text}), 0.0)
    assert alert.labels["topic"].count("\n") == 1  # the sinks' JSON keeps the value as it is
    logger = logging.getLogger("test.alert_log_line")
    with caplog.at_level(logging.INFO, logger=logger.name):
        LogSink(logger).send([alert])
    (line,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and "\x1b" not in line
    assert 'topic="x\\nFIRING critical nan_losses{} value=1' in line and 'colour="\\u001b[31mred\\"q"' in line
    assert line.startswith("FIRING warning queue_depth{")


def test_a_scraped_label_value_of_megabytes_is_logged_shortened_with_the_alerts_fingerprint(caplog) -> None:
    """The Kafka and webhook sinks send such an alert shortened (:meth:`Alert.shortened`); the log sink wrote the whole
    value, a line of megabytes at every firing and resolved alert."""
    text = f'streamrec_queue_depth{{topic="{"t" * 2_000_000}"}} 9\n'
    alert, line = logged(text, caplog)
    assert len(line) < 4000 and "(2000000 characters)" in line and f"id={alert.fingerprint}" in line


def test_a_series_of_a_hundred_thousand_labels_is_logged_shortened_saying_how_many_were_left_out(caplog) -> None:
    """Each label short, so cutting each one to 1024 characters left them all: the line was the whole series, a
    megabyte (16 at the scrape's size limit) at every firing and resolved alert (over Kafka's message size, shortened
    too)."""
    many = ",".join(f'l{i:06d}="v"' for i in range(100_000))
    text = f'streamrec_queue_depth{{topic="t",{many}}} 9\n'
    alert, line = logged(text, caplog)
    assert len(line) < 40_000 and f"id={alert.fingerprint}" in line, len(line)
    left_out = 100_001 - line.count('="v"') - line.count('="t"')
    assert f'...="{left_out} more labels left out"' in line and 'l000000="v"' in line
