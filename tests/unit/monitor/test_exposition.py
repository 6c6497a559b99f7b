"""The Prometheus text exposition format as the monitor reads it (``monitor/exposition.py``): a sample line is
``metric_name [ "{" labels "}" ] value [ timestamp ]``; anything else makes the scrape fail with the line number,
never a silently wrong value."""

from __future__ import annotations

import math

import pytest

from monitor.engine import Snapshot


def values(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    snap = Snapshot()
    snap.add_text("learner", text)
    return {name: {lb: p.value for lb, p in series.items()} for name, series in snap.metrics.items()}


@pytest.mark.parametrize(("text", "line"), [
    ("streamrec_x 1 2 3\n", 1),  # extra fields after the timestamp: was read as 1
    ('streamrec_ok 1\nstreamrec_x{a="\\q"} 1\n', 2),  # \q is no escape (only \\ \" \n): was the value \q
    ('streamrec_x{a="b",a="c"} 1\n', 1),  # one label twice
    ("streamrec_x 1 1.5\n", 1),  # a timestamp is whole milliseconds
    ("streamrec_x 1_000\n", 1),  # not a Go float
    ("streamrec_x 1\r\n", 1),  # a carriage return is not whitespace here
    ("streamrec_x\n", 1),  # no value
    ('streamrec_x{a="b"\n', 1),  # labels not closed
    ('streamrec_x{a=b} 1\n', 1),  # label value not quoted
    ('streamrec_x{1a="b"} 1\n', 1),  # not a label name
    ("# TYPE streamrec_x gaugey\nstreamrec_x 1\n", 1),  # not a metric type
    ("# HELP\n", 1),  # HELP without a metric name
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
