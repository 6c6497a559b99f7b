"""A loaded artifact's cold table (``cold_rows.npy``) changed on disk while serving holds it: the serving process keeps
scoring with the rows it verified at load (``serving.model.ScoringModel.load`` copies them out of the file).

Serving memory-mapped the file and read rows from it per request, so whatever happened to the file later reached the
requests: a file truncated in place (an operator's ``cp`` over it, a publish or a tool that rewrites it, a network
file system's hiccup) killed the process with SIGBUS at the first row past the new end (no error, no metric, no
fallback), and bytes rewritten in place (same size) were served unverified. The truncation runs in a child process, so
that a SIGBUS kills the child, not the test run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cache_refresh.publish import publish
from learner import artifact_manifest as M
from learner.artifact import build_artifact
from learner.artifact_versions import ArtifactError
from serving import model as model_module
from serving.model import ScoringModel
from stream.files import sha256_file
from tests.unit.learner.test_artifact import CFG, make_checkpoint, probe

REPO = Path(__file__).resolve().parents[3]
HEADER = 128  # an .npy 1.0 header of a small table: the file truncated to it keeps no row


@pytest.fixture(scope="module")
def ckpt() -> dict:
    return make_checkpoint()


@pytest.fixture
def version(tmp_path: Path, ckpt: dict) -> Path:
    root = tmp_path / "serving"
    return publish(root, build_artifact(ckpt, root, np.arange(10)), keep=3)


_TRUNCATE_THEN_SCORE = """
import json, os, sys
from serving import model as model_module
from serving.model import ScoringModel
from stream.files import sha256_file
from tests.unit.learner.test_artifact import CFG, probe
model = ScoringModel.load(sys.argv[1])
before = model.score(*probe(CFG)).tolist()
os.truncate(sys.argv[2], int(sys.argv[3]))  # in place, while the table is loaded: what `cp` over it does first
after = model.score(*probe(CFG)).tolist()  # rows of every block: most lie past the new end
print(json.dumps({"before": before, "after": after}))
"""


def test_a_cold_table_truncated_in_place_after_load_neither_kills_serving_nor_changes_its_scores(
        version: Path) -> None:
    path = version / M.COLD_FILE
    assert path.stat().st_size > 4 * os.sysconf("SC_PAGE_SIZE")  # rows on pages wholly past the new end
    done = subprocess.run([sys.executable, "-c", _TRUNCATE_THEN_SCORE, str(version), str(path), str(HEADER)],
                          cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode != -signal.SIGBUS, "the serving process died of SIGBUS reading the truncated table"
    assert done.returncode == 0, done.stderr[-2000:]
    scores = json.loads(done.stdout.strip().splitlines()[-1])
    assert path.stat().st_size == HEADER
    assert scores["after"] == scores["before"]


def test_bytes_rewritten_in_place_after_load_are_not_served(version: Path) -> None:
    model = ScoringModel.load(version)
    before = model.score(*probe(CFG))
    path = version / M.COLD_FILE
    with open(path, "r+b") as fh:  # the same size, other bytes: a sha256 at load never sees them
        fh.seek(HEADER)
        fh.write(np.full((path.stat().st_size - HEADER) // 4, 0.5, np.float32).tobytes())
    assert np.array_equal(model.score(*probe(CFG)).numpy(), before.numpy())
    assert not np.array_equal(model.table[10:], np.full_like(model.table[10:], 0.5))


def test_a_table_shorter_than_its_header_with_a_manifest_that_matches_it_is_refused_naming_the_file_and_sizes(
        version: Path) -> None:
    path, manifest_path = version / M.COLD_FILE, version / M.MANIFEST
    full = path.stat().st_size
    path.write_bytes(path.read_bytes()[:full - 4096])  # a publish that wrote (and hashed) a short file
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][M.COLD_FILE] = {"sha256": sha256_file(path), "bytes": full - 4096}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError) as err:
        ScoringModel.load(version)
    assert all(s in str(err.value) for s in (str(path), f"holds {full - 4096} bytes", f"header says {full}"))


def test_a_table_rewritten_in_place_after_its_check_is_refused_not_served(
        version: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race a sha256 check before the read leaves: the table's bytes changed in place (same inode, same size) after
    the load opened (and checked) the file, before the table is read into memory. Its digest must be that of the
    bytes read."""
    path = version / M.COLD_FILE
    want = ScoringModel.load(version).table.copy()
    real_read, rewritten = model_module.read_table, []

    def rewrite_then_read(fh: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        with open(path, "r+b") as out:
            out.seek(HEADER)
            out.write(np.full((path.stat().st_size - HEADER) // 4, 0.5, np.float32).tobytes())
        rewritten.append(True)
        return real_read(fh, *args, **kwargs)

    monkeypatch.setattr(model_module, "read_table", rewrite_then_read)
    try:
        got = ScoringModel.load(version)
    except ArtifactError as exc:
        assert str(path) in str(exc) and "sha256" in str(exc)
        got = None
    assert rewritten == [True]
    if got is not None:
        assert np.array_equal(got.table, want), "a table no manifest lists was loaded"


def test_a_table_whose_header_was_corrupted_in_place_is_refused_for_its_sha256_not_as_truncated(
        version: Path) -> None:
    """The table's digest is taken as it is read (``read_table``), after its header is parsed: a header damaged in place
    (same size, a shape of more rows than the file holds) was refused as "the file is truncated" (the header's size
    against the file's), never naming the digest the manifest has for it, as the check at open did."""
    path = version / M.COLD_FILE
    raw = bytearray(path.read_bytes())
    rows = int(np.load(path, mmap_mode="r").shape[0])
    at = raw.index(f"({rows},".encode())
    raw[at + 1:at + 1 + len(str(rows))] = b"9" * len(str(rows))  # more rows (rows < 10 ** digits - 1)
    path.write_bytes(bytes(raw))  # the same size: the size check at open passes
    with pytest.raises(ArtifactError) as err:
        ScoringModel.load(version)
    assert str(path) in str(err.value) and "sha256" in str(err.value) and "truncated" not in str(err.value), err.value
