"""The learner's state files (``DELTA_SEQ``, ``LINEAGE``, a checkpoint and its JSON sidecar) are opened with
``stream.files.open_regular``: one that is a FIFO or a device is refused unread, logged, and passed over like a damaged
one, where a blocking open of an unfed FIFO hung the learner's (or the refresh's) start for good.

Each FIFO here is fed a valid file by a writer thread (``tests.fifos``), so the old code reads it and fails on the
assertion instead of hanging the run."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

from learner import checkpoint as ck
from learner.deltas import SEQ_FILE, read_seq_file
from tests.fifos import fed_fifo
from tests.unit.learner.test_checkpoint import meta, state


def test_a_delta_seq_file_that_is_a_fifo_is_read_as_0_and_logged(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    with fed_fifo(tmp_path / SEQ_FILE, b"7\n") as path:
        assert read_seq_file(path) == 0
    assert "not a regular file" in caplog.text
    (tmp_path / "seq").write_bytes(b"7\n")
    assert read_seq_file(tmp_path / "seq") == 7  # a regular file as before


def test_a_lineage_file_that_is_a_fifo_is_replaced_by_a_new_lineage_and_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    theirs = uuid.uuid4().hex
    with fed_fifo(tmp_path / ck.LINEAGE, theirs.encode()):
        got = ck.lineage(tmp_path)
    assert got != theirs and "not a regular file" in caplog.text
    assert (tmp_path / ck.LINEAGE).is_file()  # the FIFO replaced by a regular file
    assert (tmp_path / ck.LINEAGE).read_text() == got
    assert ck.lineage(tmp_path) == got


def test_continue_lineage_over_a_lineage_fifo_writes_the_checkpoints_lineage(tmp_path: Path) -> None:
    theirs = uuid.uuid4().hex
    with fed_fifo(tmp_path / ck.LINEAGE, theirs.encode()):
        assert ck.continue_lineage(tmp_path, {"lineage": theirs}, tmp_path / "x.pt") == theirs
    assert (tmp_path / ck.LINEAGE).is_file()  # rewritten: the FIFO was not read as its id
    assert (tmp_path / ck.LINEAGE).read_text() == theirs


def test_a_newest_checkpoint_that_is_a_fifo_is_refused_unread_and_the_previous_one_loads(tmp_path: Path) -> None:
    first = ck.save(tmp_path, state(), meta(100), keep=3)
    second = ck.save(tmp_path, state(), meta(200), keep=3)
    data = second.read_bytes()
    second.unlink()
    problems: list[tuple[Path, str]] = []
    with fed_fifo(second, data):
        got = ck.load_latest(tmp_path, safe=True, problems=problems)
    assert got is not None and got.path == first and torch.equal(got["model"]["w"], state()["model"]["w"])
    assert [p for p, _ in problems] == [second] and "not a regular file" in problems[0][1]


def test_a_checkpoint_sidecar_that_is_a_fifo_is_passed_over_for_the_next_older_one(tmp_path: Path) -> None:
    older = ck.save(tmp_path, state(), meta(100), keep=3)
    newer = ck.save(tmp_path, state(), meta(200), keep=3)
    side = newer.with_suffix(".json")
    data = side.read_bytes()
    side.unlink()
    with fed_fifo(side, data):
        got = ck.latest_meta(tmp_path)
    assert got is not None and got["path"] == str(older) and json.loads(data)["samples_trained"] == 200


def test_a_pending_rows_file_that_is_a_fifo_does_not_block_the_checkpoints_sync(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # DeltaWriter.sync (called with every checkpoint) opened the pending list with a blocking open: a FIFO there, with
    # no writer, held the checkpoint (and the learner) for good. Unfed here: run in a thread, released after the check.
    import os
    import threading

    from learner.delta_writer import DeltaWriter
    from learner.deltas import PENDING

    os.mkfifo(tmp_path / PENDING)
    writer = DeltaWriter(tmp_path, num_rows=8, every_s=60.0)
    done = threading.Event()
    t = threading.Thread(target=lambda: (writer.sync(), done.set()), daemon=True)
    t.start()
    t.join(timeout=30)
    finished = done.is_set()
    if not finished:  # release the blocked open so the thread ends
        os.close(os.open(tmp_path / PENDING, os.O_WRONLY | os.O_NONBLOCK))
        t.join(timeout=30)
    assert finished, "sync blocked on a FIFO"
    assert "not a regular file" in caplog.text


def test_a_strikes_file_that_is_a_fifo_starts_without_strikes_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from stream.strikes import FileStrikes

    with fed_fifo(tmp_path / "strikes.json", json.dumps({"samples:0:5": [2, "boom"]}).encode()) as path:
        assert FileStrikes(path).load() == {}
    assert "not a regular file" in caplog.text
    (tmp_path / "s.json").write_text(json.dumps({"samples:0:5": [2, "boom"]}))
    assert FileStrikes(tmp_path / "s.json").load() == {("samples", 0, 5): (2, "boom")}  # a regular file as before
