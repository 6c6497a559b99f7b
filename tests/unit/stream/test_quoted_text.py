"""``stream.errors.quoted``: the one rule for text from outside (a peer's answer, a file's bytes, a library's error
quoting input) in a message, and ``shown`` quoting a ``str`` by it. Hand-rolled variants disagreed: ``shown`` cut
every string at reprlib's 60 characters whatever ``limit`` said, so the monitor's peer text (``shown(text, 1000)``
where one tab made it unprintable) lost all but 60 characters, and the cuts did not say how much was left out."""

from __future__ import annotations

import pytest

from stream.errors import quoted, shown

HOSTILE = "Oops\x1b[2J\r2026-12-07 WARNING streamrec.monitor: FORGED\x85\u2028\t\x00" + "y" * 60_000


def test_printable_short_text_is_quoted_as_it_is() -> None:
    for text in ("", "Not Found", "a 'quoted' \\ back\"slash", "é ü 中文", "x" * 200):
        assert quoted(text) == text


@pytest.mark.parametrize("limit", [1, 10, 80, 200, 1000])
def test_hostile_text_has_no_control_character_and_is_bounded_by_the_limit_plus_the_count_left_out(limit: int) -> None:
    said = quoted(HOSTILE, limit)
    head, _, rest = said.partition("... (")
    assert said.isprintable(), said
    assert len(head) <= limit and rest.endswith(" more chars)"), said
    assert int(rest.split()[0].replace(",", "")) == len(HOSTILE) - len(head.encode("ascii").decode("unicode_escape"))


def test_a_control_character_is_escaped_and_the_rest_of_a_text_under_the_limit_kept_whole() -> None:
    text = "line one\tcolumn\n" + "z" * 280  # one tab: shown(text, 1000) cut it to 60 characters
    assert quoted(text, 1000) == text.replace("\t", "\\t").replace("\n", "\\n")


def test_an_escape_is_never_cut_in_half() -> None:
    assert quoted("ab\x1bcd", 4) == "ab... (3 more chars)"


def test_shown_quotes_a_string_up_to_its_limit_not_reprlibs_60_characters() -> None:
    assert shown("a" * 150, 200) == repr("a" * 150)
    assert shown("it's", 80) == repr("it's")


def test_shown_escapes_a_hostile_string_within_its_limit_and_says_how_much_it_left_out() -> None:
    said = shown(HOSTILE, 80)
    assert said.isprintable() and said.startswith("'Oops\\x1b[2J\\r2026"), said
    assert len(said) <= 80 + len(f"... ({len(HOSTILE):,} more chars)") and said.endswith(" more chars)"), said


def test_shown_of_a_value_that_is_not_text_is_still_reprlibs() -> None:
    assert shown([1, 2, 3, 4, 5, 6]) == "[1, 2, 3, 4, ...]"
    assert shown(b"\x1b" * 10) == repr(b"\x1b" * 10)


def test_shown_escapes_a_line_break_in_an_objects_own_repr() -> None:
    class Forged:
        def __repr__(self) -> str:
            return "Forged()\n2026-12-07 ERROR forged line"

    assert shown(Forged()) == "Forged()\\n2026-12-07 ERROR forged line"
