"""``[refresh] log_level`` is a choice checked where the settings are built: a level logging does not know
(``"verbose"``, ``""``, ``5``) was accepted and then ended ``streamrec refresh`` in a ValueError traceback from
``logging.basicConfig`` (exit 1), not a configuration error (exit 2, one line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_refresh.settings import LogLevel, RefreshSettings
from streamrec.cli import main
from streamrec.settings import SettingsError, Sources


@pytest.mark.parametrize("raw", ['"verbose"', '""', "5"])
def test_an_unknown_log_level_in_the_file_is_a_usage_error_in_one_line(
        raw: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "streamrec.toml"
    config.write_text(f"[refresh]\nlog_level = {raw}\n")
    assert main(["refresh", "--status", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "[refresh].log_level: cannot use" in err and "expected one of debug, info, warning, error" in err


def test_an_unknown_log_level_in_the_environment_is_refused() -> None:
    with pytest.raises(SettingsError, match="STREAMREC_REFRESH_LOG_LEVEL: cannot use 'trace'"):
        Sources(environ={"STREAMREC_REFRESH_LOG_LEVEL": "trace"}).build(RefreshSettings, "refresh")


def test_a_known_log_level_is_taken_in_any_case() -> None:
    built = Sources(environ={"STREAMREC_REFRESH_LOG_LEVEL": "WARNING"}).build(RefreshSettings, "refresh")
    assert built.log_level is LogLevel.WARNING
    assert RefreshSettings(log_level="Debug").log_level is LogLevel.DEBUG  # type: ignore[arg-type]
    assert RefreshSettings().log_level is LogLevel.INFO
