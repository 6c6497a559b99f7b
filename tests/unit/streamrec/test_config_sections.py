"""A --config file's tables are checked against the known sections: a misspelled one ([kafak]) was ignored
silently, so the file's settings never applied."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from streamrec.cli import main
from streamrec.settings import SECTIONS, SettingsError, read_config_file

ROOT = Path(__file__).resolve().parents[3]


def test_a_misspelled_section_is_an_error_with_a_suggestion(tmp_path: Path) -> None:
    path = tmp_path / "typo.toml"
    path.write_text('[kafak]\nbootstrap_servers = "x:1"\n')
    with pytest.raises(SettingsError, match=r"unknown section \[kafak\]; did you mean \[kafka\]\?"):
        read_config_file(path)
    path.write_text('zzz = 1\n[kafka]\nbootstrap_servers = "x:1"\n')
    with pytest.raises(SettingsError, match=r"unknown section \[zzz\] \(known sections: \[kafka\]"):
        read_config_file(path)


def test_every_known_section_reads(tmp_path: Path) -> None:
    path = tmp_path / "all.toml"
    path.write_text("".join(f"[{s}]\n" for s in SECTIONS))
    assert set(read_config_file(path)) == set(SECTIONS)


def test_the_cli_stops_on_a_misspelled_section_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "typo.toml").write_text('[kafak]\nbootstrap_servers = "x:1"\n')
    assert main(["stack", "status", "--config", "typo.toml"]) == 2
    assert "did you mean [kafka]?" in capsys.readouterr().err


def test_every_section_a_command_builds_is_known() -> None:
    built = set()
    for folder in ("streamrec", "cache_refresh"):
        for src in (ROOT / folder).rglob("*.py"):
            built |= set(re.findall(r"\.build\(\s*\w+,\s*\"(\w+)\"", src.read_text(encoding="utf-8")))
    assert built and built <= set(SECTIONS), built - set(SECTIONS)


def test_an_empty_config_path_is_named_as_empty_not_as_the_working_directory(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--status", "--config", ""]) == 2
    err = capsys.readouterr().err
    assert "--config was given an empty path" in err and "config file ." not in err
