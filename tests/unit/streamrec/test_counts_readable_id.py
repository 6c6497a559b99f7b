"""How ``streamrec counts top`` shows a counted raw id: bounded and escaped. A raw id is outside text (a writer of the
names beside the counts chose it): one of 1 MB printed 1 MB on its line, and padded every other row to 1 MB too."""

from __future__ import annotations

from streamrec.commands.counts import readable_id


def test_a_megabyte_raw_id_is_shown_cut_to_80_chars_and_says_how_much_was_left_out() -> None:
    text = readable_id("i" * 1_000_000, "7")
    assert text.startswith("'iii") and text.endswith("... (999,922 more chars)") and len(text) < 120


def test_an_unprintable_raw_id_of_any_length_is_escaped_and_bounded() -> None:
    text = readable_id("\x1b[31m" * 100_000, "7")
    assert text.isprintable() and "\\x1b" in text and "more chars)" in text and len(text) < 120


def test_a_short_printable_raw_id_is_shown_as_is_and_an_unknown_one_by_its_hash() -> None:
    assert readable_id("i1", "7") == "i1"
    assert readable_id("two\nlines", "7") == "'two\\nlines'"
    assert readable_id(None, "7") == "hash 7"
