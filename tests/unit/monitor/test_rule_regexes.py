"""A label regex of a rule runs on every scraped label value, every interval, in Python's backtracking ``re`` (no
timeout): a repeat nested in a repeat, ``(a+)+b``, takes time exponential in the value's length on a value that
almost matches. Such a regex is refused when the rules file loads, naming the rule; ordinary ones load."""

from __future__ import annotations

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
