"""Checkpoints of the distributed mode: sharded state with torch.distributed.checkpoint (DCP), and the reshard
to one process that the nightly refresh and a single-process learner read.

A checkpoint is a directory ``<checkpoint_dir>/dcp-<samples:015d>-<ms>/``:

    .metadata, __<rank>_0.distcp   DCP: ``model`` (the row-wise sharded table, each rank writing its rows, and
                                   the dense part, written once), ``table_state`` (fbgemm's row-wise Adagrad sums,
                                   sharded with their rows), ``dense_opt`` (Adam's state by parameter name)
    rank-<r>.pt                    rank r's own small state (progressive metrics, recent impression ids, delayed
                                   feedback counts, its shares of the id maps):
                                   tensors, numpy arrays and plain values, loaded weights-only
    meta.json                      what every rank agreed on: samples trained by all ranks, the offset of EVERY
                                   samples partition (gathered from the ranks that read them), rows per
                                   partition, the feature and model config, the shaping settings, world size;
                                   ``sha256``: of ``.metadata`` and every DCP data file (:func:`checksums`)

All ranks write into ``.tmp-<name>`` at one step boundary (the lock-step's checkpoint round); only after DCP's
save returned on every rank (its metadata is written by rank 0 once every rank's shards are) and every rank's
``rank-<r>.pt`` is durable does rank 0 write ``meta.json`` and rename the directory into place. A rank killed
in between leaves a ``.tmp-`` directory, which no load reads (the next save removes it): the previous checkpoint
stays the newest. Pruned checkpoints are renamed ``.tmp-<name>`` before they are deleted (:func:`_prune`). On a
restart every rank reads the newest complete directory; with the same world size each rank gets its own
``rank-<r>.pt`` back, with another one the per-rank states are merged (metrics summed into rank 0, recent ids
given to every rank) and DCP reshards the table to the new row ranges. The directory must be one filesystem
every rank sees (one machine, or a shared mount across hosts).

:func:`unshard` is the reshard to one process: it loads the newest DCP checkpoint without a process group into
full-size tensors, builds the single-process ``DeepFM`` and optimizers from them, and writes an ordinary
checkpoint (``learner/checkpoint.py``) into another directory: ``streamrec refresh`` builds and validates a
serving artifact from it, and a single-process ``streamrec train`` resumes from it at the same offsets.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from os import PathLike
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from learner import checkpoint, checkpoint_read
from learner.delayed import DelayedFeedbackWeights
from learner.distributed import all_gather_objects, broadcast_object
from learner.features import FeatureConfig
from learner.kafka_dataset import worker_died
from learner.progressive import ProgressiveMetrics
from stream.errors import ConfigError
from stream.files import NotDurable, fsync_dir, sha256_file, write_atomic

log = logging.getLogger("streamrec.checkpoint")
T = TypeVar("T")

PREFIX = "dcp-"
META = "meta.json"
FORMAT_VERSION = 1


def list_complete(directory: Path) -> list[Path]:
    """Complete sharded checkpoints, oldest first."""
    if not Path(directory).is_dir():
        return []
    found = (p for p in Path(directory).glob(f"{PREFIX}*") if p.is_dir() and (p / META).is_file())
    return checkpoint.newest_last(found, PREFIX)


def describe_newest(directory: Path) -> str | None:
    """"newest dcp-..., written by N ranks" of the newest complete sharded checkpoint in ``directory`` (the rank count
    left out when its meta cannot be read), for a process that cannot use it to say what it found; None: none."""
    done = list_complete(directory)
    if not done:
        return None
    try:
        ranks = f" by {_read_meta(done[-1], directory)['world_size']} ranks"
    except (OSError, checkpoint.CheckpointError):
        ranks = ""
    return f"newest {done[-1].name}, written{ranks} under torchrun"


def latest(directory: Path, verify: bool = True, restore: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """(path, meta) of the newest complete sharded checkpoint, None when there is none. Collective under a process
    group (every rank calls it: :func:`lost_parts`). ``verify=False`` (``streamrec train --status``): every part's
    presence and size checked, no data file read (its sha256 costs about 1 s per 800 MiB). ``restore`` (the ranks'
    restore, :func:`unshard`): every field they read present too (:func:`_bad_field`)."""
    done = list_complete(directory)
    _same_newest(done, directory)
    if not done:
        return None
    meta = _read_meta(done[-1], directory)
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise checkpoint.CheckpointError(f"sharded checkpoint {done[-1]} has format {meta['format_version']}, this "
                                         f"streamrec reads up to {FORMAT_VERSION}: upgrade streamrec")
    lost = lost_parts(done[-1], meta, verify)
    if lost:  # rank 0 wrote meta.json only once every part was durable: they went missing or were damaged since
        raise checkpoint.CheckpointError(
            f"sharded checkpoint {done[-1]} (written by {meta.get('world_size')} ranks) lacks {', '.join(lost)}: "
            f"its files were lost or damaged after it was written; move it out of {directory} to resume from (or "
            "unshard) the one before it")
    if restore and (missing := [n for n in RESTORED if n not in meta]):
        raise _damaged(done[-1], directory, f'\'s "{missing[0]}" is missing')
    return done[-1], meta


def _same_newest(done: list[Path], directory: Path) -> None:
    """Collective under a process group: the same CheckpointError on every rank unless every rank lists the same
    newest complete checkpoint (``done``: this rank's listing). Each rank took its own newest: a rank on a host whose
    shared mount did not list the newest one yet (NFS caches a directory's listing for up to a minute, and torchrun
    restarts the group within seconds of the save) resumed another checkpoint's shards and offsets than the others
    (its partitions trained twice), or, listing none, started a fresh model in collectives the others never entered;
    the others' checksum check mixed two checkpoints' files and called the newest one damaged."""
    seen = all_gather_objects(done[-1].name if done else None)
    if any(s != seen[0] for s in seen[1:]):
        raise checkpoint.CheckpointError(
            f"the ranks do not list the same newest sharded checkpoint in {directory}: " + ", ".join(
                f"rank {r} {s or 'none'}" for r, s in enumerate(seen)) + ". checkpoint_dir must be one directory "
            "every rank sees as it is: a shared mount whose listing lags on some host (NFS's attribute cache) shows "
            "it late; restart once every host lists the same (torchrun --max-restarts does), or mount it with a "
            "shorter attribute cache (actimeo)")


def _read_meta(path: Path, directory: Path) -> dict[str, Any]:
    """``path``'s ``meta.json``: a JSON object whose fields :func:`_bad_field` passes, else a CheckpointError naming
    the reason (torn, not JSON, another shape, a field's: a raw JSONDecodeError, AttributeError, ValueError or
    KeyError ended the restore, ``--unshard`` and ``train --status``)."""
    try:
        meta = json.loads((path / META).read_bytes())
    except (ValueError, RecursionError) as exc:  # (JSONDecodeError, UnicodeDecodeError: both ValueErrors)
        reason = f" is not JSON ({type(exc).__name__}: {str(exc)[:120]})"
    else:
        if not isinstance(meta, dict):
            reason = f" holds a {type(meta).__name__}, not a JSON object"
        elif (bad := _bad_field(meta)) is None:
            return meta
        else:
            reason = f"'s {bad}"
    raise _damaged(path, directory, reason)


def _damaged(path: Path, directory: Path, reason: str) -> checkpoint.CheckpointError:
    return checkpoint.CheckpointError(
        f"sharded checkpoint {path}: its {META}{reason}: it was torn or edited after it was written; move it out of "
        f"{directory} to resume from (or unshard) the one before it")


_FIELDS = {"world_size": (1, True), "samples_trained": (0, True), "format_version": (0, False),  # (least, required)
           "steps": (0, False), "duplicates": (0, False), "metrics_window": (1, False), "delta_seq": (0, False)}
# What the ranks' restore and unshard read besides: every sharded checkpoint ever written records each
# (`git log -p learner/sharded_daemon.py`); `train --status` and the part checks print or need none of them.
RESTORED = ("steps", "offsets", "partition_rows", "duplicates", "feature_config", "model", "shape", "topic", "lineage")


def _bad_field(meta: dict[str, Any]) -> str | None:
    """What is wrong with the fields of a ``meta.json`` (an integer of at least its least value; ``format_version``
    absent: read as 0; ``delta_seq`` may be null; partition -> integer maps; a feature config and model settings that
    build); None: sound. Those of :data:`RESTORED` may be absent here (:func:`latest`'s ``restore`` requires them);
    ``sha256``: :func:`_bad_sums`. A mistyped one ended the restore and ``--unshard`` in a raw KeyError, TypeError or
    ValueError deep inside them."""
    try:  # the counts as the single-process checkpoint reads its own (a bool is no count)
        for name, (least, required) in _FIELDS.items():
            if name not in meta:
                if required:
                    return f'"{name}" is missing'
            elif not (name == "delta_seq" and meta[name] is None):
                checkpoint.count(meta, name, least)
        for name in (n for n in ("offsets", "partition_rows") if n in meta):
            checkpoint.partition_counts(meta, name)
    except ValueError as exc:
        return str(exc)
    return checkpoint.mistyped(meta) or _bad_configs(meta)


def _bad_configs(meta: dict[str, Any]) -> str | None:
    """Why ``meta``'s feature config or model settings do not build what the restore and unshard build from them;
    None: they do (or are absent)."""
    for name, build in (("feature_config", FeatureConfig.from_dict), ("model", _model_settings)):
        try:
            if name in meta:
                build(meta[name])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return f'"{name}" is {str(meta[name])[:80]!r} ({type(exc).__name__}: {str(exc)[:120]})'
    return None


def _model_settings(ms: dict[str, Any]) -> None:
    """Raises what :func:`unshard` would on ``meta["model"]`` (the ranks' restore takes today's settings)."""
    from learner.config import ModelConfig

    ModelConfig.from_meta(ms)
    for key in ("lr_sparse", "lr_dense", "dropout", "boost", "boost_half_life", "initial_accumulator"):
        float(ms[key] if key.startswith("lr_") else ms.get(key, 0.0))
    int(ms.get("seed", 0))


def _data_ends(path: Path) -> dict[str, int]:
    """Every DCP data file ``.metadata`` names -> the end of its last item (bytes)."""
    ends: dict[str, int] = {}
    for info in dcp.FileSystemReader(str(path)).read_metadata().storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return ends


def _digests(path: Path, names: list[str]) -> dict[str, str]:
    """Collective (one process: alone): the sha256 of each of ``names`` (the same list on every rank) in ``path``,
    the i-th read by rank i mod world only, so N ranks read a checkpoint once between them, not N times; a file
    that cannot be read is ``unreadable (<error>)``."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = {}
    for name in names[rank::world]:
        try:
            mine[name] = sha256_file(path / name)
        except OSError as exc:
            mine[name] = f"unreadable ({type(exc).__name__})"
    return {k: v for part in all_gather_objects(mine) for k, v in part.items()}


def checksums(path: Path) -> dict[str, str]:
    """Collective: the sha256 of ``.metadata`` and of every DCP data file it names, by name (:func:`_digests`):
    rank 0 records them in ``meta.json`` at save (every rank's shards are durable by then), :func:`lost_parts`
    checks them."""
    return _digests(path, _summed(path))


def _summed(path: Path) -> list[str]:
    """The files :func:`checksums` hashes: ``.metadata`` and every DCP data file it names (not collective)."""
    return [".metadata", *sorted(_data_ends(path))]


def lost_parts(path: Path, meta: dict[str, Any], verify: bool = True) -> list[str]:
    """The files of a checkpoint's parts that ``path`` lacks, holds shorter than DCP's metadata says they are, or
    holds with another sha256 than ``meta["sha256"]`` records (a file of the same size from another step, copied
    in; a checkpoint written before the checksums: sizes only): every rank's ``rank-<r>.pt``, ``.metadata`` and
    every DCP data file it names. Empty: every part is there (a rank's missing ``rank-<r>.pt`` or DCP shard ended
    the restore and ``--unshard`` in a FileNotFoundError or EOFError). Collective under a process group: each rank
    reads its share of the files (:func:`_digests`). A ``sha256`` entry that is not a mapping of this checkpoint's
    files to sha256 hex strings (hand-edited, another tool's) is a damaged ``meta.json``, named with the reason
    (:func:`_bad_sums`): it raised a TypeError or ValueError, or read a file it named outside the checkpoint.
    ``verify=False``: no sha256 compared (sizes only; no rank reads a data file)."""
    lost = [f"rank-{r}.pt" for r in range(int(meta.get("world_size", 0))) if not (path / f"rank-{r}.pt").is_file()]
    sums, check = meta.get("sha256"), []
    try:
        ends = _data_ends(path)
    except Exception as exc:  # noqa: BLE001 - missing, torn or foreign: named, whatever the unpickler raised
        ends, sums = {}, {}
        lost.append(f".metadata ({type(exc).__name__})")
    if sums is None:  # (absent: written before the checksums)
        sums = {}
    if (bad := _bad_sums(sums, {".metadata", *ends})) is not None:
        lost.append(f"{META} (its sha256 entry {bad}: not a mapping of file -> sha256 hex; hand-edited or written "
                    "by another tool)")
        sums = {}
    if not verify:
        sums = {}
    for name in sorted({*ends, *sums}):
        f = path / name
        if not f.is_file():
            lost.append(name)
        elif f.stat().st_size < ends.get(name, 0):
            lost.append(f"{name} ({f.stat().st_size} of its {ends[name]} bytes)")
        elif name in sums:
            check.append(name)
    got = _digests(path, check)  # (every rank calls it once, whatever it found)
    return lost + [f"{n} ({got[n]})" if got[n].startswith("unreadable") else
                   f"{n} (its sha256 is not the one recorded at save: another checkpoint's file?)"
                   for n in check if got[n] != sums[n]]


_HEX = re.compile(r"[0-9a-f]{64}")


def _bad_sums(sums: Any, files: set[str]) -> str | None:
    """What is wrong with a meta's ``sha256`` entry (``files``: the checkpoint's files it may name); None: sound."""
    if not isinstance(sums, dict):
        return f"is a {type(sums).__name__}"
    for name, digest in sums.items():
        if name not in files:
            return f"names {str(name)[:80]!r}, no file of this checkpoint"
        if not (isinstance(digest, str) and _HEX.fullmatch(digest)):
            return f"gives {name} {str(digest)[:80]!r}, not 64 hex digits"
    return None


def dense_opt_state(opt: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, dict[str, torch.Tensor]]:
    """Adam's state keyed by parameter name (``names``: id(param) -> name); parameters without state yet get
    zeros, so every rank and every load has the same keys."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            out[names[id(p)]] = {"exp_avg": st.get("exp_avg", torch.zeros_like(p)),
                                 "exp_avg_sq": st.get("exp_avg_sq", torch.zeros_like(p)),
                                 "step": torch.as_tensor(st.get("step", 0.0), dtype=torch.float32).reshape(())}
    return out


class _RecordedWrites(FileSystem):
    """DCP's file system, remembering each file's first failed write (``checkpoint.WriteErrors``): torch's zip writer
    may turn a full disk into its own ``RuntimeError`` (``checkpoint.torch_save``), which :func:`_own_failure` gives
    back as the write's ``OSError``."""

    def __init__(self) -> None:
        super().__init__()
        self.files: list[checkpoint.WriteErrors] = []

    @contextmanager
    def create_stream(self, path: str | PathLike[str], mode: str) -> Generator[Any, None, None]:
        with super().create_stream(path, mode) as fh:
            if "r" in mode:
                yield fh
            else:
                self.files.append(rec := checkpoint.WriteErrors(fh))  # type: ignore[arg-type]
                yield rec


def _own_failure(exc: BaseException, rank: int, fs: _RecordedWrites | None = None) -> BaseException | None:
    """This rank's own error in ``exc`` (a DCP ``CheckpointException`` names every failed rank's, the same on every
    rank: None when this rank's part succeeded), a write's ``OSError`` that torch raised as its own error as that
    ``OSError``."""
    if isinstance(exc, CheckpointException):
        own = exc.failures.get(rank)
        if own is None:
            return None
        exc = own[0]
    written = next((f.error for f in fs.files if f.error is not None), None) if fs is not None else None
    return written if written is not None and not isinstance(exc, OSError) else exc


def _agree(error: BaseException | None, rank: int, tmp: Path) -> None:
    """Collective, at each stage of :func:`save` where a rank wrote on its own: every rank learns whether any rank's
    write failed, so every rank goes on (or stops) together and none waits in a collective for a rank that left. A
    failure on any rank: rank 0 removes the ``.tmp-`` directory (never complete: it has no ``meta.json``) and every
    rank raises the same error: an ``OSError`` (the first failed rank's errno; the daemon skips the checkpoint and
    tries again at the next interval) when every failure was one, else a RuntimeError (the job stops)."""
    told = all_gather_objects(None if error is None else
                              (isinstance(error, OSError), getattr(error, "errno", None),
                               getattr(error, "filename", None), f"{type(error).__name__}: {str(error)[:300]}"))
    failed = [(r, t) for r, t in enumerate(told) if t is not None]
    if not failed:
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    what = "; ".join(f"rank {r}: {t[3]}" for r, t in failed)
    if all(t[0] for _, t in failed):
        raise OSError(failed[0][1][1], f"sharded checkpoint {tmp.name[5:]} not written ({what})",
                      failed[0][1][2]) from error
    raise RuntimeError(f"sharded checkpoint {tmp.name[5:]} failed ({what})") from error


def save(directory: Path, app_state: dict[str, Any], rank_state: dict[str, Any], meta: dict[str, Any],
         rank: int, keep: int = 3) -> Path:
    """Collective: every rank calls it at the same step boundary with its ``app_state`` (DCP: tensors and
    ShardedTensors) and ``rank_state``; ``meta`` is rank 0's (the agreed, gathered values). Returns the path.

    A write that fails on any rank (a full disk, a read-only directory) fails the checkpoint on EVERY rank, with the
    same ``OSError`` (:func:`_agree`), before any rank treats it as done; the previous checkpoint stays the newest.
    A failure of another kind is a RuntimeError on every rank. (It was raised on the rank that failed only, as torch's
    ``CheckpointException``, a BaseException, from DCP's write, and the other ranks waited in a barrier.)

    A DataLoader worker's death that DCP did not gather from every rank (as its ``CheckpointException``) is raised on
    this rank at once, without the agreement: torch raises it from its SIGCHLD handler wherever the rank is, possibly
    between two of DCP's collectives outside its error handling (the plan's gather), so this rank may be out of step
    with the others' collectives. Taken into the agreement's
    all-gather while rank 0 still waited in DCP's gather, it stalled the job for ``collective_timeout_s`` (10 minutes
    by default) until gloo timed out; leaving, it closes its connections and the others fail at once.

    A directory's fsync after a rename failing on any rank (``rank-<r>.pt``, ``meta.json``, the checkpoint's own) is
    :class:`NotDurable` on every rank once the checkpoint is in place (:func:`_say_unsure`): written, and read at
    restart, but not known to survive a power loss; nothing is pruned (as one process's ``checkpoint.save``)."""
    directory = Path(directory)
    error: BaseException | None = None
    unsure: NotDurable | None = None  # this rank's write in place whose directory's fsync failed
    # (a listing that fails on rank 0, EIO or ESTALE on its mount, raised there alone, before the broadcast: the
    # daemon took it for a failed checkpoint and went on to its next round while the others waited in the broadcast)
    name = f"{PREFIX}{int(meta['samples_trained']):015d}-unnamed"  # rank 0's listing failed: its .tmp- never made
    if rank == 0:
        try:
            name = checkpoint.checkpoint_name(PREFIX, int(meta["samples_trained"]),
                                              [p.name for p in list_complete(directory)])
        except OSError as exc:
            error = exc
    name = broadcast_object(name)
    tmp, final = directory / f".tmp-{name}", directory / name
    if rank == 0 and error is None:
        for stale in directory.glob(f".tmp-{PREFIX}*"):  # left by a group that died mid-save: never complete
            shutil.rmtree(stale, ignore_errors=True)
        try:
            tmp.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            error = exc
    _agree(error, rank, tmp)
    fs = _RecordedWrites()
    writer = dcp.FileSystemWriter(str(tmp))
    writer.fs = fs
    try:
        dcp.save(app_state, checkpoint_id=str(tmp), storage_writer=writer)  # its errors: on every rank alike
        rank_state = {**rank_state, "checkpoint": name}  # which checkpoint it is part of (rank_states checks it)
        unsure = _written(tmp / f"rank-{rank}.pt", lambda fh: checkpoint.torch_save(rank_state, fh))
        names = _summed(tmp)  # read before the agreement: a rank that cannot raised alone, outside every collective
    except (Exception, CheckpointException) as exc:
        if worker_died(exc):  # not gathered by DCP: maybe out of step with the others' collectives (docstring)
            raise
        error = _own_failure(exc, rank, fs)
    _agree(error, rank, tmp)  # every rank's shards and own state are durable
    sums = _digests(tmp, names)  # checksums (each rank reads its share)
    if rank == 0:
        try:  # (LINEAGE's write too: raised on rank 0 alone, the other ranks waited in the agreement below for ever)
            meta = {**meta, "format_version": FORMAT_VERSION, "created": time.time(),
                    "lineage": meta.get("lineage") or checkpoint.lineage(directory), "sha256": sums}
            unsure = _written(tmp / META, json.dumps(meta, default=str).encode()) or unsure
            tmp.rename(final)
        except OSError as exc:
            error = exc
        else:
            try:
                fsync_dir(directory)
            except OSError as exc:  # a complete checkpoint, whose offsets match its model: in place, not durable
                unsure = NotDurable(exc.errno, f"{final} is in place, but the fsync of its directory failed "
                                               f"({exc.strerror}): whether the rename survives a power loss is unknown")
    _agree(error, rank, tmp)
    _say_unsure(unsure, final)
    if rank == 0:  # (after the agreement: not while a power loss may undo this one's rename)
        _prune(directory, keep)
    return final


def _prune(directory: Path, keep: int) -> None:
    """Remove the complete checkpoints but the newest ``keep``: each renamed ``.tmp-<name>`` first (no longer
    listed), then deleted, so a process killed while deleting one leaves a ``.tmp-`` directory, which the next save
    removes. Deleted in place, a kill after its ``meta.json`` went (rmtree's order is the directory's) left a
    ``dcp-`` directory that is no checkpoint and was never pruned: every such kill leaked a whole table on disk. One
    that cannot be renamed (EPERM, EROFS) is logged and counted, and kept. A directory that cannot be listed now (EIO)
    is logged and counted too, as one process's prune: raised, it left the save on rank 0 alone with the checkpoint in
    place (a failed checkpoint counted there only, no offsets committed, rank 0's exit failed beside ranks that had
    finished)."""
    try:
        listed = list_complete(directory)
    except OSError as exc:
        checkpoint.PRUNE_FAILURES.labels("checkpoints").inc()
        log.warning("cannot list %s to prune it (%s); the next checkpoint prunes it", directory, exc)
        return
    for old in listed[:-keep]:
        doomed = directory / f".tmp-{old.name}"
        try:
            old.rename(doomed)
        except OSError as exc:
            checkpoint.PRUNE_FAILURES.labels("checkpoints").inc()
            log.warning("cannot prune %s (%s); move it away", old, exc)
            continue
        shutil.rmtree(doomed, ignore_errors=True)  # (what stays is removed by the next save)


def _written(path: Path, data: bytes | Callable[[BinaryIO], object]) -> NotDurable | None:
    """:func:`write_atomic` of a part of a checkpoint; its :class:`NotDurable` returned, not raised: the part is in
    place, so the checkpoint goes on (and :func:`_say_unsure` says so at its end)."""
    try:
        write_atomic(path, data)
    except NotDurable as exc:
        return exc
    return None


def _say_unsure(unsure: NotDurable | None, final: Path) -> None:
    """Collective, once the checkpoint ``final`` is in place: a :class:`NotDurable` (``filename``: ``final``) on every
    rank when any rank's write had one, so every rank counts it written and none commits offsets for it."""
    told = all_gather_objects(None if unsure is None else f"{unsure.strerror or unsure}"[:300])
    failed = [(r, t) for r, t in enumerate(told) if t is not None]
    if failed:
        raise NotDurable(unsure.errno if unsure is not None else None,
                         f"sharded checkpoint {final.name} not known durable ("
                         + "; ".join(f"rank {r}: {t}" for r, t in failed) + ")", str(final)) from unsure


def load(path: Path, app_state: dict[str, Any]) -> None:
    """Collective: fill ``app_state`` (the same layout :func:`save` got) in place from ``path``, resharded by DCP
    to this world's row ranges."""
    dcp.load(app_state, checkpoint_id=str(path))


def holds(path: Path, key: str) -> bool:
    """Whether the DCP checkpoint at ``path`` has ``key`` (a flattened name, e.g. ``table_state.updates``)."""
    return key in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def rank_states(path: Path, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``rank-<r>.pt`` of the checkpoint (weights-only loads). One written for another checkpoint (copied
    in) is a CheckpointError: its id map shares name rows of another table (states from before the name: unchecked).
    So is one that does not load (torn, emptied, damaged: no checksum covers it): a raw RuntimeError or EOFError from
    torch's reader ended the ranks' restore and ``--unshard``, naming neither the file nor the fix."""
    states = [_rank_state(path, r) for r in range(int(meta["world_size"]))]
    for r, st in enumerate(states):
        if st.get("checkpoint", path.name) != path.name:
            raise checkpoint.CheckpointError(
                f"sharded checkpoint {path}: rank-{r}.pt was written for {st['checkpoint']!r}, not for this one: a "
                f"file copied in from another checkpoint; move {path} out of {path.parent} to resume from the one "
                "before it")
    return states


@contextmanager
def state_loaded(path: Path) -> Generator[None, None, None]:
    """Around the ranks' restore of their states from ``rank_states``: a ValueError (a value no training makes, which
    the state's ``load_state_dict`` refuses: negative counts, a rate outside (0, 1), a histogram of another length) is
    a CheckpointError naming the checkpoint, the state and the value, and the fix. Raised bare, it named neither the
    checkpoint nor what to do, and loaded, each such value broke every batch after it (its messages struck). A field
    of another type or a missing one (a TypeError, a KeyError, an IndexError, an AttributeError: a list where a map
    belongs, read with ``.get``) is as damaged; a failed collective (a RuntimeError: a rank gone) is not the
    checkpoint's fault and is raised as it is."""
    try:
        yield
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise checkpoint.CheckpointError(
            f"sharded checkpoint {path} is damaged: {checkpoint_read._reason(exc)}; move it out of {path.parent} to "
            "resume from (or unshard) the one before it") from None


def loaded_together(path: Path, load: Callable[[], T]) -> T:
    """Collective: ``load()`` (this rank's part of a restore, with no collective in it) under :func:`state_loaded` on
    every rank, then a CheckpointError on EVERY rank when it raised on any, naming that rank and its reason; else
    what ``load()`` returned. Raised on the refusing rank alone (a value only rank 0 reads: its calibration, quality
    metrics, clock; or one rank's own metrics), that rank left while the others went on into the next collective and
    waited there for it until the collective timeout (10 minutes), failing with a timeout that named neither the
    checkpoint nor the fix."""
    error: checkpoint.CheckpointError | None = None
    try:
        with state_loaded(path):
            loaded = load()
    except checkpoint.CheckpointError as exc:
        error = exc
    failed = [(r, why) for r, why in enumerate(all_gather_objects(None if error is None else str(error))) if why]
    if error is not None:
        raise error
    if failed:
        raise checkpoint.CheckpointError(f"rank {failed[0][0]} refused it: {failed[0][1]}")
    return loaded


def _rank_state(path: Path, rank: int) -> dict[str, Any]:
    """``rank-<rank>.pt`` of the checkpoint at ``path`` (a weights-only load); one that does not load is a
    CheckpointError naming it and the fix (out of memory is raised as it is: no fault of the file)."""
    try:
        return checkpoint.load(path / f"rank-{rank}.pt")
    except checkpoint_read._NOT_DAMAGE:
        raise
    except Exception as exc:  # noqa: BLE001 - torn or corrupt: named, whatever torch's reader raised
        raise checkpoint.CheckpointError(
            f"sharded checkpoint {path}: rank-{rank}.pt does not load ({checkpoint_read._reason(exc)}): it was torn or "
            f"damaged after it was written; move {path} out of {path.parent} to resume from (or unshard) the one "
            "before it") from exc


def interleaved_newest(lists: Sequence[Sequence[T]]) -> list[T]:
    """Several ranks' items (each oldest first) as one list, oldest first, whose every newest cut holds an equal share
    of each where each has enough (interleaved from the newest back): the ranks' recent ids in ``--unshard``'s
    checkpoint (loaded by one process with its own ``dedup_window``; ``learner.daemon.RecentIds.load_merged`` cuts
    to a known one) and the ranks' metric windows (:func:`merged_metrics`). Their concatenation, cut to a window,
    kept the last rank's alone."""
    newest_first: list[T] = []
    for k in range(max((len(items) for items in lists), default=0)):
        newest_first.extend(items[-1 - k] for items in lists if k < len(items))
    return newest_first[::-1]


def merged_metrics(states: list[dict[str, Any]], window: int) -> ProgressiveMetrics:
    """The progressive metrics of all ranks as one (histograms and sums added; the window: every rank's newest
    samples in turn, :func:`interleaved_newest`)."""
    out = ProgressiveMetrics(window=window)
    parts = [s["metrics"] for s in states if s.get("metrics")]
    if not parts:
        return out
    out.load_state_dict(parts[0])
    windows = [out._window_arrays()]  # ((n_r,) probs, (n_r,) labels) of each rank, oldest first
    for d in parts[1:]:
        other = ProgressiveMetrics(window=window)
        other.load_state_dict(d)
        out.pos = out.pos + other.pos
        out.neg = out.neg + other.neg
        out.loss_sum += other.loss_sum
        out.count += other.count
        windows.append(other._window_arrays())
    starts = np.cumsum([0] + [len(p) for p, _ in windows])
    picked = np.asarray(interleaved_newest([range(a, b) for a, b in zip(starts[:-1], starts[1:], strict=True)]),
                        np.int64)[-window:]  # (<= window,) every rank's newest, into the concatenation
    probs, labels = (np.concatenate(arrays)[picked] for arrays in zip(*windows, strict=True))
    out._recent.clear()
    if len(probs):
        out._recent.append((probs, labels))
    out._recent_n = len(probs)
    return out


def aggregate_metrics(metrics: ProgressiveMetrics) -> ProgressiveMetrics:
    """Collective: this rank's metrics merged with every other rank's (what the summary and meta report)."""
    return merged_metrics([{"metrics": s} for s in all_gather_objects(metrics.state_dict())], metrics.window)


def unshard(src: Path, dst: Path, keep: int = 3, setting: str = "--unshard") -> Path:
    """The newest sharded checkpoint in ``src`` as one single-process checkpoint in ``dst`` (module docstring);
    no process group needed. Returns the written checkpoint's path.

    ``dst`` must be a directory this process can write (made when missing): else a ConfigError naming ``setting``
    and the path, before anything is loaded (``checkpoint.check_directory``). A regular file there, or a directory
    nobody may write, ended ``streamrec train --unshard`` in a traceback from ``checkpoint.save``, after the whole
    sharded checkpoint had been loaded.

    The data files are read twice, as at a restore: whole, for their sha256 (:func:`latest`), then by DCP's load,
    which reads each item's byte range in its own order (hashing within that read would take a StorageReader of our
    own, and a file would be half loaded before it was refused); the second read comes from the page cache when
    the checkpoint fits in memory, and an unshard runs once per export.

    ``dst``'s ``LOCK`` (``checkpoint.hold_directory``) is held while it is written: a learner training there is a
    ConfigError naming ``setting``, the path and its pid. Without it the unshard wrote beside a running learner, its
    save pruned that learner's checkpoints, the refresh served the other training as the newest, and the learner's
    restart resumed it."""
    if list_complete(dst):  # (dst == src too) the single-process checkpoint would sit beside the sharded ones, and
        # `streamrec train --status`, which reads single-process checkpoints first, would report it for good
        raise checkpoint.CheckpointError(f"{dst} holds sharded checkpoints (dcp-*): unshard into another directory, "
                                         "one for single-process checkpoints")
    checkpoint.check_directory(Path(dst), setting)
    try:
        lock = checkpoint.hold_directory(Path(dst))
    except ConfigError as exc:
        raise ConfigError(f"{setting} {dst}: {exc}") from None
    try:
        return _unshard(src, dst, keep)
    finally:
        checkpoint.release_directory(lock)


def _unshard(src: Path, dst: Path, keep: int) -> Path:
    """:func:`unshard`'s work, ``dst`` checked and held."""
    from learner.config import ModelConfig
    from learner.model import DeepFM
    from learner.optim import make_optimizers
    from learner.sharded_ids import whole_maps
    from learner.sharded_model import TABLE_KEY, padded_width, state_scale

    found = latest(src, restore=True)
    if found is None:
        raise checkpoint.CheckpointError(f"no complete sharded checkpoint (dcp-*/meta.json) in {src}")
    path, meta = found
    cfg = FeatureConfig.from_dict(meta["feature_config"])
    ms = meta["model"]
    d, w = cfg.embedding_dim, padded_width(cfg.embedding_dim)
    model = DeepFM(cfg, mlp=ModelConfig.from_meta(ms).mlp, dropout=float(ms.get("dropout", 0.0)),
                   seed=int(ms.get("seed", 0)), autocast_dtype=None)
    sparse_opt, dense_opt = make_optimizers(model, ms["lr_sparse"], ms["lr_dense"], "rowwise_adagrad",
                                            initial_accumulator=ms.get("initial_accumulator", 0.0),
                                            boost=float(ms.get("boost", 0.0)),
                                            boost_half_life=float(ms.get("boost_half_life", 0.0)))
    dense_names = {id(p): n for n, p in model.named_parameters() if not n.startswith("sparse.")}
    key = TABLE_KEY
    app_state: dict[str, Any] = {
        "model": {key: torch.zeros(cfg.num_rows, w),
                  **{n: torch.zeros_like(p) for n, p in model.named_parameters() if not n.startswith("sparse.")}},
        "table_state": {"momentum1": torch.zeros(cfg.num_rows),
                        **({"updates": torch.zeros(cfg.num_rows, dtype=torch.int32)}
                           if holds(path, "table_state.updates") else {})},
        "dense_opt": dense_opt_state(dense_opt, dense_names),
    }
    dcp.load(app_state, checkpoint_id=str(path), no_dist=True)
    c = state_scale(d)
    with torch.no_grad():
        model.sparse.bag.weight.copy_(app_state["model"][key][:, :d + 1])  # (num_rows, D + 1): padding dropped
        for n, p in model.named_parameters():
            if not n.startswith("sparse."):
                p.copy_(app_state["model"][n])
    table = model.sparse.bag.weight
    sparse_opt.state[table]["sum"] = app_state["table_state"]["momentum1"] / c  # fbgemm's sum, as learner/optim's
    if "updates" in app_state["table_state"]:  # the boost's update counts (learner/sharded_boost.py)
        sparse_opt.state[table]["updates"] = app_state["table_state"]["updates"].to(torch.int32)
    for p in (p for g in dense_opt.param_groups for p in g["params"]):
        st = app_state["dense_opt"][dense_names[id(p)]]
        if float(st["step"]) > 0:
            dense_opt.state[p] = {"step": st["step"].clone(), "exp_avg": st["exp_avg"].clone(),
                                  "exp_avg_sq": st["exp_avg_sq"].clone()}
    states = rank_states(path, meta)
    calibration = states[0].get("calibration") if states else None  # rank 0's fit (learner/sharded_daemon.py)
    if calibration:
        with torch.no_grad():  # the served (a, b), as the single-process learner keeps it in the model
            model.get_buffer("calibration").copy_(torch.tensor([float(calibration["a"]), float(calibration["b"])]))
    metrics = merged_metrics(states, window=int(meta.get("metrics_window", 100_000)))
    recent = interleaved_newest([s.get("recent_ids", []) for s in states])  # every rank's newest in any window
    state = {"model": model.state_dict(), "sparse_opt": sparse_opt.state_dict(), "dense_opt": dense_opt.state_dict(),
             "metrics": metrics.state_dict(), "recent_ids": recent,
             "id_maps": whole_maps(cfg, states)}  # every rank's parts as one map per field (learner/sharded_ids.py)
    # each rank counted its own rows' delayed feedback: one process over all of them counts their sum
    state["delayed_weights"] = DelayedFeedbackWeights.merged([s.get("delayed_weights") or {} for s in states])
    # rank 0's alone (learner/sharded_daemon.py): the quality metrics, the id maps' bucket share and calibration, the
    # base-rate bias and the dense gradient clip's history (every rank's equal), the event clock of every rank's rows
    for key in ("cold_users", "cold_metrics", "warm_metrics", "served", "id_metrics", "base_rate_bias",
                "calibration", "event_clock", "dense_clip"):
        if states and states[0].get(key):
            state[key] = states[0][key]
    plain = {k: meta[k] for k in ("samples_trained", "steps", "offsets", "partition_rows", "duplicates",
                                  "feature_config", "model", "shape", "topic", "lineage")}
    plain["metrics"] = metrics.summary()
    plain["delta_seq"] = meta.get("delta_seq")  # (absent from sharded checkpoints written before it)
    plain.update(checkpoint.topic_recorded(meta))  # which samples topic the offsets are of
    plain["resharded_from"] = {"path": str(path), "world_size": int(meta["world_size"])}
    out = checkpoint.save(Path(dst), state, plain, keep=keep)
    log.info("unsharded %s (%d ranks) into %s", path, meta["world_size"], out)
    return out
