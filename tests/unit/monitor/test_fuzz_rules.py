"""Fuzzing the alert rules file parser (monitor.rules) and the expression parser
(monitor.expr) with Hypothesis.

The promise under test: any text, and any TOML-shaped structure, gives either rules or the module's
own error (:class:`RulesError`, :class:`ExprError`) with a message; never another exception
(RecursionError on deep nesting, OverflowError on huge numbers, KeyError, TypeError...). What parses
must also be usable: evaluating it against a scrape raises nothing the rule engine does not handle.
"""

from __future__ import annotations

import datetime as dt
import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monitor.expr import MAX_DEPTH, ExprError, Node, longest_range, metrics_of, parse
from monitor.rule_engine import MetricHistory, RuleEngine
from monitor.rules import _SINK_KEYS, RulesConfig, RulesError, loads_rules, rules_from_dict
from monitor.scrape import Snapshot

FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# -- expressions ----------------------------------------------------------------------------------
TOKENS = ["m", "streamrec_x_total", "a:b", "user_id", "sum", "max", "min", "avg", "count", "by", "without",
          "rate", "increase", "delta", "abs", "nan", "inf", "open", "(", ")", "{", "}", "[", "]", ",", "=", "!=",
          "=~", "!~", '"user_id"', '"a|b"', '"("', '"a{99999999999}"', '"\\\\"', '""', "+", "-", "*", "/", "1",
          "0", "2.5", "1e308", "1e-320", "9" * 40, "60s", "5m", "0s", "1ms", "1.5h", "9" * 40 + "d", " ", "@",
          "'", ".", "#", "\n", "\\"]

token_soup = st.lists(st.sampled_from(TOKENS), max_size=25).map("".join)
spaced_soup = st.lists(st.sampled_from(TOKENS), max_size=25).map(" ".join)
nested = st.builds(lambda wrap, n, core: wrap[0] * n + core + wrap[1] * n,
                   st.sampled_from([("(", ")"), ("-", ""), ("abs(", ")"), ("sum(", ")"), ("max by (f) (", ")"),
                                    ("- (", ")"), ("rate(", ")")]),
                   st.integers(0, 2000), st.sampled_from(["m", "1", "m[5m]", "m{f=\"x\"}"]))
chained = st.builds(lambda op, n: op.join(["m"] * n), st.sampled_from(["+", "-", "*", "/", " - -"]),
                    st.integers(1, 3000))
regexes = st.one_of(st.sampled_from(["a{99999999999}", "(" * 1500 + ")" * 1500, "(?P<a>)(?P=b)", "[z-a]", "x|y", ".*"]),
                    st.text(st.characters(blacklist_characters='"\\\n'), max_size=10))
selectors = st.builds(lambda m, lbl: m + lbl, st.sampled_from(["m", "streamrec_x_total", "user_id", "absent"]),
                      st.one_of(st.sampled_from(["", '{f="x"}', '{f!="x", g=""}']),
                                st.builds('{{f{}"{}"}}'.format, st.sampled_from(["=~", "!~"]), regexes)))
grammatical = st.recursive(
    st.one_of(selectors, st.sampled_from(["1", "0", "2.5", "1e308", "0.0"]),
              st.builds("{}({}[{}])".format, st.sampled_from(["rate", "increase", "delta"]), selectors,
                        st.sampled_from(["60s", "5m", "1ms", "2h"]))),
    lambda inner: st.one_of(
        st.builds("{} {} {}".format, inner, st.sampled_from(["+", "-", "*", "/"]), inner),
        st.builds("({})".format, inner), st.builds("-{}".format, inner), st.builds("abs({})".format, inner),
        st.builds("{}{}({})".format, st.sampled_from(["sum", "max", "min", "avg", "count"]),
                  st.sampled_from(["", " by (f)", " without (f, g)"]), inner)),
    max_leaves=12)  # expressions of the grammar, so that fuzzed rules files parse and get evaluated
expressions = st.one_of(st.text(max_size=60), token_soup, spaced_soup, nested, chained, grammatical)


def store() -> MetricHistory:
    """Two scrapes (rate() has something to work with), with NaN, Inf and a huge value."""
    h = MetricHistory(600)
    for t, v in ((0.0, 1.0), (60.0, 3.0)):
        h.record(Snapshot.from_texts({"learner": f'm{{f="x"}} {v}\nm{{f="y"}} NaN\nm 1e308\n'
                                                 f'streamrec_x_total {v * 10}\nuser_id +Inf\n'}), t)
    return h


STORE = store()


def check_usable(tree: Node) -> None:
    longest_range([tree])
    metrics_of(tree)
    repr(tree)
    try:
        value = tree.eval(STORE)
    except (ArithmeticError, ValueError):  # what RuleEngine catches: "no data" for this round
        return
    assert isinstance(value, float | dict)


@FUZZ
@given(expressions)
def test_any_expression_text_parses_or_raises_expr_error(src: str) -> None:
    try:
        tree = parse(src)
    except ExprError as exc:
        assert str(exc)
        return
    check_usable(tree)


def test_the_depth_limit_is_an_expr_error_that_says_what_to_do() -> None:
    for src in ["(" * 1000 + "1" + ")" * 1000, "-" * 5000 + "1", "+".join(["m"] * 5000),
                "abs(" * 500 + "m" + ")" * 500]:
        try:
            parse(src)
        except ExprError as exc:
            assert f"nested more than {MAX_DEPTH} levels deep" in str(exc) and "split it" in str(exc)
        else:
            raise AssertionError(f"{src[:20]}... parsed")
    check_usable(parse("(" * (MAX_DEPTH - 1) + "m" + ")" * (MAX_DEPTH - 1)))  # deep but allowed


def test_regexes_the_re_module_cannot_compile_are_expr_errors() -> None:
    for value in ["a{99999999999}", "(" * 2000 + ")" * 2000, "(", "\\\\"]:
        try:
            parse(f'm{{f=~"{value}"}}')
        except ExprError as exc:
            assert "bad regular expression" in str(exc)
        else:
            raise AssertionError(value)


# -- rules files ----------------------------------------------------------------------------------
huge_ints = st.sampled_from([2**63, -(2**63) - 1, 10**400, -(10**400), 10**4000])
scalars = st.one_of(st.text(max_size=12), st.integers(), huge_ints, st.floats(), st.booleans(),
                    st.datetimes(), st.dates(), st.times())
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def maybe(strategy: st.SearchStrategy, anything: st.SearchStrategy = values) -> st.SearchStrategy:
    """Mostly plausible values for a field, sometimes anything at all."""
    return st.sampled_from([True] * 7 + [False]).flatmap(lambda plausible: strategy if plausible else anything)


def mostly_valid(tables: st.SearchStrategy, stray_keys: list[str]) -> st.SearchStrategy:
    """``tables``, sometimes with a key removed or a stray key (a typo, a removed setting) added, so
    most documents get past the first check and reach the deeper ones."""
    def edit(d: dict, drop: int | None, stray: str | None, v: object) -> dict:
        d = dict(d)
        if drop is not None and d:
            d.pop(sorted(d)[drop % len(d)])
        if stray is not None:
            d[stray] = v
        return d
    return st.builds(edit, tables, st.sampled_from([None] * 7 + [0, 1, 2, 3]),
                     st.sampled_from([None] * 15 + stray_keys), values)


names = maybe(st.from_regex(r"[A-Za-z_][A-Za-z0-9_.:-]{0,12}", fullmatch=True))
numbers = st.one_of(st.integers(-5, 1000), st.floats(0, 1e6), st.integers(0, 100), st.floats(), huge_ints, values)
urls = st.one_of(st.just("http://127.0.0.1:9102/metrics"), st.just("https://[::1]:8080/hook"),
                 st.sampled_from(["http://[::1", "http://h:99999/", "http://", "ftp://x", "http://:80/x"]),
                 st.text(max_size=20).map(lambda t: "http://" + t), values)
rule_tables = mostly_valid(st.fixed_dictionaries({
    "name": names,
    "expr": maybe(grammatical, st.one_of(expressions, values)),
    "op": maybe(st.sampled_from([">", ">=", "<", "<=", "==", "!=", "isnan", "=>"])),
    "threshold": numbers,
}, optional={
    "for_s": numbers,
    "severity": maybe(st.sampled_from(["info", "warning", "critical", "urgent"])),
    "description": maybe(st.text(max_size=10)),
    "labels": maybe(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3)),
    "absent_for_s": numbers,
}), ["threshhold", "rule"])
sink_tables = mostly_valid(st.fixed_dictionaries({}, optional={
    **{k: numbers for k in _SINK_KEYS},
    "log": maybe(st.booleans()),
    "kafka_topic": maybe(st.sampled_from(["alerts", "", "bad topic", "a" * 300])),
    "webhook_url": urls,
    "queue_size": maybe(st.integers(-2, 20_000_000)),
}), ["webhook_retries", "webhook_backoff_s", "kafka"])
documents = mostly_valid(st.fixed_dictionaries({}, optional={
    "interval_s": numbers,
    "scrape_timeout_s": numbers,
    "scrape_error_hold_s": numbers,
    "state_path": maybe(st.text(max_size=8)),
    "sources": maybe(st.dictionaries(st.text(max_size=8), urls, max_size=3)),
    "sinks": maybe(sink_tables),
    "rule": maybe(st.lists(maybe(rule_tables), max_size=3)),
}), ["rules", "interval"])


def toml_value(v: object) -> str:
    """``v`` in TOML (inline tables and arrays), as near as TOML allows; what it cannot say is still
    text to parse (and to fail on with a RulesError)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v) if abs(v) < 10**4000 else "9" * 4400  # more digits than int() reads by default
    if isinstance(v, float):
        return "nan" if math.isnan(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, dt.date | dt.time):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise AssertionError(type(v))


def check_config(cfg: RulesConfig) -> None:
    engine = RuleEngine(cfg.rules, cfg.history_s)
    for t in (0.0, 60.0):
        engine.evaluate(STORE.snapshot, t)
    engine.status()


def outcome(fn, *args) -> RulesConfig | None:
    try:
        cfg = fn(*args)
    except RulesError as exc:
        assert str(exc).startswith("alert rules file ")
        return None
    check_config(cfg)
    return cfg


@FUZZ
@given(documents)
def test_any_toml_structure_gives_rules_or_a_rules_error(data: dict) -> None:
    from_dict = outcome(rules_from_dict, data, "fuzz.toml")
    text = "\n".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in data.items())
    from_text = outcome(loads_rules, text, "fuzz.toml")
    if from_text is not None:  # the same document through TOML text gives the same rules
        assert from_dict is not None and [r.name for r in from_text.rules] == [r.name for r in from_dict.rules]


toml_soup = st.lists(st.sampled_from(["[[rule]]", "[sinks]", "[sources]", "[rule]", "name", "expr", "op", "=", " ",
                                      "\n", '"x"', "'m'", "1", "1e999", "inf", "nan", "-", "[", "]", "{", "}", ",",
                                      "threshold", "for_s", "labels", "queue_size", "interval_s", "true",
                                      '">"', "1979-05-27", "9" * 30, "9" * 4400, "[" * 1000, "{a=" * 500, "#",
                                      ".", '"""']), max_size=40).map("".join)


@FUZZ
@given(st.one_of(st.text(max_size=200), toml_soup))
def test_any_text_gives_rules_or_a_rules_error(text: str) -> None:
    outcome(loads_rules, text, "fuzz.toml")


def test_deeply_nested_toml_and_huge_numbers_are_rules_errors() -> None:
    rule = '[[rule]]\nname = "r"\nexpr = "m"\nop = ">"\n'
    for text, expected in [
        ("x = " + "[" * 5000 + "]" * 5000, "nested too deeply"),
        ("x = " + "{a = " * 2000 + "1" + "}" * 2000, "nested too deeply"),
        (rule + "threshold = " + "9" * 400, 'field "threshold": 9999'),
        ("interval_s = " + "9" * 400, "is too large for a number"),
        ("interval_s = inf", 'field "interval_s": expected a finite number, got inf'),
        # loaded, then the first wait and close() raised OverflowError (timestamp out of range)
        ("interval_s = 1e10", 'field "interval_s": expected at most 31536000 (seconds: a year), got 10000000000.0'),
        ("[sinks]\nclose_timeout_s = 1e10", 'field "close_timeout_s": expected at most 31536000'),
        (rule + "threshold = 1\nfor_s = nan", 'field "for_s": expected a finite number, got nan'),
        (rule + f"threshold = 1\nlabels = {{ a = {'[' * 3000}{']' * 3000} }}", "nested too deeply"),
        (rule + f'threshold = 1\nlabels = {{ a = [{", ".join(["[[1]]"] * 3)}] }}', 'field "labels": expected'),
        ('[[rule]]\nname = "r"\nop = ">"\nthreshold = 1\nexpr = "' + "(" * 200 + 'm"', "nested more than 64 levels"),
        ("x = " + "9" * 4400, "not usable TOML: a number too long to read"),
        ('[sources]\nx = "http://[::1/metrics"', 'field "x": Invalid IPv6 URL'),
    ]:
        try:
            loads_rules(text, "r.toml")
        except RulesError as exc:
            assert expected in str(exc), (expected, str(exc)[:300])
            assert len(str(exc)) < 1000, "the message quotes a bounded part of the value"
        else:
            raise AssertionError(text[:40])


def test_a_plain_python_structure_that_is_not_toml_is_a_rules_error_too() -> None:
    for data in [[], "rules", {"rule": [{"name": "r", "expr": "m", "op": ">", "threshold": object()}]},
                 {"sinks": {"queue_size": 2**70}}, {"rule": [{"name": "r", "expr": 5, "op": ">"}]},
                 {"sources": {"a": "http://h/" + "x" * 10_000}}]:
        try:
            rules_from_dict(data)  # type: ignore[arg-type]
        except RulesError as exc:
            assert str(exc)




def test_a_long_bad_value_in_a_rules_file_is_quoted_cut_saying_how_much_was_left_out() -> None:
    text = f'[[rule]]\nname = "r"\nexpr = "m"\nop = "{"x" * 5000}"\nthreshold = 1\n'
    try:
        loads_rules(text, "r.toml")
    except RulesError as exc:
        said = str(exc)
    else:
        raise AssertionError("an op of 5000 x's was read")
    assert '"' + "x" * 119 + "... (4,882 more chars)" in said and said.isprintable(), said  # "...": how much?
    assert len(said) < 400, said
