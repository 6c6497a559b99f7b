"""Two learners training into one checkpoint directory (a second replica, a rolling update that starts the new
learner before the old one stops): each numbers its serving deltas from its own counter, so two different models'
deltas took one seq (serving applies one of them and skips the other for good), and each pruned the other's
checkpoints. The second is refused at its start while the first holds ``<checkpoint_dir>/LOCK``."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import pytest

from learner import daemon
from learner.config import LearnerSettings
from stream.config import KafkaSettings
from stream.errors import ConfigError


def fresh_learner(monkeypatch: pytest.MonkeyPatch, ckpt: Path) -> daemon.Learner:
    """A learner whose run finds no samples (ends at once) and installs no signal handlers."""
    monkeypatch.setattr(daemon, "infer_feature_config", lambda *a, **k: None)
    monkeypatch.setattr(daemon, "take_stop_signals", lambda *a: None)
    return daemon.Learner(KafkaSettings(bootstrap_servers="127.0.0.1:9"),
                          LearnerSettings(checkpoint_dir=ckpt, exit_when_idle_s=0.01))


def test_a_second_learner_on_a_checkpoint_directory_in_use_is_refused_naming_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    fd = os.open(ckpt / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)  # what the running learner holds
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, b"4242\n")
    second = fresh_learner(monkeypatch, ckpt)
    try:
        with pytest.raises(ConfigError, match=rf"{ckpt}.*in use by another learner \(pid 4242,"):
            second.run()
    finally:
        second.close()
    os.close(fd)  # the first stopped (or died: the kernel releases the lock with the process)
    third = fresh_learner(monkeypatch, ckpt)
    try:
        summary: dict[str, Any] = third.run()
        assert summary["reason"] == "no samples arrived"
    finally:
        third.close()


def test_close_puts_back_the_signal_handlers_run_replaced(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """run() takes SIGTERM and SIGINT for its stop; close() left them installed (the sharded learner put them back):
    the closed learner stayed alive through the bound method, and a later SIGTERM to the process (a test harness, an
    embedding application) went to it rather than to the handler the process had before."""
    import signal

    monkeypatch.setattr(daemon, "infer_feature_config", lambda *a, **k: None)
    ours = lambda *_: None  # noqa: E731 - the process's own handler
    before = {sig: signal.signal(sig, ours) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        learner = daemon.Learner(KafkaSettings(bootstrap_servers="127.0.0.1:9"),
                                 LearnerSettings(checkpoint_dir=tmp_path, exit_when_idle_s=0.01))
        try:
            assert learner.run()["reason"] == "no samples arrived"
            assert signal.getsignal(signal.SIGTERM) == learner._on_signal  # taken while it runs
        finally:
            learner.close()
        assert signal.getsignal(signal.SIGTERM) is ours and signal.getsignal(signal.SIGINT) is ours
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_forked_child_does_not_keep_the_directory_locked(tmp_path: Path) -> None:
    """A DataLoader worker (forked) outlives a SIGKILLed learner by seconds: holding the lock's descriptor, it had the
    restarted learner refused meanwhile."""
    from learner import checkpoint

    fd = checkpoint.hold_directory(tmp_path)
    read, write = os.pipe()
    started_r, started_w = os.pipe()
    child = os.fork()
    if child == 0:  # the child: says it runs (its fork handlers ran), then lives on (as a worker does) until told
        os.close(write)
        os.write(started_w, b"1")
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    os.close(started_w)
    try:
        assert os.read(started_r, 1) == b"1"
        os.close(started_r)
        checkpoint.release_directory(fd)  # the learner is gone; its worker is not
        checkpoint.release_directory(checkpoint.hold_directory(tmp_path))  # the restart takes the lock
    finally:
        os.close(write)
        os.waitpid(child, 0)


def test_a_learner_whose_consumer_fails_to_close_still_releases_the_directory_lock(tmp_path: Path) -> None:
    """close() closed the group consumer first: when that raised, the LOCK stayed held for the rest of the process (a
    test harness or an embedding application that goes on), and the next learner on the directory was refused."""
    from learner import checkpoint

    class FailingConsumer:
        def close(self) -> None:
            raise RuntimeError("the consumer failed to close")

    learner = daemon.Learner.__new__(daemon.Learner)
    learner._group = FailingConsumer()  # type: ignore[assignment]
    learner._lock, learner._handlers = checkpoint.hold_directory(tmp_path), {}
    with pytest.raises(RuntimeError, match="the consumer failed to close"):
        learner.close()
    assert learner._lock is None
    checkpoint.release_directory(checkpoint.hold_directory(tmp_path))  # the next learner takes the lock


def test_a_lock_whose_pid_cannot_be_written_is_not_left_held(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """hold_directory took the flock, then wrote its pid: a full disk failing that write raised with the descriptor
    open and the lock held for the rest of the process, so the learner's next try was refused as 'in use'."""
    import errno

    from learner import checkpoint
    from stream import lock_file

    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(lock_file.os, "pwrite", full)  # the one definition of a lock file the learner's LOCK is
        with pytest.raises(ConfigError, match="cannot open its LOCK .*No space left on device"):
            checkpoint.hold_directory(tmp_path)
    checkpoint.release_directory(checkpoint.hold_directory(tmp_path))  # the next try takes the lock


@pytest.mark.parametrize("what", ["lock_is_a_directory", "lock_is_a_link", "dir_is_a_file"])
def test_a_lock_that_cannot_be_opened_is_a_settings_error_naming_it(tmp_path: Path, what: str) -> None:
    """An OSError opening ``<checkpoint_dir>/LOCK`` (a directory there, a symlink, a checkpoint_dir that is a file)
    escaped as a traceback and exit 1; it is the operator's to mend: a ConfigError (exit 2) naming the path."""
    from learner import checkpoint

    ckpt = tmp_path / "ckpt"
    if what == "dir_is_a_file":
        ckpt.write_text("not a directory")
    else:
        ckpt.mkdir()
        if what == "lock_is_a_directory":
            (ckpt / "LOCK").mkdir()
        else:
            (ckpt / "LOCK").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=rf"checkpoint_dir {ckpt}: cannot open its LOCK"):
        checkpoint.hold_directory(ckpt)


def test_a_lock_that_is_no_regular_file_is_a_settings_error_naming_it(tmp_path: Path) -> None:
    """A FIFO at ``<checkpoint_dir>/LOCK`` opens (O_NONBLOCK) and takes the flock; writing the pid into it then failed
    (ftruncate: EINVAL) as a traceback and exit 1, where a directory or a link there is a ConfigError naming it."""
    from learner import checkpoint

    os.mkfifo(tmp_path / "LOCK")
    with pytest.raises(ConfigError, match=rf"checkpoint_dir {tmp_path}: cannot open its LOCK \(OSError: not a regular"):
        checkpoint.hold_directory(tmp_path)
    (tmp_path / "LOCK").unlink()
    checkpoint.release_directory(checkpoint.hold_directory(tmp_path))  # no descriptor left holding it


def test_a_lock_that_is_a_hard_link_to_another_file_leaves_that_file_alone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``<checkpoint_dir>/LOCK`` hard-linked to another file (a directory copied with ``cp -al``, a file linked there):
    the learner truncated that file and wrote its pid into it. It is locked all the same, its contents untouched,
    and a warning names it."""
    from learner import checkpoint

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    other = tmp_path / "other.json"
    other.write_text('{"keep": "these bytes"}')
    os.link(other, ckpt / "LOCK")
    fd = checkpoint.hold_directory(ckpt)
    try:
        assert other.read_text() == '{"keep": "these bytes"}'
        assert fd is not None and "is a hard link to another file" in caplog.text
        with pytest.raises(ConfigError, match=r"in use by another learner \(pid not known,"):
            checkpoint.hold_directory(ckpt)  # locked all the same; its bytes are not read as a pid
    finally:
        checkpoint.release_directory(fd)
    assert other.read_text() == '{"keep": "these bytes"}'


def test_a_filesystem_that_cannot_lock_is_said_on_the_checkpoint_logger_naming_a_second_learner(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """NFS without locks (ENOLCK): the learner goes on without the lock, and the operator reads that a second learner
    on the directory is not detected, on the learner's own logger (the shared lock file's words were "a second process
    using it", on the root streamrec logger)."""
    import errno
    import logging

    from learner.checkpoint_directory import hold_directory

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="streamrec.checkpoint"):
        assert hold_directory(tmp_path / "ckpt") is None
    said = [r for r in caplog.records if r.name == "streamrec.checkpoint" and "not detected" in r.getMessage()]
    assert said and "a second learner on this directory is not detected" in said[0].getMessage()
