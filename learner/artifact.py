"""The serving artifact: what the learner's checkpoint becomes, ``cache_refresh`` publishes and ``serving`` loads.

The one file format those stages share, so it lives in ``learner/`` beside the checkpoints and deltas it is
built from. This module holds the layout of a publish root (below), builds an artifact (:func:`build_artifact`) and
opens, verifies (:func:`verify`) and reads its files; the manifest, its checks and its signature are
``learner/artifact_manifest.py`` (its docstring, "Signatures"); the READERS of a publish root (``CURRENT``, the
versions, the rollback pin), the names and paths they accept and :class:`~learner.artifact_versions.ArtifactError`
are ``learner/artifact_versions.py`` (its docstring, "Paths" and "Errors"). Writing a root (publish, rollback,
pruning, the refresh lock, cleanup) is ``cache_refresh/publish.py``; the scorer module is ``learner/scorer.py``; the
loaded, scoring runtime is ``serving/model.py``.

Layout under a publish root::

    <root>/CURRENT                       the current version's name (replaced atomically)
    <root>/PINNED                        a rollback pin (JSON; cache_refresh/publish.py)
    <root>/versions/<version>/
        manifest.json                    version, created, source checkpoint (path, samples_trained,
                                         offsets, delta_seq: the last learner delta it includes, or
                                         null), feature_config, model settings, hot-set stats,
                                         format, scorer settings (``input_layout``: the scorer's input
                                         layout, learner/scorer.py; absent in artifacts from before the
                                         user-row layout, which serving still loads; 3 for the onnx
                                         formats' pooling graph), files {name:
                                         {sha256, bytes}},
                                         signature (when the refresh has a signing key)
        scorer.pt | scorer.pt2 | scorer_state.pt | scorer.safetensors | scorer.onnx + scorer.safetensors
                                         the scorer (torchscript | export | eager | safetensors | onnx: the
                                         graph and the tensors beside it, learner/onnx_scorer.py)
        cold_rows.npy                    float32 (num_rows, D + 1): the whole fused table (serving copies it)
        id_maps.pt | id_maps.pack        dynamic ids only: the learner's id maps (learner/row_mapper.py), a
                                         weights-only torch.save, or (safetensors and onnx artifacts) a
                                         learner.tensorpack: such an artifact unpickles nothing
    <root>/.staging/<version>-<pid>/     an artifact being built; never read by serving

Every file serving reads is listed in the manifest's ``files``, opened once and checked (regular file, one
link, size, sha256) on the open file, and loaded from that same open file (:func:`open_artifact`,
``serving.model.ScoringModel.load``): a file renamed over a listed one after its check is never what is loaded.
"""

from __future__ import annotations

import datetime as dt
import errno
import hashlib
import json
import math
import os
import shutil
import stat
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from learner.artifact_manifest import (
    ARTIFACT_FORMAT_VERSION,
    COLD_FILE,
    ID_MAPS_FILE,
    ID_MAPS_PACK,
    MANIFEST,
    SIGNATURE,
    canonical_manifest,
    check_checkpoint,
    check_signature,
    read_manifest,
)
from learner.artifact_versions import (
    STAGING,
    ArtifactError,
    check_version_dir,
    is_version_name,
    new_version_name,
    resolve_inside,
)
from learner.batch import to_tensors
from learner.config import parse_mlp
from learner.features import FeatureConfig
from learner.model import DeepFM
from learner.row_mapper import RowMapper
from learner.scorer import (
    CALIBRATED_FORMATS,
    FORMATS,
    ONNX_FORMATS,
    PICKLE_FREE_FORMATS,
    POOLING_GRAPH_LAYOUT,
    SCORER_EXTRA_FILES,
    SCORER_FILES,
    USER_ROW_LAYOUT,
    Scorer,
    ScorerSpec,
    hot_buffers,
    with_empty_user_row,
)
from learner.scorer_files import save_scorer
from learner.tensorpack import PackError, SigningKey, pack, unpack
from stream.files import finite_json, fsync_dir, open_entry, sha256_file, write_synced
from stream.samples import SampleBatch

__all__ = ["ArtifactFiles", "build_artifact", "eager_model", "map_table", "open_artifact", "read_id_maps", "read_table",
           "verify"]



# -- eager reference and model settings -----------------------------------------------------------
def eager_model(checkpoint: Mapping[str, Any]) -> DeepFM:
    """The learner's DeepFM in fp32 eval mode, rebuilt from a checkpoint (``learner.checkpoint_read.load_latest``).

    Built the way ``learner/daemon.py`` builds it (feature config and model settings from the meta),
    with autocast off: this is the reference an artifact's scores must equal.
    """
    meta = checkpoint["meta"]
    cfg = FeatureConfig.from_dict(meta["feature_config"])
    ms = meta["model"]
    model = DeepFM(cfg, mlp=parse_mlp(ms["mlp"]), dropout=float(ms.get("dropout", 0.0)), autocast_dtype=None)
    model.load_state_dict(checkpoint["model"])
    return model.eval()


def _dense_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in state.items() if not k.startswith("sparse.")}


# -- build -------------------------------------------------------------------------------------
def _calibration_feeds(checkpoint: Mapping[str, Any], cfg: FeatureConfig, scorer: Scorer, table: torch.Tensor,
                       batches: Sequence[SampleBatch] | None) -> list[dict[str, Any]]:
    """The pooling graph's feeds for ``batches``' samples as serving scores them (dynamic ids mapped by the
    checkpoint's id maps, each sample one candidate after an empty user row, cold rows from ``table``)."""
    if not batches or not any(len(b) for b in batches):
        raise ArtifactError("an onnx_int8_static artifact is calibrated on samples (its activation scales) and none "
                            "were given: build it with calibration samples (the refresh job takes the older part of "
                            "its holdout: [refresh] holdout_messages > 0), or build onnx_int8 (no calibration)")
    from learner import onnx_scorer  # imports onnxruntime: only for this format

    mapper = RowMapper.from_state(cfg, checkpoint.get("id_maps"), lookups_only=True)
    requests = []
    for batch in batches:
        tb = to_tensors(batch, cfg)
        mapper.apply(tb, 0.0, train=False)
        if len(tb):
            requests.append((tb.values.numpy(), with_empty_user_row(tb.offsets, cfg.num_fields).numpy(),
                             tb.dense.numpy()))
    return onnx_scorer.calibration_feeds(scorer, table.numpy(), requests)


def build_artifact(checkpoint: Mapping[str, Any], out_dir: Path, hot_rows: np.ndarray, format: str = "torchscript",
                   hot_stats: dict[str, Any] | None = None, version: str | None = None,
                   signing_key: SigningKey | None = None, between: Callable[[], object] | None = None,
                   calibration: Sequence[SampleBatch] | None = None) -> Path:
    """Stage a complete artifact for ``checkpoint`` under the publish root ``out_dir``; returns the staged dir.

    ``hot_rows`` (int64, any order, duplicates allowed) are global rows of the fused table placed in the
    scorer. The staged directory (``out_dir/.staging/<version>-<pid>``) is complete and fsynced when this
    returns; ``cache_refresh.publish.publish`` makes it a version. On error nothing is left behind. With
    ``signing_key`` the manifest carries its ``signature`` (``learner/artifact_manifest.py``, "Signatures").
    ``between`` (a caller's stop check) is called between the units of the build (the scorer saved, each file
    written, each file hashed): what it raises ends the build, its staged directory removed. ``calibration``:
    the samples a :data:`CALIBRATED_FORMATS` artifact (``onnx_int8_static``) is calibrated on, scored as serving
    scores them (the refresh job's older holdout samples); such a format without any is an ArtifactError.
    """
    between = between or (lambda: None)
    if format not in FORMATS:
        raise ArtifactError(f"unknown artifact format {format!r}; expected one of {', '.join(FORMATS)}")
    t0 = time.monotonic()
    root = Path(out_dir)
    cfg = check_checkpoint(checkpoint)
    meta = checkpoint["meta"]
    ms = meta["model"]
    spec = ScorerSpec(cfg.num_fields, cfg.embedding_dim, len(cfg.dense), parse_mlp(ms["mlp"]),
                      float(ms.get("dropout", 0.0)),
                      POOLING_GRAPH_LAYOUT if format in ONNX_FORMATS else USER_ROW_LAYOUT)
    state = checkpoint["model"]
    table = state["sparse.bag.weight"].detach().float().cpu().contiguous()  # (num_rows, D + 1)
    if tuple(table.shape) != (cfg.num_rows, cfg.embedding_dim + 1):
        raise ArtifactError(f"checkpoint {checkpoint.get('path')}: table shape {tuple(table.shape)} does not match "
                            f"its feature config ({cfg.num_rows}, {cfg.embedding_dim + 1})")
    try:
        hot_ids, hot_vectors = hot_buffers(table, hot_rows)
    except ValueError as exc:
        raise ArtifactError(str(exc)) from None
    scorer = Scorer(spec, hot_ids, hot_vectors)
    scorer.load_state_dict({**_dense_state(state), "hot_ids": hot_ids, "hot_vectors": hot_vectors})
    scorer.eval()
    feeds = _calibration_feeds(checkpoint, cfg, scorer, table, calibration) if format in CALIBRATED_FORMATS else None
    between()

    version = version or new_version_name(root=root)  # after every version already in root
    if not is_version_name(version):
        raise ArtifactError(f"version {version!r} is not a plain version name (letters, digits, . _ -)")
    staged = root / STAGING / f"{version}-{os.getpid()}"
    staged.mkdir(parents=True, exist_ok=False)
    try:
        scorer_file = SCORER_FILES[format]
        save_scorer(scorer, format, staged / scorer_file, spec, cfg, calibration=feeds)
        between()
        write_synced(staged / COLD_FILE, lambda fh: np.save(fh, table.numpy(), allow_pickle=False))
        between()
        names = [scorer_file, *SCORER_EXTRA_FILES.get(format, ()), COLD_FILE]
        if checkpoint.get("id_maps"):  # dynamic ids: serving maps raw ids to the rows the learner used
            if format in PICKLE_FREE_FORMATS:  # nothing of a safetensors (or onnx) artifact is a pickle
                data = pack(checkpoint["id_maps"])
                write_synced(staged / ID_MAPS_PACK, lambda fh: fh.write(data))
                names.append(ID_MAPS_PACK)
            else:
                write_synced(staged / ID_MAPS_FILE, lambda fh: torch.save(checkpoint["id_maps"], fh))
                names.append(ID_MAPS_FILE)
        files = {}
        for name in names:
            between()
            p = staged / name
            files[name] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        between()
        h = len(hot_ids) - 1
        manifest = {
            "artifact_format_version": ARTIFACT_FORMAT_VERSION,
            "version": version,
            "created": time.time(),
            "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "format": format,
            "source": {"checkpoint": checkpoint.get("path"), "samples_trained": meta.get("samples_trained"),
                       "lineage": meta.get("lineage"), "offsets": meta.get("offsets", {}), "topic": meta.get("topic"),
                       "metrics": meta.get("metrics", {}), "delta_seq": meta.get("delta_seq"),
                       "created": meta.get("created")},  # when the training state was saved: the model's age
            "feature_config": cfg.to_dict(),
            "model": {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in ms.items()},
            "scorer": spec.to_dict(),
            "hot_set": {**(hot_stats or {}), "rows": h, "share_of_table": h / max(1, cfg.num_rows),
                        "bytes": int(hot_vectors.numel() * 4)},
            "files": files,
            "build_seconds": round(time.monotonic() - t0, 3),
        }
        manifest = finite_json(manifest)  # strict JSON: a checkpoint's NaN AUC is null
        text = json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False)
        if signing_key is not None:  # sign what a reader parses back (JSON turns int keys into strings, ...)
            manifest = json.loads(text)
            manifest[SIGNATURE] = signing_key.sign(canonical_manifest(manifest))
            text = json.dumps(manifest, indent=2, sort_keys=True)
        write_synced(staged / MANIFEST, lambda fh: fh.write(text.encode()))
        fsync_dir(staged)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return staged


class ArtifactFiles:
    """The files a manifest lists, each opened once (:func:`open_artifact`): ``files[name]`` is that open file, at its
    start, the one its checks (and digest) were made on, so what is loaded from it is what was verified. Close it (a
    ``with`` block) once loaded: a memory map of one (:func:`map_table`) stays valid."""

    def __init__(self, version_dir: Path, manifest: dict[str, Any], opened: dict[str, BinaryIO]) -> None:
        self.version_dir, self.manifest, self._opened = version_dir, manifest, opened

    def __contains__(self, name: object) -> bool:
        return name in self._opened

    def __getitem__(self, name: str) -> BinaryIO:
        fh = self._opened[name]
        fh.seek(0)
        return fh

    def path(self, name: str) -> Path:
        """Where ``name`` was opened (for messages: the file loaded is the open one, never this path again)."""
        return self.version_dir / name

    def close(self) -> None:
        for fh in self._opened.values():
            fh.close()

    def __enter__(self) -> ArtifactFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_REPUBLISH = "republish with `streamrec refresh --now` or roll back"


def _open_dir(version_dir: Path) -> int:
    """A descriptor of ``version_dir``, checked to be the directory its path resolves to inside the directory holding
    it (:func:`resolve_inside`), so the files opened relative to it are entries of that directory."""
    try:
        fd = os.open(version_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ArtifactError(f"{version_dir} cannot be opened as a version directory ({exc})") from None
    try:
        target = resolve_inside(version_dir, version_dir.parent, f"a version directory must lie in "
                                                                  f"{version_dir.parent}")
        st, here = os.fstat(fd), os.stat(target)
        if (st.st_dev, st.st_ino) != (here.st_dev, here.st_ino):
            raise ArtifactError(f"{version_dir} was replaced while it was opened: refused; {_REPUBLISH}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_sha256(path: Path | str, got: str, want: str) -> None:
    if got != want:
        raise ArtifactError(f"{path}: sha256 {got[:16]}... does not match the manifest's {want[:16]}...: the file is "
                            f"corrupt; {_REPUBLISH}")


def _open_listed(dir_fd: int, path: Path, want: Mapping[str, Any], digest: bool, hash_now: bool = True) -> BinaryIO:
    """``path`` (a listed file) opened once relative to its directory's descriptor, not following a symlink, and
    checked on that descriptor: a regular file (a FIFO hung every loader's blocking open; ``/dev/zero`` was read
    without end), not a hard link (another path could change it after its check, before its load: the refresh writes
    every file afresh; copy a publish root, never ``cp -al``), and with ``digest`` the manifest's size and (unless not
    ``hash_now``: the loader hashes what it reads) sha256 read from it."""
    try:
        fd = open_entry(dir_fd, path.name)
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing (listed in the manifest): the artifact is incomplete") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ArtifactError(f"{path} is a symlink: artifact files are read only as plain files of their "
                                f"version directory; refused unread; {_REPUBLISH}") from None
        raise ArtifactError(f"{path} cannot be read ({exc}); check the publish root's permissions") from None
    fh = open(fd, "rb", closefd=True)  # noqa: SIM115 - the caller's (ArtifactFiles) to close
    fh.raw.name = str(path)  # type: ignore[attr-defined]  # (its name in loaders' messages: the path, not the fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)}): refused unread; "
                                f"{_REPUBLISH}")
        if st.st_nlink > 1:
            raise ArtifactError(f"{path} is a hard link ({st.st_nlink} names): another path could change it after "
                                "its check, before it is loaded; refused unread. Copy a publish root, never "
                                f"hard-link it; {_REPUBLISH}")
        os.set_blocking(fd, True)
        if digest:
            if st.st_size != want["bytes"]:
                raise ArtifactError(f"{path} has {st.st_size} bytes, the manifest says {want['bytes']}: the file is "
                                    f"truncated or was replaced; {_REPUBLISH}")
        if digest and hash_now:
            try:
                got = sha256_file(fh)
            except OSError as exc:
                raise ArtifactError(f"{path} cannot be read ({exc}); check the publish root's permissions") from None
            _check_sha256(path, got, want["sha256"])
    except BaseException:
        fh.close()
        raise
    return fh


def open_artifact(version_dir: Path, manifest: dict[str, Any] | None = None, signing_key: SigningKey | None = None,
                  digests: bool = True, hashed_on_read: Collection[str] = ()) -> ArtifactFiles:
    """Every file ``manifest`` lists (read, with ``signing_key`` its signature checked first, when not given), each
    opened once and checked on the open file (:func:`_open_listed`; with ``digests`` its size and sha256 too), as
    :class:`ArtifactFiles`: the loader reads those open files, so a file renamed over a listed one after its check is
    never what is loaded. ArtifactError for a version directory or a file that is a symlink or a path resolving outside
    where it belongs (``learner/artifact_versions.py``, "Paths"; a symlink inside the version directory is refused
    too: every file is opened without following one), missing, not a regular file, a hard link, or (``digests``) of
    another size or digest.

    ``hashed_on_read``: names whose sha256 the loader takes from the very bytes it reads (:func:`read_table` given the
    manifest's digest) instead of here, so that bytes rewritten in place between a check and the read are never what is
    loaded; their size is checked here all the same."""
    version_dir = check_version_dir(version_dir)
    if manifest is None:  # (the one-argument call without a key: tests wrap read_manifest)
        manifest = read_manifest(version_dir) if signing_key is None else read_manifest(version_dir, signing_key)
    elif signing_key is not None:
        check_signature(manifest, signing_key, version_dir / MANIFEST)
    dir_fd = _open_dir(version_dir)
    opened: dict[str, BinaryIO] = {}
    try:
        for name, want in manifest["files"].items():
            path = version_dir / name
            resolve_inside(path, version_dir, "artifact files must be files of their version directory")
            opened[name] = _open_listed(dir_fd, path, want, digests, hash_now=name not in hashed_on_read)
    except BaseException:
        for fh in opened.values():
            fh.close()
        raise
    finally:
        os.close(dir_fd)
    return ArtifactFiles(version_dir, manifest, opened)


def verify(version_dir: Path, manifest: dict[str, Any] | None = None,
           signing_key: SigningKey | None = None) -> dict[str, Any]:
    """Check every file's size and sha256 against the manifest (read and, with ``signing_key``, its signature
    checked first when not given); returns the manifest. ArtifactError as :func:`open_artifact` (which a loader
    calls instead, to load the files it checked)."""
    with open_artifact(version_dir, manifest, signing_key) as files:
        return files.manifest


def _table_header(fh: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran order, dtype, offset of the first value) of the ``.npy`` in ``fh``. ValueError for a file that
    is not an ``.npy`` of plain values (no pickles)."""
    fh.seek(0)
    version = np.lib.format.read_magic(fh)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
    else:
        raise ValueError(f".npy format version {version}, expected 1.0 or 2.0")
    if dtype.hasobject:
        raise ValueError(f"an .npy of {dtype} holds Python objects (pickles): refused")
    return shape, fortran, dtype, fh.tell()


def map_table(fh: BinaryIO) -> np.memmap:
    """The ``.npy`` table in the open file ``fh`` (``COLD_FILE``), memory-mapped read-only from that file (not copied,
    not opened again by path). ValueError for a file that is not an ``.npy`` of plain values (no pickles).

    A map reads the file as it is now: a row read after the file was truncated in place kills the process (SIGBUS),
    and bytes rewritten in place are read unverified. For loads that only read the table once (the layered mode's
    bucket rows, a refresh writing Redis); a table read per request is :func:`read_table`'s copy."""
    shape, fortran, dtype, offset = _table_header(fh)
    return np.memmap(fh, dtype=dtype, mode="r", shape=shape, order="F" if fortran else "C", offset=offset)


def read_table(fh: BinaryIO, sha256: str | None = None) -> np.ndarray:
    """The ``.npy`` table in the open file ``fh`` (``COLD_FILE``), read into this process's memory (read-only), so
    that nothing done to the file afterwards (truncated or rewritten in place) reaches what serving reads per
    request. ValueError as :func:`map_table`, and for a file shorter than its header says (naming both sizes).

    ``sha256``: the manifest's digest of the file, checked on the bytes read (the header, the table as copied, any
    bytes past it): an ArtifactError when they differ (``open_artifact(hashed_on_read=...)``). One read of the file
    instead of a hash pass and a copy pass, and no moment between the check and the read. A file refused for what its
    bytes say (its header, its size) before that is refused for its digest when that does not match: a header damaged
    in place was otherwise reported as a truncated file, the manifest's digest never named."""
    try:
        shape, fortran, dtype, offset = _table_header(fh)
        want = offset + math.prod(shape) * dtype.itemsize
        if (size := os.fstat(fh.fileno()).st_size) < want:  # before allocating what a header claims
            _short_table(fh, size, want, shape, dtype)
        table = np.empty(shape, dtype, order="F" if fortran else "C")
        into: Any = (table.T if fortran else table).reshape(-1).view(np.uint8)  # (bytes,) a view: the table, file order
        got = 0
        while got < len(into) and (n := os.preadv(fh.fileno(), [into[got:]], offset + got)):
            got += n
        if got < len(into):  # truncated while it was read
            _short_table(fh, offset + got, want, shape, dtype)
    except ValueError:
        if sha256 is not None:  # the whole file hashed (this error path only): not the manifest's, said so
            _check_sha256(getattr(fh, "name", COLD_FILE), _digest_around(fh.fileno(), 0, b""), sha256)
        raise
    if sha256 is not None:
        _check_sha256(getattr(fh, "name", COLD_FILE), _digest_around(fh.fileno(), offset, into), sha256)
    table.flags.writeable = False
    return table


def _digest_around(fd: int, offset: int, body: Any) -> str:
    """The sha256 of the file ``fd`` whose bytes ``offset`` .. ``offset + len(body)`` were read into ``body``: its
    header read again, ``body`` itself (the bytes loaded), then whatever follows it in the file."""
    h = hashlib.sha256(os.pread(fd, offset, 0))
    h.update(body)
    at = offset + len(body)
    while chunk := os.pread(fd, 8 << 20, at):
        h.update(chunk)
        at += len(chunk)
    return h.hexdigest()


def _short_table(fh: BinaryIO, size: int, want: int, shape: tuple[int, ...], dtype: np.dtype) -> None:
    raise ValueError(f"{getattr(fh, 'name', COLD_FILE)} holds {size} bytes, its .npy header says {want} ({shape} "
                     f"{dtype}): the file is truncated; {_REPUBLISH}")


def read_id_maps(files: ArtifactFiles) -> dict[str, Any] | None:
    """The id maps the manifest lists (``id_maps.pack``: a tensorpack, nothing unpickled; ``id_maps.pt``: a
    weights-only ``torch.load``), read from the files :func:`open_artifact` opened (and checked), or None when it
    lists none. ArtifactError when the file does not load or holds no object."""
    if ID_MAPS_PACK in files:
        path = files.path(ID_MAPS_PACK)
        try:
            state = unpack(files[ID_MAPS_PACK].read())
        except (PackError, OSError) as exc:
            raise ArtifactError(f"{path}: cannot load the id maps ({exc})") from None
    elif ID_MAPS_FILE in files:
        path = files.path(ID_MAPS_FILE)
        try:
            state = torch.load(files[ID_MAPS_FILE], map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - unpickling errors, torn zips, I/O: a bad artifact
            raise ArtifactError(f"{path}: cannot load the id maps ({type(exc).__name__}: {str(exc)[:300]})") from None
    else:
        return None
    if not isinstance(state, dict):
        raise ArtifactError(f"{path}: holds a {type(state).__name__}, expected the id maps object")
    return state
