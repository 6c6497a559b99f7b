"""``stream.files.open_entry``: the one open that a checked-then-read file of a directory goes through (a delta, an
artifact's listed file): an entry of that directory, never through a symlink, never blocking, not inherited."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from stream.files import open_entry


@pytest.fixture()
def dir_fd(tmp_path: Path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def test_a_regular_entry_is_opened_relative_to_its_directory_even_after_the_directory_is_renamed(
        tmp_path: Path, dir_fd: int) -> None:
    (tmp_path / "a.bin").write_bytes(b"mine")
    moved = tmp_path.with_name(tmp_path.name + "-moved")
    tmp_path.rename(moved)
    try:
        fd = open_entry(dir_fd, "a.bin")
        with os.fdopen(fd, "rb") as fh:
            assert fh.read() == b"mine"
    finally:
        moved.rename(tmp_path)


def test_a_symlink_entry_is_refused_with_eloop_even_to_a_file_of_the_same_directory(
        tmp_path: Path, dir_fd: int) -> None:
    (tmp_path / "real.bin").write_bytes(b"x")
    (tmp_path / "link.bin").symlink_to(tmp_path / "real.bin")
    with pytest.raises(OSError) as info:
        open_entry(dir_fd, "link.bin")
    assert info.value.errno == errno.ELOOP


def test_a_fifo_entry_opens_without_blocking_and_is_not_inherited(tmp_path: Path, dir_fd: int) -> None:
    os.mkfifo(tmp_path / "pipe")
    fd = open_entry(dir_fd, "pipe")  # a blocking open would wait here for a writer for good
    try:
        assert not os.get_inheritable(fd)
        assert os.get_blocking(fd) is False
    finally:
        os.close(fd)
