"""Checkpoints (learner/checkpoint.py): atomic files with a sidecar, typed on load, older layouts upgraded,
newer ones refused, damaged newest files skipped, and a safe load that runs no code."""

from __future__ import annotations

import errno
import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner import checkpoint as ck
from learner import checkpoint_read, checkpoint_write
from learner.config import LearnerSettings, ModelConfig, SparseOptimizer, shape_of
from learner.features import default_config
from stream.errors import StreamrecError
from tests.fsync_faults import failing_directory_fsync

LS = LearnerSettings(mlp="8,4", buckets=50, ctx_buckets=20, id_capacity=10, embedding_dim=4)
CFG = default_config({"genres": "multi"}, buckets=LS.buckets, ctx_buckets=LS.ctx_buckets, embedding_dim=4,
                     id_capacity=LS.id_capacity, admit_after=LS.admit_after, id_init=LS.id_init,
                     user_bucket_half_life_s=LS.user_bucket_half_life_s)


def meta(samples: int = 100, **extra: object) -> dict:
    return {"samples_trained": samples, "steps": 3, "offsets": {"0": 7, "1": 9}, "partition_rows": {},
            "duplicates": 0, "feature_config": CFG.to_dict(), "shape": shape_of(LS),
            "model": {"mlp": "8,4", "dropout": 0.0, "sparse_optimizer": "rowwise_adagrad"}, **extra}


def state() -> dict:
    return {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "recent_ids": []}


def test_a_saved_checkpoint_loads_typed_and_keeps_the_stored_layout(tmp_path: Path) -> None:
    path = ck.save(tmp_path, state(), meta())
    got = ck.load_latest(tmp_path, safe=True)
    assert isinstance(got, ck.Checkpoint) and got.path == path and got.format_version == ck.FORMAT_VERSION
    assert got.feature_config == CFG and got.samples_trained == 100 and got.offsets == {0: 7, 1: 9}
    assert got.model_config == ModelConfig((8, 4), 0.0, SparseOptimizer.ROWWISE_ADAGRAD)
    assert got.shape == shape_of(LS) and got.meta["lineage"] == ck.lineage(tmp_path)
    assert torch.equal(got["model"]["w"], state()["model"]["w"]) and got["path"] == str(path)
    assert set(got) == {"meta", "path", "model", "recent_ids"} and got.get("id_maps") is None
    assert json.loads(path.with_suffix(".json").read_text())["samples_trained"] == 100  # the sidecar
    assert ck.latest_meta(tmp_path)["path"] == str(path)


@pytest.mark.parametrize("damage", [b"{not json", b"\xff\xfe", b"[1, 2]", b"[" * 100_000],  # (deeper than json goes)
                         ids=["not-json", "not-utf8", "not-an-object", "nested-too-deep"])
def test_latest_meta_passes_over_a_damaged_newest_sidecar_to_the_next_older_one(tmp_path: Path, damage: bytes,
                                                                               caplog: pytest.LogCaptureFixture
                                                                               ) -> None:
    """``streamrec train --status`` read the newest sidecar with ``json.loads`` and printed a traceback for a torn or
    edited one; it now reports the next older checkpoint and says which sidecar it passed over."""
    older = ck.save(tmp_path, state(), meta(), keep=3)
    newer = ck.save(tmp_path, state(), {**meta(), "samples_trained": 200}, keep=3)
    newer.with_suffix(".json").write_bytes(damage)
    got = ck.latest_meta(tmp_path)
    assert got is not None and got["path"] == str(older) and got["samples_trained"] == 100
    assert newer.name in caplog.text
    older.with_suffix(".json").write_bytes(damage)
    assert ck.latest_meta(tmp_path) is None


@given(st.one_of(st.binary(max_size=200), st.text(max_size=50).map(str.encode),
                 st.sampled_from([b"[" * 5000, b'{"a":' * 5000, b"1" * 5000, b"{}", b"null"])))
@settings(max_examples=50, deadline=None, database=None)
def test_any_sidecar_bytes_are_a_meta_object_or_passed_over(damage: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        newest = ck.save(Path(d), state(), meta())
        newest.with_suffix(".json").write_bytes(damage)
        got = ck.latest_meta(Path(d))
        assert got is None or (isinstance(got, dict) and got["path"] == str(newest))


def test_a_version_1_checkpoint_is_upgraded_with_the_shaping_settings_it_implies(tmp_path: Path) -> None:
    old = meta()
    del old["shape"]
    old["format_version"] = 1
    path = tmp_path / "ckpt-000000000000100-1.pt"
    torch.save({"meta": old, **state()}, path)
    got = ck.load_latest(tmp_path, safe=True)
    assert got is not None and got.format_version == ck.FORMAT_VERSION
    assert got.shape == {k: v for k, v in shape_of(LS).items() if k in got.shape}
    assert {"mlp", "embedding_dim", "buckets", "id_capacity", "ctx_buckets", "sparse_optimizer"} <= set(got.shape)


def test_a_version_2_checkpoint_reads_with_no_delta_seq_and_a_new_one_keeps_its_own(tmp_path: Path) -> None:
    """Version 3 records the last serving delta a checkpoint includes (an artifact of it counts the deltas pruned
    after it); a version-2 file, from before, reads as not knowing it."""
    old = meta()
    old["format_version"] = 2
    torch.save({"meta": old, **state()}, tmp_path / "ckpt-000000000000100-1.pt")
    got = ck.load_latest(tmp_path, safe=True)
    assert got is not None and got.format_version == ck.FORMAT_VERSION == 3 and got.meta["delta_seq"] is None
    ck.save(tmp_path, state(), meta(200, delta_seq=7))
    got = ck.load_latest(tmp_path, safe=True)
    assert got is not None and got.samples_trained == 200 and got.meta["delta_seq"] == 7


def test_a_newer_or_unversioned_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    torch.save({"meta": {**meta(), "format_version": ck.FORMAT_VERSION + 1}, **state()}, tmp_path / "ckpt-1-1.pt")
    with pytest.raises(ck.CheckpointError, match="reads up to") as info:
        ck.load_latest(tmp_path)
    assert isinstance(info.value, StreamrecError)  # the CLI prints it as one line
    with pytest.raises(ck.CheckpointError, match="no valid format_version"):
        ck.upgrade({"meta": {"samples_trained": 1}}, tmp_path / "x.pt")


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_and_is_reported(tmp_path: Path) -> None:
    first = ck.save(tmp_path, state(), meta(100))
    second = ck.save(tmp_path, state(), meta(200))
    second.write_bytes(second.read_bytes()[:100])  # torn
    problems: list[tuple[Path, str]] = []
    got = ck.load_latest(tmp_path, safe=True, problems=problems)
    assert got is not None and got.path == first and [p for p, _ in problems] == [second]


def test_with_an_accept_check_a_refused_or_newer_newest_checkpoint_falls_back_like_a_torn_one(tmp_path: Path) -> None:
    """The refresh's policy (``accept``): a newest file that loads but is refused (here: by the check, and one of a
    newer format) is skipped and reported as a torn one is; without ``accept`` the newer format stays an error (the
    learner must not resume from an older file past it)."""
    first = ck.save(tmp_path, state(), meta(100))
    refused = ck.save(tmp_path, state(), meta(200))
    newer = tmp_path / "ckpt-000000000000300-1.pt"
    torch.save({"meta": {**meta(300), "format_version": ck.FORMAT_VERSION + 1}, **state()}, newer)

    def accept(c: ck.Checkpoint) -> None:
        if c.samples_trained == 200:
            raise ValueError("weights hold NaN")

    problems: list[tuple[Path, str]] = []
    got = ck.load_latest(tmp_path, safe=True, problems=problems, accept=accept)
    assert got is not None and got.path == first
    assert [p for p, _ in problems] == [newer, refused]
    assert "reads up to" in problems[0][1] and problems[1][1] == "ValueError: weights hold NaN"
    with pytest.raises(ck.CheckpointError, match="reads up to"):
        ck.load_latest(tmp_path, safe=True)


class _Payload:
    def __reduce__(self):  # noqa: ANN204 - what a hostile pickle does
        return (print, ("code ran",))


def test_a_safe_load_runs_no_code_and_keep_prunes_old_files_with_their_sidecars(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "ckpt-000000000000001-1.pt"
    torch.save({"meta": {**meta(), "format_version": ck.FORMAT_VERSION}, "model": _Payload()}, bad)
    problems: list[tuple[Path, str]] = []
    assert ck.load_latest(tmp_path, safe=True, problems=problems) is None
    assert problems and problems[0][1].startswith("UnpicklingError") and "code ran" not in capsys.readouterr().out
    bad.unlink()
    paths = [ck.save(tmp_path, state(), meta(i), keep=2) for i in (1, 2, 3)]
    assert ck.list_checkpoints(tmp_path) == paths[1:]
    assert not paths[0].with_suffix(".json").exists()


_FILL_THE_DISK = """
import errno, resource, signal, sys
from pathlib import Path
import torch
from learner import checkpoint as ck
directory = Path(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit write(2) fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    ck.save(directory, {"model": {"w": torch.zeros(1000, 100)}}, {"samples_trained": 200})
except OSError as exc:
    print("OSError", errno.errorcode.get(exc.errno, exc.errno))
except Exception as exc:
    print(type(exc).__name__, str(exc)[:200])
else:
    print("saved")
"""


def test_a_checkpoint_that_fills_the_disk_raises_its_os_error_not_torchs_runtime_error(tmp_path: Path) -> None:
    """A real failed write(2) inside torch.save (a file-size limit: EFBIG, as ENOSPC on a full disk) is the
    ``OSError`` the daemon survives a periodic checkpoint on; torch's zip writer made it ``RuntimeError: ...
    unexpected pos``, which stopped the daemon at every checkpoint while the disk stayed full. The previous
    checkpoint stays the newest and no temp file is left."""
    import subprocess
    import sys

    first = ck.save(tmp_path, state(), meta(100))
    out = subprocess.run([sys.executable, "-c", _FILL_THE_DISK, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[3])
    assert out.stdout.strip() == "OSError EFBIG", out.stdout + out.stderr[-2000:]
    assert ck.list_checkpoints(tmp_path) == [first]
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("fails", [".json", ".pt"])
def test_a_save_whose_second_file_fails_leaves_the_previous_pair_for_both_the_restart_and_the_status(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: str) -> None:
    """The ``.pt`` was written first, its sidecar second: a sidecar that failed (ENOSPC) left the new ``.pt`` in
    place, so the save raised (exit 1 at the learner's exit) while a restart resumed from it, and ``--status`` (the
    sidecars) named the older checkpoint. Whichever file fails now, the save raises and leaves nothing of itself: the
    restart and the status both read the previous checkpoint, and the next save succeeds with no orphan left."""
    first = ck.save(tmp_path, state(), meta(100))
    real = checkpoint_write.write_atomic

    def full_disk(target: Path, data: object) -> None:
        if target.suffix == fails:
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        real(target, data)  # type: ignore[arg-type]

    with monkeypatch.context() as m:
        m.setattr(checkpoint_write, "write_atomic", full_disk)
        with pytest.raises(OSError, match="No space"):
            ck.save(tmp_path, state(), meta(200))
    restored = ck.restore_latest(tmp_path)
    assert restored is not None and (restored.path, restored.samples_trained) == (first, 100)
    status = ck.latest_meta(tmp_path)
    assert status is not None and (status["path"], status["samples_trained"]) == (str(first), 100)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == sorted([first.name, first.with_suffix(".json").name])
    later = ck.save(tmp_path, state(), meta(300))
    assert ck.list_checkpoints(tmp_path) == [first, later] and later.with_suffix(".json").exists()


def test_a_bit_flipped_inside_the_newest_checkpoints_weights_fails_its_crc_and_the_previous_one_is_used(
        tmp_path: Path) -> None:
    """torch.load does not check the zip's CRC-32s: a byte damaged on disk inside a tensor loaded as a model with a
    wrong weight, resumed by the learner and published by the refresh, silently. It is a damaged file now."""
    weights = {"model": {"w": torch.zeros(50_000)}, "recent_ids": []}
    first = ck.save(tmp_path, weights, meta(100))
    second = ck.save(tmp_path, weights, meta(200))
    raw = bytearray(second.read_bytes())
    raw[raw.index(bytes(4096)) + 2048] = 0x7F  # one byte in the middle of w's zeros
    second.write_bytes(bytes(raw))
    problems: list[tuple[Path, str]] = []
    got = ck.load_latest(tmp_path, safe=True, problems=problems)
    assert got is not None and got.path == first and not got["model"]["w"].any()
    assert [p for p, _ in problems] == [second] and "CRC-32" in problems[0][1]
    with pytest.raises(ValueError, match="is damaged: Bad CRC-32"):
        ck.load(second)


def test_the_temp_file_of_a_checkpoint_write_that_was_killed_is_removed_by_the_next_save(tmp_path: Path) -> None:
    """A learner SIGKILLed while writing a checkpoint leaves ``.ckpt-....pt.tmp-<pid>-<thread>`` (up to a whole
    checkpoint: 440 MB in the audit's run), which nothing removed: every such kill leaked one until the disk was
    full. The next save removes those of dead writers and of its own pid (a container's learner is pid 1 after
    every restart); a live other writer's file, and other files, are left alone."""
    import os
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    killed = tmp_path / f".ckpt-000000000000100-1.pt.tmp-{dead_pid}-139"
    earlier_me = tmp_path / f".ckpt-000000000000150-1.pt.tmp-{os.getpid()}-139"
    live = tmp_path / f".ckpt-000000000000160-1.pt.tmp-{os.getppid()}-139"
    other = tmp_path / f".strikes.json.tmp-{dead_pid}-139"
    for f in (killed, earlier_me, live, other):
        f.write_bytes(bytes(1000))
    first = ck.save(tmp_path, state(), meta(200))
    assert not killed.exists() and not earlier_me.exists()
    assert live.exists() and other.exists()
    assert ck.list_checkpoints(tmp_path) == [first]


@pytest.mark.parametrize("accept", [None, lambda c: None], ids=["learner", "refresh"])
def test_checkpoints_pruned_by_the_learner_while_being_read_are_not_reported_damaged_and_the_newest_is_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accept) -> None:
    """The learner saves (and prunes its oldest) while the refresh reads: every file listed can be gone by the time
    it is opened. A file pruned under the reader is no damaged file: the reader lists again and takes the newest
    one, reporting nothing (before, each vanished file was a ``problem``, the refresh fell back past it to older
    ones that were pruned too and failed "no checkpoint loads", or published from behind with a degraded alert)."""
    for n in (100, 200, 300):
        ck.save(tmp_path, state(), meta(n), keep=3)
    real = checkpoint_read.load
    saved: list[Path] = []

    def learner_saves_meanwhile(path: Path, safe: bool = True) -> dict:
        if not saved:  # the first read: the learner writes three newer checkpoints, pruning all three listed
            saved.extend(ck.save(tmp_path, state(), meta(n), keep=3) for n in (400, 500, 600))
        return real(path, safe)

    monkeypatch.setattr(checkpoint_read, "load", learner_saves_meanwhile)
    problems: list[tuple[Path, str]] = []
    got = ck.load_latest(tmp_path, safe=True, problems=problems, accept=accept)
    assert got is not None and got.path == saved[-1] and got.samples_trained == 600
    assert problems == []


@pytest.mark.parametrize("keep", [1, 2])
def test_pruning_keeps_the_checkpoint_just_written_and_keep_good_ones_behind_a_damaged_newest_file(
        tmp_path: Path, keep: int) -> None:
    """The newest file is damaged, so the learner resumes from the one before and writes checkpoints numbered below it.
    Pruning counted the damaged file among the ``keep`` newest: with keep 1 each new checkpoint was deleted as soon as
    it was written (only the damaged file was left: no checkpoint loaded at the next start), with keep 2 one good
    checkpoint stayed instead of two."""
    ck.save(tmp_path, state(), meta(100), keep=3)
    resumed = ck.save(tmp_path, state(), meta(200), keep=3)
    damaged = ck.save(tmp_path, state(), meta(300), keep=3)
    damaged.write_bytes(damaged.read_bytes()[:100])
    assert ck.restore_latest(tmp_path).path == resumed  # type: ignore[union-attr]
    written = [ck.save(tmp_path, state(), meta(n), keep=keep) for n in (250, 260)]
    assert ck.list_checkpoints(tmp_path) == [*written[-keep:], damaged]  # the damaged file is left alone
    assert ck.restore_latest(tmp_path).path == written[-1]  # type: ignore[union-attr]


@pytest.mark.parametrize("part, value", [("model", float("nan")), ("model", float("inf")),
                                         ("sparse_opt", float("nan")), ("dense_opt", float("-inf"))])
def test_a_newest_checkpoint_with_non_finite_weights_or_optimizer_state_is_refused_and_the_previous_one_used(
        tmp_path: Path, part: str, value: float) -> None:
    """A checkpoint whose CRCs match but whose model or optimizer state holds a NaN or an inf (written by a training
    that blew up, or crafted) loaded as the model and was trained on: every later loss NaN, every step skipped. It
    is a damaged file like a torn one: reported, and the previous checkpoint used; alone, the learner refuses it."""
    good = {"model": {"w": torch.ones(4)}, "sparse_opt": {"state": {0: {"sum": torch.ones(4)}}, "param_groups": []},
            "dense_opt": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4)}}, "param_groups": []},
            "recent_ids": []}
    first = ck.save(tmp_path, good, meta(100))
    bad = {k: v for k, v in good.items()}
    bad[part] = {"model": {"w": torch.tensor([1.0, value, 1.0, 1.0])},
                 "sparse_opt": {"state": {0: {"sum": torch.tensor([1.0, value, 1.0, 1.0])}}, "param_groups": []},
                 "dense_opt": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.tensor([value, 0, 0, 0])}},
                               "param_groups": []}}[part]
    second = ck.save(tmp_path, bad, meta(200))
    problems: list[tuple[Path, str]] = []
    got = ck.load_latest(tmp_path, safe=True, problems=problems)
    assert got is not None and got.path == first
    assert [p for p, _ in problems] == [second] and "non-finite" in problems[0][1] and part in problems[0][1]
    first.unlink()
    with pytest.raises(ck.CheckpointError, match="non-finite"):
        ck.restore_latest(tmp_path)


def _directory_fsync_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """os.fsync of a directory's descriptor fails (EIO); a file's goes through."""
    import os

    fsync = failing_directory_fsync()  # a directory's fsync fails (EIO)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_checkpoint_whose_directory_fsync_fails_after_the_rename_is_in_place_not_known_durable_and_prunes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rename was done, so a restart reads the new checkpoint; the save raised the directory fsync's OSError before
    the sidecar, as a failed write. Now both files are written, NotDurable (an OSError) says so, and the older ones are
    kept whatever ``keep`` says: a power loss may undo the new one's rename."""
    from stream.files import NotDurable

    older = [ck.save(tmp_path, state(), meta(i), keep=1) for i in (1, 2)]
    _directory_fsync_fails(monkeypatch)
    with pytest.raises(NotDurable, match=r"is in place, but the fsync of its directory failed"):
        ck.save(tmp_path, state(), meta(3), keep=1)
    listed = ck.list_checkpoints(tmp_path)
    assert listed[:-1] == older[1:] and len(listed) == 2  # the one before it kept
    got = ck.load_latest(tmp_path)
    assert got is not None and got.samples_trained == 3 and ck.latest_meta(tmp_path)["path"] == str(listed[-1])


def test_a_checkpoint_whose_directory_cannot_be_listed_after_its_rename_is_saved_not_a_failed_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The listing of the prune after the ``.pt`` rename raises EIO. Before, the OSError escaped save(): the learner
    counted a checkpoint a restart reads as a failed one (checkpoint failures, no group offsets committed)."""
    older = ck.save(tmp_path, state(), meta(1), keep=1)
    real = ck.list_checkpoints

    def unlistable(directory: Path) -> list[Path]:
        raise OSError(errno.EIO, "Input/output error", str(directory))

    monkeypatch.setattr(checkpoint_write, "list_checkpoints", unlistable)
    path = ck.save(tmp_path, state(), meta(2), keep=1)
    monkeypatch.setattr(checkpoint_write, "list_checkpoints", real)
    assert path.exists() and ck.list_checkpoints(tmp_path) == [older, path]  # nothing pruned, nothing lost
    got = ck.load_latest(tmp_path)
    assert got is not None and got.samples_trained == 2
    ck.save(tmp_path, state(), meta(3), keep=1)  # the next save prunes them
    assert len(ck.list_checkpoints(tmp_path)) == 1


def test_a_first_checkpoint_whose_lineage_files_directory_fsync_fails_is_a_failed_write_not_one_in_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The LINEAGE file is written before the checkpoint: its NotDurable must not pass for the checkpoint's."""
    from stream.files import NotDurable

    _directory_fsync_fails(monkeypatch)
    with pytest.raises(OSError, match=r"LINEAGE is in place") as err:
        ck.save(tmp_path, state(), meta(1))
    assert not isinstance(err.value, NotDurable) and ck.list_checkpoints(tmp_path) == []


def test_a_save_whose_prune_cannot_list_the_directory_is_counted_in_prune_failures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only logged before: a directory that cannot be listed for days grew by a checkpoint a save, with no metric."""
    from prometheus_client import REGISTRY

    def count() -> float:
        return REGISTRY.get_sample_value("streamrec_learner_prune_failures_total", {"directory": "checkpoints"}) or 0.0

    ck.save(tmp_path, state(), meta(1), keep=1)
    before = count()

    def unlistable(directory: Path) -> list[Path]:
        raise OSError(errno.EIO, "Input/output error", str(directory))

    monkeypatch.setattr(checkpoint_write, "list_checkpoints", unlistable)
    ck.save(tmp_path, state(), meta(2), keep=1)
    monkeypatch.undo()
    assert count() == before + 1
    ck.save(tmp_path, state(), meta(3), keep=1)  # pruned: not counted
    assert count() == before + 1
