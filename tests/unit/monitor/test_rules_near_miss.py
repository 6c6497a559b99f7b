"""A misspelt field of an alert rules file names the field meant (``treshold``: "threshold"), not only every known
field, as a misspelt key of the --config file does."""

from __future__ import annotations

import pytest

from monitor.rules import RulesError, loads_rules

RULE = '[[rule]]\nname = "r"\nexpr = "up"\nop = ">"\n'


@pytest.mark.parametrize(("text", "expected"), [
    (RULE + "treshold = 1\n", 'rule "r": unknown field "treshold"; did you mean "threshold"?'),
    ('[sinks]\nwebhok_url = "http://h/x"\n', '[sinks]: unknown field "webhok_url"; did you mean "webhook_url"?'),
    ("[run_log]\nmax_byte = 4096\n", '[run_log]: unknown field "max_byte"; did you mean "max_bytes"?'),
    ("interval = 30\n", 'unknown top-level key "interval"; did you mean "interval_s"?'),
])
def test_a_misspelt_rules_file_field_names_the_closest_known_one(text: str, expected: str) -> None:
    with pytest.raises(RulesError) as err:
        loads_rules(text)
    assert expected in str(err.value)


def test_a_rules_table_spelt_rules_keeps_its_own_hint() -> None:
    with pytest.raises(RulesError, match=r"a rule is written \[\[rule\]\], not \[\[rules\]\]"):
        loads_rules('[[rules]]\nname = "r"\n')
