"""``stream.files.write_atomic`` makes its temp file afresh: a symlink found at the temp name (planted in a shared
directory such as a publish root, the name being the pid and thread) is removed, never written through. It was
followed: the write truncated its target, any file the process may write, and the rename then made ``path`` itself
(e.g. a publish root's CURRENT) that symlink."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from stream.files import TMP_MARK, write_atomic, write_synced


def test_a_symlink_at_the_temp_name_is_replaced_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    target = tmp_path / "root" / "CURRENT"
    target.parent.mkdir()
    (target.parent / f".CURRENT{TMP_MARK}{os.getpid()}-{threading.get_ident()}").symlink_to(victim)
    write_atomic(target, b"v002\n")
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and target.read_bytes() == b"v002\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["CURRENT"]


def test_a_stale_temp_file_of_the_same_name_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / "last_run.json"
    (tmp_path / f".last_run.json{TMP_MARK}{os.getpid()}-{threading.get_ident()}").write_text("a killed run's")
    write_atomic(target, lambda fh: fh.write(b"{}"))
    assert target.read_bytes() == b"{}" and sorted(p.name for p in tmp_path.iterdir()) == ["last_run.json"]


def test_write_synced_refuses_to_write_through_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "cold_rows.npy").symlink_to(victim)
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        write_synced(tmp_path / "cold_rows.npy", lambda fh: fh.write(b"rows"))
    assert victim.read_text() == "precious"
