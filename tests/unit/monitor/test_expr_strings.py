"""A label matcher's value is a PromQL double-quoted string, unescaped as Prometheus does (Go's strconv.Unquote):
``\\\\``, ``\\"``, ``\\n`` and Go's other escapes are characters, an unknown escape (``\\.``, ``\\d``) is an error
naming it, never a backslash silently dropped (``=~"10\\.0\\.0\\.1"`` matched ``10a0b0c1``)."""

from __future__ import annotations

import pytest

from monitor.expr import ExprError, parse
from monitor.rule_engine import MetricHistory
from monitor.rules import RulesError, loads_rules
from monitor.scrape import Snapshot

SCRAPE = 'm{ip="10a0b0c1"} 1\nm{ip="10.0.0.1"} 2\nm{msg="a\\nb"} 3\nm{msg="tab\there \\"q\\" \\\\ é"} 4\n'


def values(expr: str) -> list[float]:
    store = MetricHistory(0)
    store.record(Snapshot.from_texts({"s": SCRAPE}), 0.0)
    got = parse(expr).eval(store)
    assert isinstance(got, dict)
    return sorted(p.value for p in got.values())


def test_a_doubled_backslash_in_a_regex_matcher_is_one_backslash_of_the_regex() -> None:
    assert values(r'm{ip=~"10\\.0\\.0\\.1"}') == [2.0]


@pytest.mark.parametrize("expr", [r'm{ip=~"10\.0\.0\.1"}', r'm{ip=~"\d+"}', r'm{ip="\q"}', r'm{ip="\x4"}',
                                  r'm{ip="\400"}', r'm{ip="\ud800"}', r'm{ip="\xff"}', r"m{ip='x'}"])
def test_an_escape_promql_does_not_know_is_an_error_not_a_dropped_backslash(expr: str) -> None:
    with pytest.raises(ExprError):
        parse(expr)


def test_an_unknown_escape_in_a_rules_file_is_refused_naming_the_rule() -> None:
    text = "[[rule]]\nname = \"ip\"\nexpr = 'm{ip=~\"10\\.0\\.0\\.1\"}'\nop = \">\"\nthreshold = 0\n"
    with pytest.raises(RulesError, match=r'rule "ip".*escape'):
        loads_rules(text)


def test_go_escapes_match_the_label_values_they_stand_for() -> None:
    assert values(r'm{msg="a\nb"}') == [3.0]  # the exposition's \n is a newline; so is PromQL's
    assert values(r'm{msg="tab\there \"q\" \\ \u00e9"}') == [4.0]
    assert values(r'm{msg="tab\x09here \042q\042 \\ \xc3\xa9"}') == [4.0]  # hex and octal bytes, UTF-8 é
    assert values(r'm{msg="tab\there \"q\" \\ \U000000e9"}') == [4.0]


def test_a_raw_line_break_inside_a_quoted_value_is_an_unterminated_string_as_in_promql() -> None:
    # PromQL's lexer ends a quoted string at a line break ("unterminated quoted string"); it was read as "a\nb"
    with pytest.raises(ExprError, match="unterminated quoted string"):
        parse('m{msg="a\nb"}')
    assert values('m{msg="a\\nb"}') == [3.0]  # the escape is the way to write it


@pytest.mark.parametrize("rng", ["1000d", "366d", "8761h", "31536001s"])
def test_a_range_over_a_year_is_refused_as_every_other_duration_of_the_rules(rng: str) -> None:
    """The rates' history keeps every sample of a ranged series for its longest range: ``rate(m[1000d])`` loaded and
    the monitor's memory grew by a sample per series per scrape for ever; a year is the bound of every other duration
    (``monitor.rules``), and a range at it still loads."""
    with pytest.raises(ExprError, match=r"too long, at column \d+: at most a year"):
        parse(f"rate(m[{rng}])")
    assert list(parse("rate(m[365d])").ranges()) == list(parse("increase(m[31536000s])").ranges()) == [365 * 86_400.0]
