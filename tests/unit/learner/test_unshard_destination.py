"""``streamrec train --checkpoint-dir DIR --unshard DEST``: DEST must be a directory the process can write (made
when missing). A regular file there (or below one), or a directory nobody may write, is a configuration error
naming --unshard and the path (exit 2), before the sharded checkpoint is loaded; it ended in a traceback from
``checkpoint.save`` once the whole checkpoint had been loaded and converted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from learner import sharded_checkpoint
from stream.errors import ConfigError
from streamrec.cli import main


@pytest.mark.parametrize("below", ["", "sub"])
def test_an_unshard_destination_that_is_a_regular_file_is_a_config_error_naming_the_flag_and_the_path(
        tmp_path: Path, below: str, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "single"
    afile.write_text("not a directory")
    dest = afile / below if below else afile
    assert main(["train", "--checkpoint-dir", str(tmp_path / "sharded"), "--unshard", str(dest)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"--unshard {dest} " in err
    assert afile.read_text() == "not a directory"


def test_an_unshard_destination_nobody_may_write_is_refused_before_the_source_is_read(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--unshard /proc/self is no directory this process can write into \("):
        sharded_checkpoint.unshard(tmp_path / "no-such-source", Path("/proc/self"))


def test_an_unshard_into_the_directory_a_learner_trains_into_is_refused_naming_it_and_writes_nothing(
        tmp_path: Path, one_rank_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unshard wrote its checkpoint beside a running learner's (it took no LOCK): its ``checkpoint.save`` pruned
    that learner's checkpoints, ``streamrec refresh`` served the other training's model as the newest, and the
    learner's next restart resumed it, throwing its own training away."""
    from learner import checkpoint
    from tests.unit.learner.test_sharded_restore import CFG, T0, a_round, learner, rows

    first = learner(tmp_path, monkeypatch)
    try:
        first._build(CFG)
        a_round(first, rows(16, T0))
        first.save()
    finally:
        first.close()
    live = tmp_path / "single"
    held = checkpoint.hold_directory(live)  # a single-process learner training there
    try:
        with pytest.raises(ConfigError, match=rf"^--unshard {live}: .*in use by another learner \(pid {os.getpid()}"):
            sharded_checkpoint.unshard(tmp_path / "ckpt", live)
    finally:
        checkpoint.release_directory(held)
    assert checkpoint.list_checkpoints(live) == []
    assert checkpoint.list_checkpoints(Path(sharded_checkpoint.unshard(tmp_path / "ckpt", live)).parent)  # once free
