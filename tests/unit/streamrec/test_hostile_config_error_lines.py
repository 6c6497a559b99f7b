"""A config file or environment that quotes hostile text back is still one short, printable error line (exit 2).

A section or key name is outside text: ``["s\\x1b[31m..."]`` put a raw escape sequence on the operator's terminal and
a name of 100 k characters printed 100 k characters; the error line of every command now goes through
``stream.errors.quoted`` (escaped, cut at 2000 characters), and an unknown key or variable name is quoted at its own
bound, so the hint and the known keys after it still show."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrec.cli import main

HOSTILE = "\x1b[31m" + "A" * 100_000


def error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.endswith("\n")
    return err.rstrip("\n")


def test_an_unknown_section_named_with_an_escape_sequence_is_one_escaped_bounded_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('["s\\u001b[31m' + "A" * 100_000 + '"]\nx = 1\n')
    line = error_line(capsys, ["data", "status", "--config", str(cfg)])
    assert line.isprintable() and "unknown section [s\\x1b[31mAAA" in line and len(line) < 1000
    assert "more chars)] (known sections: [" in line  # cut where it is made: the known sections still follow


def test_an_unknown_key_of_100k_chars_is_cut_and_the_known_keys_still_follow(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[replay]\n"k\\u001b' + "A" * 100_000 + '" = 1\n')
    line = error_line(capsys, ["replay", "--no-progress", "--config", str(cfg)])
    assert line.isprintable() and "unknown key 'k\\x1bAAA" in line and len(line) < 1000
    assert "more chars) in [replay]; known keys: " in line and line.endswith("seed, speed")


def test_an_unknown_environment_variable_of_100k_chars_is_cut_and_the_known_ones_still_follow(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("STREAMREC_REPLAY_" + HOSTILE, "1")
    line = error_line(capsys, ["replay", "--no-progress"])
    assert line.isprintable() and "STREAMREC_REPLAY_\\x1b[31mAAA" in line and len(line) < 1000
    assert "does not name a [replay] setting; known: " in line and line.endswith("STREAMREC_REPLAY_SPEED")


def test_a_number_of_100k_chars_is_refused_in_a_bounded_line_naming_the_setting(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"  # float()'s own error quotes the whole value: the line held it twice
    cfg.write_text('[replay]\nspeed = "' + "9" * 50_000 + 'x"\n')
    line = error_line(capsys, ["replay", "--no-progress", "--config", str(cfg)])
    assert line.isprintable() and "speed" in line and len(line) < 1000
