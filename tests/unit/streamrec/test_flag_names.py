"""An error in a flag's value names the flag the operator typed, not one derived from the setting's name
(--attribution-window-s for --window-s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrec.cli import main


@pytest.mark.parametrize("argv, flag", [
    (["join", "--window-s", "nan"], "--window-s"),
    (["join", "--lateness-s", "nan"], "--lateness-s"),
    (["join", "--exit-when-idle", "inf"], "--exit-when-idle"),
    (["train", "--exit-when-idle", "nan"], "--exit-when-idle"),
    (["serve", "--request-timeout", "inf", "--no-redis"], "--request-timeout"),
    (["serve", "--keepalive-timeout", "nan", "--no-redis"], "--keepalive-timeout"),
    (["replay", "--dataset", "synthetic", "--syn-base-ctr", "nan"], "--syn-base-ctr"),
])
def test_a_bad_flag_value_names_the_real_flag(argv: list[str], flag: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2  # a settings error before anything connects
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"streamrec {argv[0]}: error: {flag}: "), err
