"""An empty ``signing_key_file`` is a configuration error, not "no key" (streamrec/settings.py,
learner/tensorpack.py): a templated environment whose secret path is unset must not turn signing off."""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_refresh.settings import RefreshSettings
from learner.config import LearnerSettings
from learner.tensorpack import load_signing_key
from serving.settings import ServeSettings
from stream.errors import ConfigError
from streamrec.cli import main
from streamrec.settings import SettingsError, Sources


@pytest.mark.parametrize(("cls", "section"), [(RefreshSettings, "refresh"), (LearnerSettings, "learner"),
                                              (ServeSettings, "serve")])
@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_signing_key_file_is_refused_from_env_and_file(cls: type, section: str, empty: str) -> None:
    var = f"STREAMREC_{section.upper()}_SIGNING_KEY_FILE"
    with pytest.raises(SettingsError, match=f"environment {var}: cannot use .*an empty path"):
        Sources(environ={var: empty}).build(cls, section)
    with pytest.raises(SettingsError, match=rf"config file \[{section}\].signing_key_file: cannot use .*an empty path"):
        Sources(file_data={section: {"signing_key_file": empty}}, environ={}).build(cls, section)


def test_unset_still_means_no_key_and_a_path_is_kept(tmp_path: Path) -> None:
    assert Sources(environ={}).build(RefreshSettings, "refresh").signing_key_file is None
    rs = Sources(environ={"STREAMREC_REFRESH_SIGNING_KEY_FILE": str(tmp_path / "k")}).build(RefreshSettings, "refresh")
    assert rs.signing_key_file == tmp_path / "k"
    assert load_signing_key(None) is None
    with pytest.raises(ConfigError, match="signing_key_file is empty"):
        load_signing_key("")


def test_refresh_with_an_empty_key_setting_is_a_usage_error_and_builds_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("STREAMREC_REFRESH_SIGNING_KEY_FILE", "")
    root = tmp_path / "serving"
    assert main(["refresh", "--now", "--publish-root", str(root), "--checkpoint-dir", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "STREAMREC_REFRESH_SIGNING_KEY_FILE: cannot use '': an empty path" in err and "Traceback" not in err
    assert not root.exists()
