"""A label regex of a rule runs on every scraped label value, every interval, in Python's backtracking ``re`` (no
timeout): a repeat nested in a repeat, ``(a+)+b``, takes time exponential in the value's length on a value that
almost matches, and so does an alternation under a repeat whose branches overlap, ``(a|aa)+b``. Such a regex is
refused when the rules file loads, naming the rule; ordinary ones load."""

from __future__ import annotations

import re

import pytest

from monitor.rules import RulesError, loads_rules


def rule(regex: str) -> str:
    return f"[[rule]]\nname = \"slow\"\nexpr = 'streamrec_x{{path=~\"{regex}\"}}'\nop = \">\"\nthreshold = 0\n"


@pytest.mark.parametrize("regex", ["(a+)+b", "(a*)*b", "(?:x|a+)*b", "((ab)*c)+", "(a?){2,}b", "(a|b+){3,9}"])
def test_a_regex_with_a_repeat_inside_a_repeat_is_refused_at_load_naming_the_rule(regex: str) -> None:
    # before: it loaded, and each more 'a' in a label value with no b doubled (a+)+b's time (22 a's: 0.7 s here)
    with pytest.raises(RulesError, match=r'rule "slow".*repeat inside a repeat'):
        loads_rules(rule(regex))


@pytest.mark.parametrize("regex", [".*(foo|bar).*", "a+b", "(ab){2}", "(a{3})+", "(a+)?b", "(a++)+b", "[a-z]*x"])
def test_regexes_without_a_repeat_inside_a_repeat_load(regex: str) -> None:
    assert loads_rules(rule(regex)).rules[0].name == "slow"


# An alternation under a repeat whose branches can begin the same way, or one of which can match nothing, may let the
# repeat split the same run of characters among the branches in exponentially many ways, all tried before a value
# that almost matches fails: (a|aa)+b, (a|a)*c, (.|a)*b on 'a' * 30 + '!' (the class is documented, not timed here).
# The check is on first characters, so it is conservative: (x|y|xz)+ is refused though xz never splits a run of x.
@pytest.mark.parametrize("regex", ["(a|aa)+b", "(a|a)*c", "(ab|a)*(b|ab)*$", "(x|y|xz)+", "(?:ab|)+c", "(a|b|)*c",
                                   "(.|a)*b", "([0-9]|1x)+y", "(?i)(ab|Ac)+d", "(b(a|aa))+c"])
def test_a_repeat_over_an_alternation_whose_branches_overlap_is_refused_naming_the_pattern(regex: str) -> None:
    with pytest.raises(RulesError, match=r'rule "slow".*' + re.escape(repr(regex)) + r".*alternation.*repeat"):
        loads_rules(rule(regex))


@pytest.mark.parametrize("regex", ["(get|post)+", "[a-z]+", "(foo|bar)_total", "^(foo|bar)$", "(foo|bar|baz)",
                                   "(ab|cd)*e", "(a|b)+", "([0-9]|x)+", "(a|aa)b", "(a|aa)?b", "(?:a|bc)+$",
                                   "(a|aa)++b"])
def test_a_repeat_over_an_alternation_whose_branches_begin_apart_loads(regex: str) -> None:
    assert loads_rules(rule(regex)).rules[0].name == "slow"


def test_branches_that_match_each_other_only_under_case_folding_are_refused_under_a_repeat() -> None:
    # Under (?i) Python's re takes the theta symbol U+03D1 and U+03F4 for each other, though neither is the other's
    # lower() or upper() (both casefold to U+03B8): (?i)(U+03D1|U+03F4 U+03D1)+z splits a run of U+03D1 among its
    # branches as (a|aa)+b splits a run of a.
    with pytest.raises(RulesError, match=r"alternation.*repeat"):
        loads_rules(rule("(?i)(\u03d1|\u03f4\u03d1)+z"))
