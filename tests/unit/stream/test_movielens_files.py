"""The packaged MovieLens files (stream/replay/movielens.py) are read as regular files only: one that is missing, a
FIFO, a device or a directory in the installed package is :class:`DatasetMissing` naming it and the reinstall,
never a hang (a FIFO was waited on for good) or a traceback (FileNotFoundError)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

import stream.replay.movielens as movielens
from stream.errors import DatasetMissing
from stream.replay.config import ClickDelay
from tests.fifos import fed_fifo

FILES = {
    # CRLF, as ml-1m's .inter is
    "inter": "user_id:token\titem_id:token\trating:float\ttimestamp:float\r\n1\t10\t5\t881250949\r\n"
             "2\t20\t3\t891717742\r\n",
    "user": "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n1\t24\tM\ttechnician\t85711\n",
    "item": "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
            "10\tToy Story\t1995\tAnimation\n",
}


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed ml-100k folder holding ``FILES``."""
    for ext, text in FILES.items():
        (tmp_path / f"ml-100k.{ext}").write_bytes(text.encode())
    monkeypatch.setattr(movielens.PackagedDataset, "locate", lambda self: tmp_path)
    return tmp_path


def test_the_packaged_files_are_read_every_column_as_text(folder: Path) -> None:
    table = movielens.load_movielens("ml-100k", ClickDelay(), seed=1)
    assert table.n_impressions == 2 and table.n_clicks == 1
    inter = movielens.read_movielens("ml-100k").inter
    assert inter.column_names[-1] == "timestamp:float" and set(inter.schema.types) == {pa.string()}


@pytest.mark.parametrize("ext", ["user", "item"])
def test_a_fifo_in_place_of_a_packaged_file_is_refused_unread(folder: Path, ext: str) -> None:
    """Fed, the FIFO would be read (and the load succeed) by a reader that opens it; one without a writer hangs."""
    path = folder / f"ml-100k.{ext}"
    path.unlink()
    with fed_fifo(path, FILES[ext].encode()), pytest.raises(DatasetMissing, match=rf"ml-100k\.{ext}.*not a regular "
                                                                                  r"file.*--force-reinstall recbole"):
        movielens.read_movielens("ml-100k")


@pytest.mark.parametrize("kind", ["missing", "device", "directory"])
def test_a_missing_device_or_directory_packaged_file_is_dataset_missing(folder: Path, kind: str) -> None:
    path = folder / "ml-100k.item"
    path.unlink()
    if kind == "device":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    with pytest.raises(DatasetMissing, match=r"cannot read .*ml-100k\.item.*--force-reinstall recbole==1.2.1"):
        movielens.read_movielens("ml-100k")


@pytest.mark.parametrize(("row", "what"), [
    ("2\t20\tfive\t891717742", r"rating:float.*'five'"),  # was an ArrowInvalid traceback
    ("2\t20\t3\tnan", r"timestamp:float.*'nan'"),  # was replayed at ts -2**63 (the joiner dead-letters it)
    ("2\t20\t3\t-891717742", r"timestamp:float.*'-891717742'"),  # was replayed at a negative ts
    ("2\t20\t3\t1e300", r"timestamp:float.*'1e300'"),
])
def test_a_packaged_ratings_file_with_a_bad_rating_or_time_is_dataset_missing_naming_its_line(
        folder: Path, row: str, what: str) -> None:
    """A damaged ``.inter`` (a rating that is no number, a time that is no epoch second) is a broken install, never a
    traceback nor events at times the joiner dead-letters: DatasetMissing naming the file, line and reinstall."""
    (folder / "ml-100k.inter").write_text(FILES["inter"].replace("2\t20\t3\t891717742", row))
    with pytest.raises(DatasetMissing, match=rf"ml-100k\.inter.*line 3.*{what}.*--force-reinstall recbole==1.2.1"):
        movielens.load_movielens("ml-100k", ClickDelay(), seed=1)
