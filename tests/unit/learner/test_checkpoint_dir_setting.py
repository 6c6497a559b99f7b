"""``[learner] checkpoint_dir`` (and ``deltas_dir`` while deltas are on) must be a directory the learner can write:
a regular file there, or a directory nobody may write, is a configuration error at start (exit 2, naming the setting
and the path), before the metrics listener, the ranks or Kafka; it ended ``streamrec train`` in a NotADirectoryError
traceback from the strikes file."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.checkpoint_directory import check_directory
from stream.errors import ConfigError
from streamrec.cli import main

UNREACHABLE = ["--bootstrap-servers", "127.0.0.1:1", "--exit-when-idle", "1"]  # never contacted: refused before


@pytest.mark.parametrize("below", ["", "sub"])
def test_a_checkpoint_dir_that_is_a_regular_file_is_a_config_error_naming_the_setting_and_the_path(
        tmp_path: Path, below: str, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "checkpoints"
    afile.write_text("not a directory")
    path = afile / below if below else afile
    assert main(["train", "--checkpoint-dir", str(path), *UNREACHABLE]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"[learner] checkpoint_dir (--checkpoint-dir) {path} " in err
    assert afile.read_text() == "not a directory"


def test_a_deltas_dir_that_is_a_regular_file_is_refused_while_deltas_are_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "deltas"
    afile.write_text("")
    monkeypatch.setenv("STREAMREC_LEARNER_DELTAS_EVERY_S", "5")
    monkeypatch.setenv("STREAMREC_LEARNER_DELTAS_DIR", str(afile))
    assert main(["train", "--checkpoint-dir", str(tmp_path / "ckpt"), *UNREACHABLE]) == 2
    assert f"[learner] deltas_dir {afile} is a file, not a directory" in capsys.readouterr().err


def test_a_directory_that_cannot_be_written_is_refused_and_a_missing_one_is_made_and_left_empty(
        tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^\[learner\] checkpoint_dir /proc/self is no directory this process can "
                                          r"write into \("):
        check_directory(Path("/proc/self"), "[learner] checkpoint_dir")  # a directory nobody writes, root included
    fresh = tmp_path / "a" / "b"
    check_directory(fresh, "[learner] checkpoint_dir")
    assert fresh.is_dir() and not list(fresh.iterdir())
