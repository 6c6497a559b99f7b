"""The Prometheus text exposition format as the monitor reads it (``monitor/exposition.py``): a sample line is
``metric_name [ "{" labels "}" ] value [ timestamp ]``; anything else makes the scrape fail with the line number,
never a silently wrong value."""

from __future__ import annotations

import logging
import math
import re
import time

import pytest
from prometheus_client import REGISTRY

from monitor.delivery import QueuedSink
from monitor.engine import Monitor, evaluate_once
from monitor.exposition import ExpositionError, parse
from monitor.rule_engine import RuleEngine
from monitor.rules import loads_rules
from monitor.scrape import Scraper, Snapshot
from tests.monitoring_io import NullSink


def values(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    snap = Snapshot()
    snap.add_text("learner", text)
    return {name: {lb: p.value for lb, p in series.items()} for name, series in snap.metrics.items()}


@pytest.mark.parametrize(("text", "line"), [
    ("streamrec_x 1 2 3\n", 1),  # extra fields after the timestamp: was read as 1
    ('streamrec_x{a="b",a="c"} 1\n', 1),  # one label twice
    ("streamrec_x 1 1.5\n", 1),  # a timestamp is whole milliseconds
    ("streamrec_x 1_000\n", 1),  # not a Go float
    ("streamrec_x 0x1p3\n", 1),  # Go's ParseFloat reads 8, Prometheus refuses the p before it (promparse.go)
    ("streamrec_x 0x10\n", 1),  # a hex float without its p exponent: Go's ParseFloat refuses it
    ("streamrec_x 1\r\n", 1),  # a carriage return is not whitespace here
    ("streamrec_x\n", 1),  # no value
    ('streamrec_x{a="b"\n', 1),  # labels not closed
    ('streamrec_x{a=b} 1\n', 1),  # label value not quoted
    ('streamrec_x{1a="b"} 1\n', 1),  # not a label name
    ("# TYPE streamrec_x gaugey\nstreamrec_x 1\n", 1),  # not a metric type
    ("# HELP #\n", 1),  # HELP without a metric name (Prometheus: expected metric name after HELP)
    ("# TYPE \n", 1),  # TYPE, a blank, and no metric name
    ("# TYPE streamrec_x gauge \nstreamrec_x 1\n", 1),  # Prometheus: invalid metric type "gauge " (was read as gauge)
])
def test_a_malformed_line_fails_the_scrape_naming_its_line(text: str, line: int) -> None:
    snap = Snapshot()
    with pytest.raises(ValueError, match=rf"\bline {line}\b"):
        snap.add_text("learner", text)
    assert snap.metrics == {} and snap.raw.get("learner", []) == []  # none of its series, not some


def test_well_formed_lines_read_as_prometheus_reads_them() -> None:
    text = ("# HELP streamrec_x A help text with \\\\ and \\n escapes.\n"
            "# TYPE streamrec_x gauge\n"
            "# any other comment\n"
            "\n"
            '  streamrec_x{a="b\\"c\\\\d\\ne",z="",}   2.5  \n'
            'streamrec_x{ a = "q" , z = "y" }1e3\n'
            "streamrec_y +Inf\n"
            "streamrec_z NaN\n"
            'streamrec_w{le="0.5"} -7\n'
            "streamrec_v{} 3\n")
    got = values(text)
    assert got["streamrec_x"] == {(("a", 'b"c\\d\ne'), ("z", "")): 2.5, (("a", "q"), ("z", "y")): 1000.0}
    assert got["streamrec_y"] == {(): math.inf}
    assert math.isnan(got["streamrec_z"][()])
    assert got["streamrec_w"] == {(("le", "0.5"),): -7.0}
    assert got["streamrec_v"] == {(): 3.0}


# -- the timestamp column ---------------------------------------------------------------------------
def test_a_sample_stamped_older_than_the_staleness_horizon_reads_as_no_data() -> None:
    snap = Snapshot()
    snap.add_text("learner", "streamrec_x 5 1700000000000\nstreamrec_y 1\n", now_s=1_800_000_000.0,
                  stale_after_s=60.0)
    assert "streamrec_x" not in snap.metrics and [s[0] for s in snap.raw["learner"]] == ["streamrec_y"]
    assert snap.stale["learner"][0] == 1 and "streamrec_x" in snap.stale["learner"][1]


def test_a_sample_stamped_within_the_horizon_is_a_current_value() -> None:
    snap = Snapshot()
    snap.add_text("learner", "streamrec_x 5 1799999970000\n", now_s=1_800_000_000.0, stale_after_s=60.0)
    assert snap.metrics["streamrec_x"][()].value == 5.0 and snap.stale == {}


def test_a_stale_timestamp_is_no_data_by_default_too() -> None:
    assert "streamrec_x" not in values("streamrec_x 5 1700000000000\n")  # Nov 2023: long past any horizon


def test_the_monitor_reads_stale_samples_as_no_data_and_says_so_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    wall = [1_800_000_000.0]
    stamp = int((wall[0] - 600) * 1000)  # ten minutes old: older than scrape_error_hold_s = 60 (+ timeout 5)
    monkeypatch.setattr(Scraper, "fetch", lambda self, url: f'streamrec_lag{{p="0"}} 9 {stamp}\n')
    config = loads_rules('interval_s = 1\nscrape_error_hold_s = 60\n[sources]\nlearner = "http://127.0.0.1:1/m"\n'
                         '[sinks]\nlog = false\n[[rule]]\nname = "lag"\nexpr = "streamrec_lag"\nop = ">"\n'
                         "threshold = 0\n")
    mon = Monitor(config, QueuedSink(NullSink(), config.sinks), clock=lambda: wall[0])
    try:
        with caplog.at_level(logging.WARNING, logger="streamrec.monitor"):
            for _ in range(3):
                assert mon.step() == []
                wall[0] += 1
        said = [r.message for r in caplog.records if "older than" in r.message]
        assert len(said) == 1 and "learner" in said[0] and "streamrec_lag" in said[0], said
        assert [s.value for s in mon.engine.status()] == [None]  # no data, not the stale 9
        assert mon.scrape_errors == {}  # the source answered: stale samples are no data, not a failed scrape
    finally:
        mon.close(0)


def test_a_sources_stale_samples_are_counted_from_0(monkeypatch: pytest.MonkeyPatch) -> None:
    # only logged before: no rule on the monitor's own metrics could see a target exporting what it saw long ago
    wall = 1_800_000_000.0
    monkeypatch.setattr(Scraper, "fetch", lambda self, url: f"streamrec_x 5 {int((wall - 600) * 1000)}\n"
                        f"streamrec_y 7 {int((wall - 600) * 1000)}\nstreamrec_z 1\n")
    source = {"source": "rv_stale_counted"}
    scraper = Scraper({"rv_stale_counted": "http://127.0.0.1:1/m"}, stale_after_s=300, clock=lambda: wall)
    assert REGISTRY.get_sample_value("streamrec_monitor_stale_samples_total", source) == 0
    scraper.scrape()
    assert REGISTRY.get_sample_value("streamrec_monitor_stale_samples_total", source) == 2


def stale_text(engine: RuleEngine, texts: list[str], wall: float = 1_800_000_000.0) -> list[str]:
    """The messages of ``engine``'s alerts over one evaluation (15 s apart) per text of source learner."""
    said = []
    for i, text in enumerate(texts):
        snap = Snapshot()
        snap.add_text("learner", text, now_s=wall + 15 * i, stale_after_s=300)
        said += [a.message for a in engine.evaluate(snap, 15.0 * i, wall + 15 * i)]
    return said


def test_an_alert_resolved_for_want_of_data_says_its_source_exported_stale_samples() -> None:
    rules = loads_rules('[[rule]]\nname = "lag"\nexpr = "streamrec_lag"\nop = ">"\nthreshold = 0\n').rules
    old = int((1_800_000_000.0 - 600) * 1000)
    said = stale_text(RuleEngine(rules), ["streamrec_lag 9\n", f"streamrec_lag 9 {old}\n"])
    assert said == ["lag: streamrec_lag > 0 held (value 9)",
                    "lag: streamrec_lag > 0 no longer holds (no data (stale samples from source learner))"]


def test_an_absence_alert_says_its_source_exported_stale_samples() -> None:
    rules = loads_rules('[[rule]]\nname = "lag"\nexpr = "streamrec_lag"\nop = ">"\nthreshold = 0\n'
                        "absent_for_s = 15\n").rules
    old = int((1_800_000_000.0 - 600) * 1000)
    said = stale_text(RuleEngine(rules), [f"streamrec_lag 9 {old}\n"] * 2)
    assert said == ["lag: no data for streamrec_lag for 15s (stale samples from source learner)"]


# -- one series, one line -----------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "streamrec_x 5\nstreamrec_x 7\n",  # was read as 5, no warning
    'streamrec_x{a="1",b="2"} 5\nstreamrec_y 1\nstreamrec_x{b="2",a="1"} 7\n',  # the same labels in another order
])
def test_a_series_given_twice_by_one_source_fails_the_scrape_naming_it(text: str) -> None:
    snap = Snapshot()
    with pytest.raises(ValueError, match=r"streamrec_x\{.*\}.* twice"):
        snap.add_text("learner", text)
    assert snap.metrics == {} and snap.raw.get("learner", []) == []


_HUGE = "x" * 1_000_000  # a scrape may answer 16 MiB


@pytest.mark.parametrize("text", [
    f'm{{a="{_HUGE}"}} 1\nm{{a="{_HUGE}"}} 2\n',  # was quoted whole: a megabyte at every failed scrape
    'm{a="1\\nscrape of source learner failed: FORGED\x1b[2J"} 1\n' * 2,  # was quoted unescaped: a line
    # break (the exposition's \\n) began a forged log line, and the terminal took the escape sequence
    f"# TYPE m{_HUGE} gauges\n",
    f"# HELP m{_HUGE} \udcff\n",
    f'm{{a{_HUGE}="\udcff"}} 1\n',
])
def test_a_failed_scrapes_message_quotes_the_answer_cut_short_and_escaped(text: str) -> None:
    with pytest.raises(ExpositionError) as failed:
        parse(text)
    said = str(failed.value)
    assert len(said) < 600 and "\n" not in said and "\x1b" not in said, said[:300]


def test_the_same_name_with_other_labels_is_another_series() -> None:
    assert values('streamrec_x{a="1"} 5\nstreamrec_x{a="2"} 7\nstreamrec_x 1\n') == {
        "streamrec_x": {(("a", "1"),): 5.0, (("a", "2"),): 7.0, (): 1.0}}


# -- cost: one garbled line must not stall the monitor's loop ------------------------------------------
_BLANKS = " \t" * 500_000  # a million blanks; a scrape may answer 16 MiB, so one line may hold 16 times more


@pytest.mark.parametrize("line", [
    'streamrec_x{a="b"' + _BLANKS + "x",  # blanks after a label, then no '}'
    "streamrec_x{" + _BLANKS + "x",  # blanks after '{', then no label
    'streamrec_x{a="b"' + _BLANKS + "," + _BLANKS + "x",  # blanks around a trailing comma
    "streamrec_x" + _BLANKS + "{" + _BLANKS + "x",  # blanks before and after '{'
    "# HELP" + _BLANKS + "!",  # a HELP whose metric name is not one
    "# TYPE" + _BLANKS + "!",
])
def test_a_garbled_line_of_many_blanks_fails_the_scrape_without_backtracking_over_them(line: str) -> None:
    # two whitespace runs of the line's regex could share one run of blanks: each way of splitting it was tried
    # before the line failed, quadratic in its length (16,000 blanks took ~1 s, 200,000 ~100 s, a million ~40 min),
    # and the loop that scrapes every source and evaluates every rule waited on it. Before the fix this test did not
    # finish; after it, each line fails at once, naming line 2, like any other malformed line.
    snap = Snapshot()
    with pytest.raises(ValueError, match=r"\bline 2\b"):
        snap.add_text("learner", "streamrec_ok 1\n" + line + "\n")
    assert snap.metrics == {}


# -- line ends -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "streamrec_x 1\r\n",  # a sample
    'streamrec_x{a="b"} 1 1700000000000\r\n',  # with labels and a timestamp
    "# TYPE streamrec_x gauge\r\nstreamrec_x 1\r\n",  # the first sample after a comment line
    "streamrec_ok 1\n\r\n",  # a blank line
])
def test_a_crlf_line_end_is_refused_as_prometheus_refuses_it_saying_so(text: str) -> None:
    # Prometheus' lexer reads "1\r" as the value ("strconv.ParseFloat: parsing \"1\\r\": invalid syntax") and its
    # maintainers declined \r support (prometheus/common#132; OpenMetrics: lines MUST NOT contain \r): the monitor
    # refuses the same answers, but says why instead of "not a sample"
    with pytest.raises(ValueError, match=r"ends with \\r\\n .*Windows.*\\n only"):
        Snapshot().add_text("learner", text)


def test_a_comment_line_ending_in_cr_is_read_as_prometheus_reads_it() -> None:
    # Prometheus' scrape parser (model/textparse/promlex.l) reads a comment, and a HELP line's text, up to the \n
    # ("[^\n]*"): a \r before it is part of the comment or the help text, not an error. The monitor refused these
    # answers ("ends with \r\n"), so a scrape Prometheus read was a failed scrape here.
    text = ("# HELP streamrec_x A help text.\r\n"  # help text "A help text.\r"
            "# HELP streamrec_y\r\n"  # help text "" (the character after the name is dropped, as Prometheus does)
            "# any other comment\r\n"
            "#\r\n"
            "streamrec_x 1\n")
    declared: set[str] = set()
    assert parse(text, declared) == [("streamrec_x", (), 1.0, None)]
    assert declared == {"streamrec_x", "streamrec_y"}


@pytest.mark.parametrize(("value", "read"), [
    ("\\q", "\\q"),  # no escape Prometheus knows: kept as written, backslash and all
    ("\\\\q", "\\q"),  # an escaped backslash, then q
    ("a\\.b\\tc", "a\\.b\\tc"),
    ("\\n\\\\\\\"", '\n\\"'),  # the three escapes it unescapes: \n, \\, \"
])
def test_a_label_value_escape_is_read_as_the_prometheus_server_reads_it(value: str, read: str) -> None:
    # Prometheus' scrape parser lexes a label value as "(\\.|[^\\"])*" (any backslash pair) and unescapes only
    # \", \\ and \n (promparse.go lvalReplacer), keeping any other pair as written; the monitor refused \q,
    # failing a scrape the server reads (expfmt's TextParser refuses it, but the monitor matches the server)
    assert parse(f'streamrec_x{{a="{value}"}} 1\n') == [("streamrec_x", (("a", read),), 1.0, None)]


@pytest.mark.parametrize("text", [
    "# HELP streamrec_x One.\n# HELP streamrec_x Two.\nstreamrec_x 1\n",  # a second HELP for the family
    "# TYPE streamrec_x gauge\n# TYPE streamrec_x counter\nstreamrec_x 1\n",  # a second TYPE
    "streamrec_x 1\n# TYPE streamrec_x gauge\n",  # a TYPE after the family's samples
    "# HELP streamrec_x A bad \\x escape and a \\\" kept.\nstreamrec_x 1\n",  # a HELP escape other than \\ and \n
])
def test_metadata_lines_the_prometheus_server_reads_are_read(text: str) -> None:
    # the server's parser is stateless per line (promparse.go) and its scrape cache keeps the last HELP and TYPE of a
    # family (scrape.go setHelp/setType); its helpReplacer unescapes only \\ and \n, keeping \x as written. expfmt's
    # TextParser refuses all four ("second HELP line", "second TYPE line ... or TYPE reported after samples",
    # "invalid escape sequence"); the monitor follows the server and reads the samples
    declared: set[str] = set()
    assert parse(text, declared) == [("streamrec_x", (), 1.0, None)] and declared == {"streamrec_x"}


@pytest.mark.parametrize(("text", "name"), [
    ('{"my.metric", le="1"} 3\n', '"my.metric"'),  # a quoted metric name inside the braces (Prometheus 3)
    ('{"my.metric"} 3\n', '"my.metric"'),
    ('streamrec_x{a="b", "my.label"="c"} 1\n', '"my.label"'),  # a quoted label name
    ('# HELP "my.metric" A help text.\n', '"my.metric"'),
    ('# TYPE "my.metric" gauge\n', '"my.metric"'),
])
def test_a_quoted_utf8_name_is_refused_saying_the_monitor_reads_plain_names_only(text: str, name: str) -> None:
    # Prometheus 3 reads quoted UTF-8 metric and label names; the monitor watches streamrec's own metrics, whose
    # names are plain, and refuses them: it said "not a sample" or "# HELP without a metric name", which sent the
    # operator looking for a garbled line rather than an exporter writing UTF-8 names
    with pytest.raises(ExpositionError, match=rf"line 1: .*quoted.*{re.escape(name)}.*plain"):
        parse(text)


@pytest.mark.parametrize("text", ["# HELP\n", "# TYPE\n", "# HELP\r\n", "#\tTYPE\r\n", "# HELP:x y\n"])
def test_help_or_type_without_a_blank_after_it_is_a_plain_comment_as_prometheus_reads_it(text: str) -> None:
    # Prometheus' lexer takes "HELP[\t ]+" / "TYPE[\t ]+" as the keyword and anything else as a comment; the monitor
    # refused these lines ("# HELP without a metric name"), failing a scrape Prometheus reads
    declared: set[str] = set()
    assert parse(text + "streamrec_x 1\n", declared) == [("streamrec_x", (), 1.0, None)] and declared == set()


@pytest.mark.parametrize("text", [
    "# TYPE streamrec_x gauge\r\n",  # Prometheus: invalid metric type "gauge\r"
    "# TYPE streamrec_x\r\n",  # invalid metric type ""
])
def test_a_type_line_ending_in_cr_is_refused_as_prometheus_refuses_it_saying_why(text: str) -> None:
    with pytest.raises(ExpositionError, match=r"line 1 ends with \\r\\n .*Windows.*\\n only"):
        parse(text)


@pytest.mark.parametrize(("text", "read", "declared"), [
    ("streamrec_x 1", [("streamrec_x", (), 1.0, None)], set()),
    ("streamrec_x 1 1700000000000", [("streamrec_x", (), 1.0, 1700000000000)], set()),
    ("# HELP streamrec_x A help text.", [], {"streamrec_x"}),
    ("# TYPE streamrec_x gauge", [], {"streamrec_x"}),
    ("# any other comment", [], set()),
])
def test_parse_reads_a_last_line_without_a_newline_as_the_prometheus_server_reads_it(
        text: str, read: list[object], declared: set[str]) -> None:
    # promparse.go's NewPromParser appends a \n to the answer, so the server reads a last line of every kind without
    # one (expfmt's TextParser refuses it: "unexpected end of input stream"); the monitor's refusal of such an answer
    # is the scraper's, for its own reason (a target that died mid-answer: Scraper below), not the format's
    got: set[str] = set()
    assert parse(text, got) == read and got == declared


def test_an_answer_whose_last_line_has_no_newline_fails_the_scrape_naming_that_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Scraper, "fetch", lambda self, url: "# TYPE streamrec_lag gauge\nstreamrec_lag 12")
    errors = Scraper({"learner": "http://127.0.0.1:1/metrics"}).scrape().errors
    assert re.search(r"cut off: its last line, line 2 \('streamrec_lag 12'\), does not end with a newline",
                     errors["learner"]), errors


# -- the staleness horizon of a timestamped sample --------------------------------------------------------
def _scrape_stamped(monkeypatch: pytest.MonkeyPatch, age_s: float, settings: str = "") -> Snapshot:
    now = 1_800_000_000.0
    monkeypatch.setattr(Scraper, "fetch", lambda self, url: f"streamrec_lag 9 {int((now - age_s) * 1000)}\n")
    config = loads_rules(f'{settings}\n[sources]\nfederate = "http://127.0.0.1:1/federate"\n')
    return Scraper.of(config, clock=lambda: now).scrape()


def test_a_federated_sample_stamped_30s_ago_is_current_even_with_no_scrape_error_hold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # /federate stamps each sample with its original scrape time, often 15 to 60 s old: with scrape_error_hold_s = 0
    # the horizon was 0 + scrape_timeout_s = 5 s and every federated series read as no data. Prometheus' lookback
    # for a timestamped sample is 5 minutes, and so is the monitor's default sample_max_age_s.
    snap = _scrape_stamped(monkeypatch, 30, "scrape_error_hold_s = 0")
    assert snap.metrics["streamrec_lag"][()].value == 9.0 and snap.stale == {}
    assert "streamrec_lag" not in _scrape_stamped(monkeypatch, 301, "scrape_error_hold_s = 0").metrics


def test_sample_max_age_s_of_the_rules_file_sets_the_staleness_horizon(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "streamrec_lag" in _scrape_stamped(monkeypatch, 50, "sample_max_age_s = 60").metrics
    snap = _scrape_stamped(monkeypatch, 70, "sample_max_age_s = 60")
    assert "streamrec_lag" not in snap.metrics and "older than 60s" in snap.stale["federate"][1]


def test_a_sample_stamped_beyond_the_clock_skew_tolerated_in_the_future_is_no_data_saying_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a source whose clock runs a minute ahead (or that stamps garbage) was read as current: Prometheus refuses such
    # samples as "out of bounds". A few seconds ahead is clock skew (and the time the answer took) and is read.
    snap = _scrape_stamped(monkeypatch, -60)
    assert "streamrec_lag" not in snap.metrics
    assert snap.stale["federate"][0] == 1 and "60s in the future" in snap.stale["federate"][1]
    assert _scrape_stamped(monkeypatch, -3).metrics["streamrec_lag"][()].value == 9.0


def test_a_sample_stamped_before_the_last_one_read_of_its_series_is_no_counter_reset() -> None:
    # two federating Prometheus replicas behind one URL answer in turn, each with the counter as it last scraped it:
    # the second answer is an older sample (49, stamped 5 s before the 50). Read as the next one it was a reset, an
    # increase() of 49 and a critical alert; Prometheus drops such a sample (out of order)
    engine = RuleEngine.of(loads_rules('[[rule]]\nname = "nan_losses"\nexpr = "increase(nan_total[5m])"\n'
                                       'op = ">"\nthreshold = 0\n'))
    now, stamp = 1_800_000_000.0, 1_799_999_970_000
    for i, (value, ms) in enumerate([(50, stamp), (49, stamp - 5000), (50, stamp + 15000), (50, stamp + 30000)]):
        snap = Snapshot()
        snap.add_text("federate", f"nan_total {value} {ms}\n", now_s=now + 15 * i)
        assert engine.evaluate(snap, 15.0 * i) == []


def _once_stamped(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, age_s: float) -> list[str]:
    """What `monitor --once` warns of a rule on ``streamrec_lag``, its one source stamping it ``age_s`` ago."""
    now = time.time()
    monkeypatch.setattr(Scraper, "fetch", lambda self, url: f"streamrec_lag 9 {int((now - age_s) * 1000)}\n")
    config = loads_rules('[sources]\nfederate = "http://127.0.0.1:1/federate"\n[[rule]]\nname = "lag"\n'
                         'expr = "streamrec_lag"\nop = ">"\nthreshold = 0\n')
    with caplog.at_level(logging.WARNING, logger="streamrec.monitor"):
        evaluate_once(config)
    return [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("age_s", [400, -60])  # too old, too far ahead
def test_monitor_once_says_why_a_stamped_sample_is_no_data_as_the_daemon_does(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, age_s: float) -> None:
    # `streamrec monitor --once` showed the rule reading it as "no data" in silence: the daemon logs the stale or
    # future-stamped samples of a source, the check a user runs to try a rules file said nothing
    said = [m for m in _once_stamped(monkeypatch, caplog, age_s) if "too old or too far ahead" in m]
    assert len(said) == 1 and "source federate: 1 sample(s)" in said[0], said


def test_a_metric_whose_samples_are_all_stale_is_not_warned_of_as_exported_by_no_source(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # the source exports streamrec_lag, stamped 400 s ago: the rule has no data, and the stale warning says why; the
    # unexported-metric warning also said "no source has exported" it ("a misspelt metric?"), which is false
    assert not [m for m in _once_stamped(monkeypatch, caplog, 400) if "no source has exported" in m]


# -- bytes that are not UTF-8 (the scraper hands the parser undecodable bytes as \udc80-\udcff) ------------
def _scraped(answer: bytes) -> str:
    return answer.decode("utf-8", "surrogateescape")  # what monitor.http_deadline.get_text returns


@pytest.mark.parametrize(("answer", "line"), [
    (b'streamrec_x{a="\xff"} 1\n', 1),  # promparse.go: invalid UTF-8 label value (was read as a="\ufffd")
    (b'streamrec_y 1\nstreamrec_x{a="ok",b="caf\xc3"} 1\n', 2),  # a UTF-8 sequence cut short
    (b'streamrec_x{a="\xed\xa0\x80"} 1\n', 1),  # an encoded surrogate: Go's utf8.Valid refuses it too
    (b"# HELP streamrec_x a help text \xff\nstreamrec_x 1\n", 1),  # help text is not a valid utf8 string
    # the server's help text starts one *byte* after the name: the rest of a two-byte character is not UTF-8
    (b"# HELP streamrec_x\xc3\xa9 text\n", 1),
])
def test_a_label_value_or_help_text_that_is_not_utf8_fails_the_scrape_naming_its_line(answer: bytes,
                                                                                        line: int) -> None:
    snap = Snapshot()
    with pytest.raises(ValueError, match=rf"^line {line}: .*not valid UTF-8"):
        snap.add_text("learner", _scraped(answer))
    assert snap.metrics == {} and snap.raw.get("learner", []) == []


def test_bytes_that_are_not_utf8_in_a_plain_comment_are_read_past_as_prometheus_reads_them() -> None:
    answer = (b"# a comment with \xff in it\n"  # promparse.go checks only HELP text and label values
              b"# HELP streamrec_x\xfftext\n"  # its help text is "text": the one byte after the name is dropped
              b'# HELP streamrec_y caf\xc3\xa9\nstreamrec_y{a="caf\xc3\xa9"} 2\n')
    assert parse(_scraped(answer)) == [("streamrec_y", (("a", "caf\u00e9"),), 2.0, None)]


# -- a raw newline inside a quoted label value ---------------------------------------------------------------
def test_a_raw_newline_inside_a_label_value_is_refused_saying_why_the_monitor_differs_from_prometheus() -> None:
    # promlex.l's label value is "(\\.|[^\\"])*": a raw newline is part of it, and the server reads a="x\ny".
    # The monitor splits lines on \n first, so it refuses this (as expfmt's TextParser does), and says so.
    snap = Snapshot()
    with pytest.raises(ValueError, match=r"^line 2: .*raw newline inside the quoted value of label a\b.*README"):
        snap.add_text("learner", 'streamrec_y 1\nstreamrec_x{a="x\ny"} 1\n')
    assert snap.metrics == {}


@pytest.mark.parametrize("text", ['streamrec_x{a="x\x00y"} 1\n', 'streamrec_x{a="x\\\x00"} 1\n'])
def test_a_nul_byte_in_a_label_value_fails_the_scrape_as_prometheus_refuses_it(text: str) -> None:
    # promlex.l.go's label value takes any byte from \x01 (and after a backslash any but \n): \x00 ends the token
    snap = Snapshot()
    with pytest.raises(ValueError, match=r"^line 1: "):
        snap.add_text("learner", text)
    assert snap.metrics == {}  # was read as a="x\x00y"


@pytest.mark.parametrize("value", ["١", "１", "𝟏", "1٠", "+NaN", "-nan"])
def test_a_value_go_does_not_read_fails_the_scrape_though_python_float_reads_it(value: str) -> None:
    # Python's float() reads any Unicode decimal digit ("١" is 1.0) and a signed NaN; Go's ParseFloat, and so the
    # Prometheus server, refuses them: the scrape was read with a value Prometheus never sees
    snap = Snapshot()
    with pytest.raises(ValueError, match=r"\bline 2\b.*not a number"):
        snap.add_text("learner", f"streamrec_y 1\nstreamrec_x {value}\n")
    assert snap.metrics == {}


@pytest.mark.parametrize("ts", ["9223372036854775808", "-9223372036854775809", "1" * 5000])
def test_a_timestamp_past_a_64_bit_integer_fails_the_scrape_naming_its_line(ts: str) -> None:
    # Prometheus reads it with ParseInt(ts, 10, 64) and refuses the scrape; here one of 20 digits was read (a stale
    # sample), and one of 5,000 raised int()'s digit limit ("use sys.set_int_max_str_digits()"), naming no line
    with pytest.raises(ExpositionError, match=r"^line 2: timestamp .* is not a 64-bit integer"):
        parse(f"streamrec_x 1\nstreamrec_y 2 {ts}\n")


def test_the_64_bit_timestamp_bounds_are_read() -> None:
    assert [s[3] for s in parse("a 1 9223372036854775807\nb 1 -9223372036854775808\n")] == [2**63 - 1, -2**63]


def test_a_timestamp_with_thousands_of_leading_zeros_is_read_as_its_value() -> None:
    # Go's ParseInt reads leading zeros (the Prometheus server keeps this sample); the digit limit counts them, so
    # int() of the whole token raised its "Exceeds the limit (4300 digits)" ValueError, naming no line
    assert [s[3] for s in parse(f"a 1 {'0' * 5000}1700000000000\nb 1 -{'0' * 5000}5\n")] == [1700000000000, -5]
