"""Deltas: what the learner changed since the last one, so serving stays fresh between nightly refreshes.

    learner                                            serving
    trained batch --mark(values)--> touched (num_rows,) bool
    every deltas_every_s: delta-<seq>-<samples>.delta --->  DeltaReader.newer(seq, samples, lineage) -> apply
                          + PUBLISH <prefix>:model-deltas <seq>   (wakes serving; it also polls the directory)

One delta file (format 2) is a :mod:`learner.tensorpack`: a sha256 over the whole content, a JSON header
and raw tensor bytes, loaded without unpickling anything. Signed deltas: a learner with a signing key
(``signing_key_file``, :func:`learner.tensorpack.load_signing_key`) writes signed packs (container format
2: an HMAC-SHA256 over the file's bytes); a reader with a key (serving with ``signing_key_file``) refuses
every delta that is unsigned or whose HMAC does not match, before decoding any of it (a :class:`DeltaError`,
rejected like every bad delta). A reader without a key reads signed and unsigned deltas alike. Its tree::

    kind             "streamrec-delta"
    format           2
    seq              int, 1, 2, ... (continues across restarts after the largest seq its lineage ever used)
    samples_trained  the learner's sample count when it was written
    lineage          the learner's checkpoint lineage (``learner/checkpoint.py``), or null when unknown
    created          unix time, seconds
    rows             (R,) int64       every row of the fused table touched since the previous delta
    vectors          (R, D + 1) f32   their current values (embedding + first-order weight), absolute
    dense_state      {name: tensor}   every non-embedding weight of the model (MLP, bias), absolute
    id_maps          (optional)       the learner's id maps (learner/row_mapper.py), at most every
                                      id_maps_every_s: ids admitted after the artifact get their own rows

Values are absolute, not increments: applying deltas in ``seq`` order over any model that is at least as
old as the first one gives the learner's current rows. A delta at or below the seq an artifact's source checkpoint
records (``delta_seq``) is in that artifact or of a training that checkpoint abandoned, and is skipped by name; one
above it was written after the checkpoint and applies whatever its ``samples_trained``. Only for an artifact that
records no seq (and applied no delta yet) does ``samples_trained`` decide (not greater than its source's: in it).
Deciding by samples alone skipped every delta of a learner that fell back past a damaged newest checkpoint whose
artifact serving ran (its counts start below that checkpoint's), the resend below with them: serving kept the rows
and ids of a training the learner no longer had. Such a learner (its restore went back past newer checkpoint files)
resends every row with its first delta (:meth:`DeltaWriter.resend_all`), so serving ends on its state. A delta
of another lineage (a learner restarted from scratch, another learner's directory) never applies to an
artifact whose manifest names a different lineage; when either side has none (files written before
lineages existed, a writer built without one), ``samples_trained`` alone decides.

Numbering: a seq is never used twice by one checkpoint lineage, even when the deltas directory is emptied or
replaced (a new volume, an operator's ``rm``) while the checkpoints stay: before a delta takes a new seq, the
writer records it in ``<checkpoint_dir>/DELTA_SEQ`` (beside ``LINEAGE``; :data:`SEQ_FILE`), and a writer starts
after the larger of that and the directory's largest file. Serving, which skips every delta at or below the seq it
applied, would otherwise skip a restarted numbering without a word; it also notices a stream that went backwards
anyway (a learner from before this file, another directory) and re-bases (:meth:`DeltaReader.newer`). A restored
learner removes the deltas numbered past its checkpoint's ``delta_seq`` (:meth:`DeltaWriter.abandon_after`): they are
of the training the restore threw away, and an artifact of a later checkpoint mistook them for such a restart. The rows
they carry are marked first, so its first delta sends them with its values (serving may have applied them), and the
range is recorded in the deltas directory's :data:`ABANDONED` before any goes: a reader missing them lost nothing and
counts no gap (:func:`read_abandoned`).

Writing: the file goes to a temporary name, is fsynced, renamed into place, and the directory fsynced,
so a reader never sees half of one; the last ``keep`` are kept (a reader that falls further behind than
that waits for the next artifact for the rows it missed, and counts the gap). Format-1 files (plain
``torch.save``, ``delta-*.pt``, no checksum) are no longer read; a writer continues their numbering.

Pending rows survive a restart: every row marked since the last delta is also appended (once, as int64)
to ``pending-rows.i64`` in the deltas directory, which is removed once the next delta is durable. A writer
started on the directory marks the rows it lists again, so the first delta after a restart carries them,
with the restarted model's values; without it, rows trained between the last delta and a checkpoint
would reach serving only with the next full artifact (the restarted learner never trains them again).
Sending a row again is always harmless (values are absolute), so the list is read whatever the
restarted learner's checkpoint, lineage or seq: nothing about ``seq`` (it continues after the largest
one used), ``samples_trained`` (the learner's count when the delta is written) or ``lineage`` changes. The
daemon fsyncs the list with every checkpoint (:meth:`DeltaWriter.sync`), so each row trained before a
durable checkpoint is in a delta or in the list; rows trained after it are trained again on restart. (A list
that cannot be synced is logged and the checkpoint still written: a side output never holds training's state back.)
At a clean exit the daemon writes one last delta just before its final checkpoint (same ``samples_trained``:
an artifact of that checkpoint already holds it and skips it by name, and the checkpoint's ``delta_seq`` includes
it, so a fresh model that never saw it counts no gap when it is pruned unread).

Id maps after a restart: a restored learner's id maps are its checkpoint's, while serving may hold the maps and rows
of deltas written after that checkpoint (a row given from id A to id B and trained as B's). The restore marks every
admitted id's row (``RowMapper.owned_rows``; on N ranks each rank its shares', ``ShardedRowMapper.owned_rows``), and the
first delta after it carries the maps (they are due at a writer's start), so serving gets the maps together with every
row they give an id: no id is left on a row that holds another id's vector (the reverse of :meth:`DeltaWriter.hold`).
Its size: (8 + 4 (D + 1)) bytes per admitted id on top of the maps: measured, 117 MB per million admitted ids at
D = 16 (the maps alone 41 MB), so about 1.2 GB for 10 M; past the reader's limit it goes out in parts (below).

Parts: the reader refuses unread a file over :data:`MAX_BYTES` (the one limit, read by writer and reader alike) and
skips it for good, so a delta that would be larger (the resend above at ~35 M ids, or any long interval's rows) is
written as several, seq after seq, each within it, all with the same ``samples_trained`` (an artifact holds all or
none of them) and the dense weights. Serving applies a delta's maps and rows at once, so neither order of plain parts
is safe: the maps first put ids on rows still holding the vectors other ids left there, the rows first give the ids
serving's old maps put there the new ids' vectors. So the first part carries the maps with no id admitted
(``id_map.without_admitted``: every id on its bucket, a shared vector that is nobody's own), the parts after it rows
only, and the last the real maps with the last rows: no id reads an own row between the first part and the last,
and when it does again every row the maps give it has arrived. (Admitted ids score on their buckets meanwhile; a
part whose write fails leaves serving there until the retry, which sends the rows still marked and the maps.)

Reading (:class:`DeltaReader`, :func:`load_delta`): a delta is checked whole before any of it is used:
where it lies (a file that is a symlink resolving outside its directory is refused unread; the file is opened once,
in its directory, without following a symlink, and checked and read from that descriptor), checksum,
signature (with a key), structure and types, ``seq``/``samples_trained`` equal to its file name, rows 1-D int64,
vectors (R, D + 1) float32, dense weights floating and every value finite. A file that fails is a
:class:`DeltaError`, rejected once (remembered by path, size and mtime), reported through ``on_reject``
and skipped: the deltas after it still apply. A read that fails for want of a resource of the reading process
(:data:`TRANSIENT_ERRNOS`, ``MemoryError``) says nothing of the file: it ends the round there and is retried on the
next (:data:`TRANSIENT_TRIES`); so is a delta whose application failed so (the caller's word,
:meth:`DeltaReader.retry_apply`). What a skipped delta carried is lost until a later delta touches the same rows
again (dense weights: the very next delta, since each carries them whole) or the next full artifact arrives.
Whether a delta fits a particular model (row range, dimensions, dense names and shapes) is checked by
``ScoringModel.apply_delta`` before it changes anything.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import math
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prometheus_client import Counter as PCounter
from torch import nn

from learner import checkpoint as ckpt_io
from learner.id_map import without_admitted
from learner.tensorpack import ALIGN, PackError, SignatureError, SigningKey, is_signed, load_signing_key, pack, unpack
from stream.config import RedisSettings
from stream.errors import StreamrecError
from stream.files import MAX_STATE_FILE_BYTES, fsync_dir, open_entry, open_regular, read_regular, write_atomic
from stream.secrets import Secret

log = logging.getLogger("streamrec.deltas")
DELTA_WRITE_FAILURES = PCounter("streamrec_learner_delta_write_failures_total",
                                "Serving deltas that could not be written (a full disk, the directory gone); the rows "
                                "go out with the next one, training goes on.")

FORMAT = 2
KIND = "streamrec-delta"
_PREFIX = "delta-"
SUFFIX = ".delta"
_LEGACY_SUFFIX = ".pt"  # format 1
_NAME = re.compile(r"delta-(\d{1,18})-(\d{1,18})")
PENDING = "pending-rows.i64"  # rows marked since the last delta, int64 little-endian (a restarted writer's)
SEQ_FILE = "DELTA_SEQ"  # in the checkpoint directory: the largest seq its lineage's writers took (ASCII integer)
ABANDONED = "abandoned-seqs"  # the seqs restarts removed as a dead branch: "<first> <last> <lineage>" a line (ASCII)
_ABANDONED_KEEP = 64  # ranges kept in it (one per restart that removed any)
_REMEMBER = 1024  # gap ranges and rewind positions a reader remembers having counted
MAX_BYTES = 4 << 30  # a delta file larger than this is refused unread
# A read failing with these (or MemoryError) is the reading process short of descriptors, memory or buffers, not the
# file at fault: the delta is retried (DeltaReader.newer). Permission, I/O and format errors reject it at once.
TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR,
                              errno.ENOBUFS})
# Consecutive rounds one version of a delta file may fail transiently before it is rejected as unreadable. A count of
# rounds, not a time: each retry holds every later delta back for a round (values are absolute and apply in seq order),
# so the bound is on how many rounds of freshness one file may cost. Serving's rounds are at most poll_s (0.5 s) apart
# (sooner when a delta is announced), so its retries span up to about a second; a shortage that outlasts them is given
# up on as a bad file is (its rows wait for a later delta touching them or the next artifact).
TRANSIENT_TRIES = 3


class DeltaError(StreamrecError, ValueError):
    """A delta file that cannot be used: damaged, malformed, mistyped or not finite. Names file and cause."""


@dataclass(frozen=True)
class Delta:
    seq: int
    samples_trained: int
    created: float
    rows: torch.Tensor  # (R,) int64
    vectors: torch.Tensor  # (R, D + 1) float32
    dense_state: dict[str, torch.Tensor]
    path: Path
    id_maps: dict[str, Any] | None = None  # RowMapper.state_dict() when this delta carries one
    lineage: str | None = None  # the learner's checkpoint lineage (learner/checkpoint.py)
    signed: bool = False  # the file is a signed pack (checked against the key when the reader has one)


def delta_path(directory: Path, seq: int, samples_trained: int) -> Path:
    """``delta-<seq>-<samples_trained>.delta``: readers skip deltas by name, without loading them."""
    return directory / f"{_PREFIX}{seq:012d}-{samples_trained:015d}{SUFFIX}"


def _parse_name(p: Path, suffix: str) -> tuple[int, int] | None:
    if not p.name.endswith(suffix) or p.name.startswith("."):
        return None
    m = _NAME.fullmatch(p.name[: -len(suffix)])
    return (int(m.group(1)), int(m.group(2))) if m else None


def list_deltas(directory: Path) -> list[tuple[int, int, Path]]:
    """``(seq, samples_trained, path)`` of the complete delta files, oldest first."""
    if not directory.is_dir():
        return []
    out = []
    for p in directory.glob(f"{_PREFIX}*{SUFFIX}"):
        parsed = _parse_name(p, SUFFIX)
        if parsed is not None:
            out.append((*parsed, p))
    return sorted(out)


def _max_seq(directory: Path) -> int:
    """The largest seq among current and format-1 files and the ranges restarts removed (:data:`ABANDONED`): a
    restarted or upgraded writer continues after it. Without the ranges, a second restart before the first one's
    first delta numbered the removed seqs again when ``DELTA_SEQ`` could not be written (a full checkpoint volume):
    serving, past them, skipped the new ones."""
    seqs = [s for s, _, _ in list_deltas(directory)] + [b for _, b, _ in _read_abandoned(directory / ABANDONED)]
    seqs += [parsed[0] for p in directory.glob(f"{_PREFIX}*{_LEGACY_SUFFIX}")
             if (parsed := _parse_name(p, _LEGACY_SUFFIX)) is not None]
    return max(seqs, default=0)


def _read_abandoned(path: Path) -> list[tuple[int, int, str]]:
    """``(first, last, lineage)`` of every range in an :data:`ABANDONED` file; [] when there is none or it cannot be
    read (logged; malformed lines are left out)."""
    try:
        text = read_regular(path, MAX_STATE_FILE_BYTES, "an abandoned-deltas record").decode("ascii")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as exc:
        log.error("cannot read %s (%s): deltas removed as a dead branch count as pruned", path, exc)
        return []
    return [(int(a), int(b), lin) for a, b, lin in (ln.split() for ln in text.splitlines() if len(ln.split()) == 3)
            if a.isdigit() and b.isdigit()]


def read_abandoned(directory: Path, lineage: str | None) -> list[tuple[int, int]]:
    """The seq ranges ``(first, last)`` a restart of ``lineage`` (None: any) removed from ``directory`` as a dead branch
    (:meth:`DeltaWriter.abandon_after`): missing to a reader, but not pruned unread (their rows went out again)."""
    return [(a, b) for a, b, lin in _read_abandoned(Path(directory) / ABANDONED) if lineage in (None, lin)]


def _covered(first: int, last: int, ranges: list[tuple[int, int]]) -> int:
    """How many seqs of ``first..last`` the ranges ``(a, b)`` (inclusive) hold."""
    n, upto = 0, first - 1
    for a, b in sorted(ranges):
        a, b = max(a, upto + 1), min(b, last)
        if a <= b:
            n, upto = n + b - a + 1, b
    return n


def read_seq_file(path: Path | None) -> int:
    """The seq recorded in ``path`` (a checkpoint directory's :data:`SEQ_FILE`); 0 when there is none. A file that
    does not hold an integer is reported and read as 0 (the directory's own numbering still counts), as is one that is
    not a regular file (a FIFO there hung the learner's start) or holds more than
    :data:`~stream.files.MAX_STATE_FILE_BYTES` (``read_regular``)."""
    if path is None:
        return 0
    try:
        text = read_regular(path, MAX_STATE_FILE_BYTES, "a delta seq file").decode("ascii").strip()
    except FileNotFoundError:
        return 0
    except (OSError, UnicodeDecodeError) as exc:
        log.error("cannot read %s (%s): delta numbering continues after the deltas directory's largest file only",
                  path, exc)
        return 0
    if not text.isdigit():
        log.error("%s holds %r, not a delta seq: numbering continues after the deltas directory's largest file only",
                  path, text[:40])
        return 0
    return int(text)


# -- encoding and decoding ---------------------------------------------------------------------------
def encode_delta(payload: dict[str, Any], key: SigningKey | None = None) -> bytes:
    """The file bytes of one delta (``payload``: the tree of the module docstring, without kind/format),
    signed with ``key`` when given."""
    return pack({"kind": KIND, "format": FORMAT, **payload}, key)


def _rough_bytes(obj: Any) -> int:
    """An upper bound of what ``obj`` (tensors, arrays, and containers of them) adds to a delta file: its data, plus
    room for each leaf's header and alignment. Lets :meth:`DeltaWriter._parts` skip encoding a delta twice to measure
    it: only one this bound puts near :data:`MAX_BYTES` is measured exactly."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size() + 512
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes) + 512
    if isinstance(obj, dict):
        return sum(_rough_bytes(k) + _rough_bytes(v) for k, v in obj.items()) + 64
    if isinstance(obj, (list, tuple)):
        return sum(_rough_bytes(v) for v in obj) + 64
    if isinstance(obj, (str, bytes)):
        return 6 * len(obj) + 64  # (JSON writes a char in at most 6 bytes: \\uXXXX)
    return 64


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_FINITE_CHUNK = 1 << 22  # values checked at a time: the check's mask stays small whatever the delta's size


def _finite(name: str, t: torch.Tensor, where: str) -> None:
    if not t.is_floating_point() or not t.numel():
        return
    flat = t.reshape(-1)  # (a view: decoded tensors are contiguous)
    if all(bool(torch.isfinite(flat[i:i + _FINITE_CHUNK]).all()) for i in range(0, len(flat), _FINITE_CHUNK)):
        return
    bad = int((~torch.isfinite(t)).sum())
    raise DeltaError(f"{where}: {name} holds {bad} non-finite values (NaN or inf): the learner diverged or the "
                     "file was altered; the delta is skipped, the live model is unchanged")


def decode_delta(raw: bytes | bytearray | memoryview, path: Path, key: SigningKey | None = None) -> Delta:
    """A checked :class:`Delta` from a file's bytes; :class:`DeltaError` for anything else (never another error).
    With ``key``: only a delta signed with it (an unsigned or mis-signed one is refused before it is decoded).
    From a writable buffer (:func:`load_delta`'s) ``rows``, ``vectors`` and ``dense_state`` are views of it
    (``learner.tensorpack.unpack``); the id maps are copied out, so what a model keeps of them does not hold it."""
    where = f"delta {path}"
    try:
        tree = unpack(raw, key)
    except SignatureError as exc:
        raise DeltaError(f"{where}: refused: {exc}; the delta is skipped, the live model is unchanged") from None
    except PackError as exc:
        raise DeltaError(f"{where}: {exc}") from None
    if not isinstance(tree, dict):
        raise DeltaError(f"{where}: holds a {type(tree).__name__}, expected an object")
    kind, fmt = tree.get("kind"), tree.get("format")
    # Compared only as a string and an integer: a tensor there would answer ``!=`` with a tensor (no bool).
    if not (isinstance(kind, str) and kind == KIND and isinstance(fmt, int) and fmt == FORMAT):
        newer = isinstance(kind, str) and kind == KIND and isinstance(fmt, int) and fmt > FORMAT
        raise DeltaError(f"{where}: kind {str(tree.get('kind'))[:40]!r} format {str(tree.get('format'))[:20]}, "
                         f"this streamrec reads kind {KIND!r} format {FORMAT}"
                         + ("; a newer streamrec learner wrote it: upgrade serving to it (serving before the learner)"
                            if newer else ""))
    missing = {"seq", "samples_trained", "created", "rows", "vectors", "dense_state"} - set(tree)
    if missing:
        raise DeltaError(f"{where}: missing {', '.join(sorted(missing))}; the writer is not this streamrec's")
    seq, samples, created = tree["seq"], tree["samples_trained"], tree["created"]
    if not (_int(seq) and seq >= 1):
        raise DeltaError(f"{where}: seq {str(seq)[:40]!r}, expected an integer >= 1")
    if not (_int(samples) and samples >= 0):
        raise DeltaError(f"{where}: samples_trained {str(samples)[:40]!r}, expected an integer >= 0")
    if not (isinstance(created, (int, float)) and not isinstance(created, bool) and math.isfinite(created)):
        raise DeltaError(f"{where}: created {str(created)[:40]!r}, expected a finite unix time")
    named = _parse_name(path, SUFFIX)
    if named is not None and named != (seq, samples):
        raise DeltaError(f"{where}: holds seq {seq} and samples_trained {samples} but is named for {named}: the "
                         "file was renamed or copied; skipped")
    lineage = tree.get("lineage")
    if lineage is not None and not (isinstance(lineage, str) and 0 < len(lineage) <= 128):
        raise DeltaError(f"{where}: lineage {str(lineage)[:40]!r}, expected a string id or null")
    rows, vectors, dense = tree["rows"], tree["vectors"], tree["dense_state"]
    if not (isinstance(rows, torch.Tensor) and rows.dtype == torch.int64 and rows.dim() == 1):
        raise DeltaError(f"{where}: rows must be a 1-D int64 tensor, got {_describe(rows)}")
    if not (isinstance(vectors, torch.Tensor) and vectors.dtype == torch.float32 and vectors.dim() == 2
            and vectors.shape[0] == rows.shape[0] and vectors.shape[1] >= 1):
        raise DeltaError(f"{where}: vectors must be a ({len(rows)}, D + 1) float32 tensor, got {_describe(vectors)}")
    if len(rows) and int(rows.min()) < 0:
        raise DeltaError(f"{where}: rows hold negative row numbers (min {int(rows.min())})")
    _finite("vectors", vectors, where)
    if not (isinstance(dense, dict) and dense and all(isinstance(v, torch.Tensor) for v in dense.values())):
        raise DeltaError(f"{where}: dense_state must be a non-empty object of tensors, got {_describe(dense)}")
    for k, v in dense.items():
        if not v.is_floating_point():
            raise DeltaError(f"{where}: dense_state[{k!r}] is {v.dtype}, expected a floating tensor")
        _finite(f"dense_state[{k!r}]", v, where)
    id_maps = tree.get("id_maps")
    if id_maps is not None and not isinstance(id_maps, dict):
        raise DeltaError(f"{where}: id_maps must be an object or absent, got {_describe(id_maps)}")
    if id_maps is not None:
        id_maps = _owned(id_maps)
    return Delta(seq, samples, float(created), rows, vectors, dense, path, id_maps, lineage, is_signed(raw))


def _owned(v: Any) -> Any:
    """``v`` with every tensor in it copied (a tree of dicts and lists)."""
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: _owned(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_owned(x) for x in v]
    return v


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{v.dtype} tensor of shape {tuple(v.shape)}"
    return f"a {type(v).__name__}"


def _check_inside(path: Path) -> Path:
    """What ``path`` resolves to; DeltaError when it is a symlink (or lies under one) resolving outside its own
    directory, or a symlink loop."""
    try:
        directory = path.parent.resolve()
        target = path.resolve()
    except RuntimeError as exc:  # a symlink loop (pathlib's resolve)
        raise DeltaError(f"delta {path}: {exc}; refused unread") from None
    if target.parent != directory:
        raise DeltaError(f"delta {path}: resolves to {target}, outside the deltas directory {directory} (a symlink): "
                         "refused unread; deltas are plain files written there by the learner")
    return target


def _open_inside(path: Path) -> int:
    """``path`` opened for reading (a descriptor) as an entry of its own directory, never through a symlink: a
    symlink found there (one to a file of the same directory, or one swapped in since :func:`_check_inside`) is
    checked again and what it resolves to opened by name in the directory, not followed. What is opened is an entry
    of the deltas directory whatever changes meanwhile (a check by path then an open that follows symlinks read a
    file outside it when a symlink was swapped in between). Opened without blocking: a FIFO cannot hang it."""
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            return open_entry(dfd, path.name)
        except OSError as exc:
            if exc.errno != errno.ELOOP:  # (ELOOP: the entry is a symlink)
                raise
        return open_entry(dfd, _check_inside(path).name)
    finally:
        os.close(dfd)


def load_delta(path: Path, key: SigningKey | None = None) -> Delta:
    """Read and check one delta file (see the module docstring); :class:`DeltaError` if it cannot be used
    (with ``key``: also when it is not signed with it). A file that vanished (pruned) raises
    ``FileNotFoundError``."""
    path = Path(path)
    _check_inside(path)
    with os.fdopen(_open_inside(path), "rb", buffering=0) as fh:  # opened once; checked and read from the descriptor
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):  # a FIFO named like a delta blocked the reading thread for good
            raise DeltaError(f"delta {path}: not a regular file (mode {stat.filemode(st.st_mode)}); refused unread")
        if st.st_size > MAX_BYTES:
            raise DeltaError(f"delta {path}: {st.st_size} bytes, more than the {MAX_BYTES}-byte limit; refused unread")
        # One writable buffer of the file's size, read into in place: the tensors decoded are views of it
        # (learner/tensorpack.py), so a delta takes about its size in memory (it took ~3.7x with read + copies).
        # One byte more than the fstat said: a file that grew meanwhile is noticed, not cut.
        buf = np.empty(st.st_size + 1, dtype=np.uint8).data  # (a writable memoryview, not zero-filled)
        n = 0
        while n < len(buf) and (got := fh.readinto(buf[n:])):
            n += got
    if n > st.st_size:
        raise DeltaError(f"delta {path}: grew while it was read (a writer is not renaming its files into place); "
                         "refused")
    return decode_delta(buf[:n], path, key)


# -- writing ---------------------------------------------------------------------------------------
class DeltaWriter:
    """Marks the rows each trained batch touched; writes them (and the dense weights) every ``every_s``."""

    def __init__(self, directory: Path, num_rows: int, every_s: float, keep: int = 100,
                 notify: Callable[[int], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 id_maps_every_s: float = 60.0, lineage: str | None = None, key: SigningKey | None = None,
                 seq_file: Path | None = None) -> None:
        if every_s <= 0:
            raise ValueError(f"deltas every_s must be > 0 (0 turns deltas off upstream), got {every_s}")
        if keep < 1:
            raise ValueError(f"deltas keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.every_s, self.keep, self.notify, self.clock = every_s, keep, notify, clock
        self.lineage = lineage
        self.key = key  # signs every delta written (learner.tensorpack container format 2) when given
        self.touched = torch.zeros(num_rows, dtype=torch.bool)  # (num_rows,)
        # (num_rows,) rows handed to another id (evicted or admitted) since the last delta that carried the id maps:
        # held back until one does (:meth:`hold`)
        self.held = torch.zeros(num_rows, dtype=torch.bool)
        self.pending_path = self.directory / PENDING
        self._pending_ok = True  # False after a failed append, until the next delta starts a new list
        self._restore_pending()
        # seq_file: the checkpoint directory's DELTA_SEQ (module docstring "Numbering"); None: the directory alone
        self.seq_file = Path(seq_file) if seq_file is not None else None
        on_disk, used = _max_seq(self.directory), read_seq_file(self.seq_file)
        if used > on_disk:
            log.warning("deltas directory %s holds no delta past seq %d, but this lineage already wrote up to %d "
                        "(%s): the directory was emptied or replaced; numbering continues at %d, so serving "
                        "cannot mistake the new deltas for ones it applied", self.directory, on_disk, used,
                        self.seq_file, used + 1)
        self.seq = self._reserved = max(on_disk, used)
        self._last = clock()
        self.written = 0
        self.failed = 0  # writes that failed (OSError): survived, retried at the next due time
        self._unprunable: set[Path] = set()  # deltas a prune could not remove (each logged once)
        # the learner's id maps (RowMapper.state_dict), sent with a delta at most every id_maps_every_s
        self.id_maps_source: Callable[[], dict[str, Any]] | None = None
        self.id_maps_every_s = id_maps_every_s
        self._last_maps = -float("inf")

    @classmethod
    def from_settings(cls, ls: Any, num_rows: int, key: SigningKey | None = None,
                      redis_settings: RedisSettings | None = None) -> DeltaWriter:
        """From ``streamrec.settings.LearnerSettings`` (``deltas_*``), announcing each delta on the Redis of
        ``redis_settings`` (the [redis] settings: url, credentials, TLS) when given; the deprecated
        ``ls.deltas_redis_url``, when set, replaces only their url. Neither: no announcement (serving polls).
        The lineage is the one of ``ls.checkpoint_dir`` (created there if the directory has none yet), and so is
        the record of the seqs it used (``DELTA_SEQ``).
        Deltas are signed with ``key``, or (when not given) the key in ``ls.signing_key_file`` if one is set."""
        channel = ls.deltas_channel or (redis_settings or RedisSettings()).deltas_channel  # "" = the prefix's channel
        target = redis_settings
        deprecated_url = getattr(ls, "deltas_redis_url", None)
        if deprecated_url:
            log.warning("[learner] deltas_redis_url is deprecated: the learner announces deltas on the [redis] url "
                        "with its credentials; remove deltas_redis_url (STREAMREC_LEARNER_DELTAS_REDIS_URL)")
            target = _with_url(target or RedisSettings(), deprecated_url)
        notify = redis_notifier(target, channel) if target is not None else None
        if key is None:
            key = load_signing_key(getattr(ls, "signing_key_file", None))
        return cls(Path(ls.deltas_dir), num_rows, ls.deltas_every_s, keep=ls.deltas_keep, notify=notify,
                   id_maps_every_s=ls.deltas_id_maps_every_s, lineage=ckpt_io.lineage(Path(ls.checkpoint_dir)),
                   key=key, seq_file=Path(ls.checkpoint_dir) / SEQ_FILE)

    def mark(self, values: torch.Tensor) -> None:
        """Rows of one trained batch (``TensorBatch.values``, (N,) int64; duplicates are fine). The rows not
        marked yet are appended to the pending list (``PENDING``), so they survive a restart."""
        values = values.to(self.touched.device)
        fresh = values[~self.touched[values]]
        if len(fresh) == 0:
            return
        fresh = torch.unique(fresh)
        self.touched[fresh] = True
        self._append_pending(fresh)

    def resend_all(self, why: str) -> None:
        """Mark every row, so the next delta carries the whole table (in parts past :data:`MAX_BYTES`) with the dense
        weights and the id maps: the learner's restore went back past newer checkpoints (``why`` names them), whose
        artifact serving may run with their deltas applied; the restart's usual resend (every admitted id's row)
        left the other rows they changed at their values there (module docstring)."""
        log.warning("%s: the next delta resends all %d rows, so serving, which may run an artifact of them, ends on "
                    "this training's state", why, len(self.touched))
        self.mark(torch.arange(len(self.touched), device=self.touched.device))

    def abandon_after(self, seq: int | None, samples_trained: int | None = None) -> None:
        """Remove the deltas numbered past ``seq``, the ``delta_seq`` of the checkpoint the learner resumed from (None:
        not known, nothing removed): written after it by the training the restore threw away, a dead branch. Left in
        the directory, an artifact of a later checkpoint (its ``delta_seq`` past them, its count below theirs) took
        them for a restarted numbering, counted a rewind and applied them (:meth:`DeltaReader.newer`). This writer's
        numbering stays past them (a seq is never used twice); a reader that had not read them counts them pruned.

        Serving may have applied them: the rows they carry are marked first (and the pending list synced before any
        file goes), so the next delta sends each with this learner's value. The restart's usual resend (admitted ids'
        rows, the pending list) left the item and bucket rows only they touched at the dead training's values in
        serving until the next artifact. One that cannot be read, or pruned by the dead run itself (``keep``: its
        deltas on disk start after a hole no restart recorded abandoned), or gone with the directory (emptied or
        replaced: ``DELTA_SEQ`` says seqs past the checkpoint's were taken, neither a file nor a record here says which
        rows they carried): every row is resent (:meth:`resend_all`).
        One at the checkpoint's own ``samples_trained`` (an earlier restart's first delta, nothing trained since) holds
        the checkpoint's values, this learner's: not read (a fallback's resend of every row is not resent again)."""
        if seq is None:
            return
        listed = [(s, n, p) for s, n, p in list_deltas(self.directory) if s > seq]
        found, dead = [(p, n) for _, n, p in listed], [p for _, _, p in listed]
        first = listed[0][0] if listed else seq + 1  # (a hole before it no earlier restart recorded: pruned unread)
        gone = first - 1 - seq
        if gone > 0 and _covered(seq + 1, first - 1, read_abandoned(self.directory, self.lineage)) < gone:
            self.resend_all(f"deltas {seq + 1}..{first - 1} of the abandoned training (after the checkpoint's delta "
                            f"seq {seq}) were pruned before this restart (deltas_keep) and cannot be read")
        # Seqs this lineage took past the checkpoint (DELTA_SEQ) with no file or abandoned record here: the directory
        # was emptied or replaced, and serving may have applied them. One is no sign: the last seq reserved may never
        # have been written (a crash, a failed write), unless the directory lost even the checkpoint's own seq.
        untraced = self.seq - max(on_disk := _max_seq(self.directory), seq)
        if (untraced > 1 or (untraced > 0 and on_disk < seq)) and not bool(self.touched.all()):
            self.resend_all(f"deltas {seq + 1}..{self.seq} of the abandoned training (after the checkpoint's delta seq "
                            f"{seq}) are not in {self.directory} (emptied or replaced) and cannot be read")
        for p in (p for p, n in found if n != samples_trained):
            if bool(self.touched.all()):
                break
            try:
                self.mark(load_delta(p).rows)
            except FileNotFoundError:
                continue
            except (DeltaError, OSError) as exc:
                self.resend_all(f"delta {p.name} of the abandoned training cannot be read ({exc})")
        if dead:
            self.sync()
        if self.seq > seq:  # (seqs reserved and never written too: no reader ever gets them)
            self._record_abandoned(seq + 1, self.seq)
        for p in list(dead):
            try:  # (EPERM, EROFS: logged; raised, the learner did not start, for a side output)
                p.unlink(missing_ok=True)
            except OSError as exc:
                dead.remove(p)
                log.error("cannot remove %s of the training the restore threw away (%s): an artifact of a later "
                          "checkpoint may apply it; remove it by hand", p, exc)
        if dead:
            log.warning("removed deltas %s..%s of the training after the checkpoint resumed from (delta seq %d): "
                        "serving never applies them; this learner's deltas go on at seq %d", dead[0].name,
                        dead[-1].name, seq, self.seq + 1)

    def _record_abandoned(self, first: int, last: int) -> None:
        """Add ``first..last`` to :data:`ABANDONED` (the last :data:`_ABANDONED_KEEP` ranges kept). A record that
        cannot be written is logged: a reader that missed them then counts them as a gap. A range the lineage's lines
        already hold is not added again: each restart of a crash loop added it, and 64 of them pushed out every older
        range (a reader then counted those seqs as pruned unread)."""
        path = self.directory / ABANDONED
        had = _read_abandoned(path)
        if _covered(first, last, [(a, b) for a, b, lin in had if lin == str(self.lineage)]) == last - first + 1:
            return
        lines = [f"{a} {b} {lin}" for a, b, lin in had] + [f"{first} {last} {self.lineage}"]
        try:
            write_atomic(path, ("\n".join(lines[-_ABANDONED_KEEP:]) + "\n").encode())
        except OSError as exc:
            log.warning("cannot record the abandoned deltas %d..%d in %s (%s): a serving process that had not read "
                        "them counts them as pruned", first, last, path, exc)

    def hold(self, rows: np.ndarray) -> None:
        """Rows (global, (R,) int64) the id maps just handed to another id (evicted, admitted). Serving maps ids with
        the maps of the last delta that carried them: a delta without maps that sent such a row served the id that
        left it the vector of the id that took it. So they wait, marked, for the next delta with the maps."""
        if len(rows):
            self.held[torch.from_numpy(np.asarray(rows, dtype=np.int64))] = True

    def _append_pending(self, fresh: torch.Tensor) -> None:
        if not self._pending_ok or not len(fresh):
            return
        try:  # (non-blocking: a FIFO in its place is ENXIO, not a wait for a reader for ever)
            fd = os.open(self.pending_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
            with os.fdopen(fd, "ab") as fh:
                fh.write(fresh.cpu().numpy().astype("<i8", copy=False).tobytes())
        except OSError as exc:
            self._pending_ok = False
            log.warning("cannot append to %s (%s): rows marked until the next delta are sent only if this process "
                        "lives to write it", self.pending_path, exc)

    def _restore_pending(self) -> None:
        """Mark the rows a previous writer on this directory marked and never wrote (rows outside this table,
        from another config, and a torn last entry are left out). A list that cannot be read (permissions, a disk
        error, a directory or a FIFO in its place: :func:`~stream.files.open_regular`) is logged and the learner
        starts: those rows reach serving with the next artifact (as for a list :meth:`sync` cannot make durable).
        Raised, it stopped the learner at start for a side output."""
        try:
            with open_regular(self.pending_path) as (fh, _):
                raw = fh.readall()
        except FileNotFoundError:
            return
        except OSError as exc:
            self._pending_ok = False  # not appended to either, until the next delta starts a new list
            log.warning("cannot read %s (%s): the rows it lists reach serving with the next artifact, not with the "
                        "next delta; the learner starts", self.pending_path, exc)
            return
        rows = np.frombuffer(raw, dtype="<i8", count=len(raw) // 8).astype(np.int64)
        rows = rows[(rows >= 0) & (rows < len(self.touched))]
        self.touched[torch.from_numpy(rows).to(self.touched.device)] = True
        if len(rows):
            log.info("%d row(s) marked before a restart and not in any delta yet go out with the next one", len(rows))

    def sync(self) -> None:
        """Make the pending list durable (the daemon calls it with each checkpoint). A list that cannot be (an fsync
        that fails: EIO, ENOSPC on a deltas volume that filled up) is logged and the checkpoint goes on: after a crash
        before the next delta, the rows trained since the last one may then reach serving only with the next
        artifact. Raised, it failed every checkpoint, the one at exit too, for a side output."""
        try:
            fd = os.open(self.pending_path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO there would block the checkpoint
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("cannot open %s to make it durable (%s); the checkpoint goes on", self.pending_path, exc)
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                log.warning("%s is not a regular file: not made durable; the checkpoint goes on", self.pending_path)
                return
            os.fsync(fd)
            fsync_dir(self.directory)
        except OSError as exc:
            log.warning("cannot make %s durable (%s): the rows trained since the last delta may reach serving only "
                        "with the next artifact if the learner stops before the next delta; the checkpoint goes on",
                        self.pending_path, exc)
        finally:
            os.close(fd)

    def due(self) -> bool:
        return self.clock() - self._last >= self.every_s

    def after_step(self, trainer: Any, values: torch.Tensor) -> Path | None:
        """The daemon's hook after each trained batch: mark, and when due apply any pending
        (accumulated) gradient so the rows written are the trained ones, then write."""
        self.mark(values)
        if not self.due():
            return None
        trainer.step()
        return self.write(trainer.model, trainer.samples)

    @torch.no_grad()
    def write(self, model: nn.Module, samples_trained: int) -> Path | None:
        """Write one delta of the rows marked since the last one; None when nothing was trained."""
        self._last = self.clock()
        due = self.id_maps_source is not None and self.maps_due()  # the maps are built only for a delta written
        rows = (self.touched if due else self.touched & ~self.held).nonzero().squeeze(1)  # (R,)
        if len(rows) == 0:
            return None
        maps = self.id_maps_source() if due and self.id_maps_source is not None else None
        weight: torch.Tensor = model.sparse.bag.weight  # type: ignore[union-attr,assignment]  # (num_rows, D + 1)
        vectors = weight[rows.to(weight.device)].float().cpu()  # (R, D + 1)
        return self.write_rows(rows.cpu(), vectors, dense_weights(model), samples_trained, maps)

    def maps_due(self) -> bool:
        """Whether the next delta should carry the id maps (``id_maps_every_s`` passed since the last that did)."""
        return self.clock() - self._last_maps >= self.id_maps_every_s

    def write_rows(self, rows: torch.Tensor, vectors: torch.Tensor, dense_state: dict[str, torch.Tensor],
                   samples_trained: int, id_maps: dict[str, Any] | None = None) -> Path | None:
        """Write one delta of ``rows`` (R,) int64 with their ``vectors`` (R, D + 1) float32 and the dense weights,
        then clear the marks: :meth:`write`'s second half, called directly by the distributed mode's rank 0
        (``learner/sharded_deltas.py``), which gathers the rows from the ranks that hold them, and the id maps
        (``id_maps``, ``RowMapper.state_dict``) from the ranks' shares when :meth:`maps_due`. Without ``id_maps``
        the delta carries ``id_maps_source()`` when one is set and due.

        A write that fails (a full disk, the directory gone) is survived, as a checkpoint's is: logged, counted
        (``failed``, ``streamrec_learner_delta_write_failures_total``), nothing is half-visible (the file is written
        aside and renamed), the marks and the pending list stay, and the next due time tries again with the same
        seq (serving sees no gap), and the maps with it when it carried them; None is returned. Training goes on.
        A delta past the reader's :data:`MAX_BYTES` goes out in parts (module docstring "Parts"); the last one's
        path is returned."""
        if id_maps is None and self.id_maps_source is not None and self.maps_due():
            id_maps = self.id_maps_source()
        bounds = self._parts(rows, vectors, dense_state, samples_trained, id_maps)
        path = None
        for i, (lo, hi) in enumerate(bounds):
            last = i == len(bounds) - 1
            maps = id_maps if last or id_maps is None or i else {n: without_admitted(m) for n, m in id_maps.items()}
            if (path := self._write_one(rows[lo:hi], vectors[lo:hi], dense_state, samples_trained,
                                        None if not last and i else maps, last and id_maps is not None)) is None:
                return None
        return path

    def _parts(self, rows: torch.Tensor, vectors: torch.Tensor, dense_state: dict[str, torch.Tensor],
               samples_trained: int, id_maps: dict[str, Any] | None) -> list[tuple[int, int]]:
        """``[lo, hi)`` of the rows of each part, every one within :data:`MAX_BYTES` (module docstring "Parts")."""
        def size(n: int, maps: dict[str, Any] | None) -> int:  # the file bytes with n rows (+ header digits)
            payload = {"seq": self.seq + 1, "samples_trained": int(samples_trained), "created": time.time(),
                       "lineage": self.lineage, "rows": rows[:0], "vectors": vectors[:0], "dense_state": dense_state}
            return len(encode_delta({**payload, **({"id_maps": maps} if maps is not None else {})}, self.key)) + (
                n * (rows.element_size() + vectors[:1].numel() * vectors.element_size()) + 2 * ALIGN + 64)

        rough = _rough_bytes([rows, vectors, dense_state, id_maps])  # an upper bound without encoding (cheap)
        if rough <= MAX_BYTES or size(len(rows), id_maps) <= MAX_BYTES:
            return [(0, len(rows))]
        empty = {n: without_admitted(m) for n, m in id_maps.items()} if id_maps is not None else None
        fixed = [size(0, m) for m in (empty, None, id_maps)]  # first part, middle parts, last part
        row_bytes = size(1, None) - fixed[1]
        caps = [(MAX_BYTES - f) // row_bytes for f in fixed]
        if min(caps) < 1:
            log.error("a delta's id maps and dense weights alone come near the reader's %d-byte limit: written as "
                      "one delta, which serving refuses; lower id_capacity or raise the limit", MAX_BYTES)
            return [(0, len(rows))]
        bounds: list[tuple[int, int]] = []
        lo = 0
        while len(rows) - lo > caps[2]:
            step = min(caps[0] if not bounds else caps[1], len(rows) - lo - caps[2])  # (the last part full)
            bounds.append((lo, lo + step))
            lo += step
        return [*bounds, (lo, len(rows))]

    def _write_one(self, rows: torch.Tensor, vectors: torch.Tensor, dense_state: dict[str, torch.Tensor],
                   samples_trained: int, id_maps: dict[str, Any] | None, full_maps: bool) -> Path | None:
        """One delta file (:meth:`write_rows`); ``full_maps``: ``id_maps`` are the learner's (not a part's first)."""
        seq = self.seq + 1
        self._reserve(seq)
        payload: dict[str, Any] = {"seq": seq, "samples_trained": int(samples_trained), "created": time.time(),
                                   "lineage": self.lineage, "rows": rows, "vectors": vectors,
                                   "dense_state": dense_state}
        if id_maps is not None:
            payload["id_maps"] = id_maps
        data = encode_delta(payload, self.key)
        path = delta_path(self.directory, seq, int(samples_trained))
        try:
            self.directory.mkdir(parents=True, exist_ok=True)  # (a directory removed meanwhile is made again)
            write_atomic(path, data)
        except OSError as exc:
            self.failed += 1
            DELTA_WRITE_FAILURES.inc()
            log.error("delta %d could not be written to %s (%s); training goes on, the rows stay marked and go out "
                      "with the next delta", seq, self.directory, exc)
            if path.exists():  # in place, not known durable (the directory's fsync failed): its seq is taken
                self.seq = seq  # (a retry under it left two deltas of one seq: a reader skipped the second for good)
            return None
        self.seq = seq
        if full_maps:  # (only now: after a failed write the maps stay due, the retry carries them)
            self.held.zero_()
            self._last_maps = self.clock()
        self.touched[rows.to(self.touched.device)] = False  # the rows held back stay marked (and listed) for later
        try:  # everything it listed is in the durable delta now
            self.pending_path.unlink(missing_ok=True)
            self._pending_ok = True
        except OSError as exc:  # the old rows go out once more after a restart: harmless
            log.warning("cannot remove %s (%s)", self.pending_path, exc)
        self._append_pending(self.touched.nonzero().squeeze(1))
        self.written += 1
        self._prune()
        if self.notify is not None:
            try:
                self.notify(self.seq)
            except Exception as exc:  # noqa: BLE001 - a lost notification only delays serving to its next poll
                from learner.kafka_dataset import worker_died  # (here: serving imports this module, not Kafka's)

                if worker_died(exc):  # torch says it once, wherever the learner is (learner/lag.py): not Redis's
                    raise
                log.warning("delta %d written but not announced (%s); serving picks it up when it polls", self.seq, exc)
        return path

    def _prune(self) -> None:
        """Remove the deltas past the newest ``keep``. One that cannot be removed (EPERM, EROFS) is logged once (while
        it stays) and left: raised, it left ``write_rows`` (``after_step``) and stopped training, for a side output,
        though the delta just written was durable. A reader only reads more files meanwhile."""
        listed = [p for _, _, p in list_deltas(self.directory)]  # (oldest first)
        self._unprunable &= set(listed)  # (gone since: forgotten)
        for old in listed[:-self.keep]:
            try:
                old.unlink(missing_ok=True)
            except OSError as exc:
                if old not in self._unprunable:
                    self._unprunable.add(old)
                    log.error("cannot prune %s (%s): the deltas directory keeps more than deltas_keep files until it "
                              "can be removed; training goes on", old, exc)

    def _reserve(self, seq: int) -> None:
        """Record ``seq`` in the seq file before any delta carries it (module docstring "Numbering"). A record that
        cannot be written is logged and the delta still goes out: only an emptied deltas directory on top of it
        could make a later writer use the seq again."""
        if self.seq_file is None or seq <= self._reserved:
            return
        try:
            write_atomic(self.seq_file, str(seq).encode())
        except OSError as exc:
            log.warning("cannot record delta seq %d in %s (%s); should the deltas directory be emptied before it is "
                        "recorded, a restarted learner could number a delta %d again", seq, self.seq_file, exc, seq)
            return
        self._reserved = seq


def dense_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every non-embedding weight of ``model`` (its state dict without ``sparse.*``), on the CPU, floats as float32:
    a delta's ``dense_state``."""
    return {k: v.detach().float().cpu().clone() if v.is_floating_point() else v.detach().cpu().clone()
            for k, v in model.state_dict().items() if not k.startswith("sparse.")}


def _with_url(rs: RedisSettings, url: str) -> RedisSettings:
    """``rs`` at ``url`` (the deprecated ``deltas_redis_url``): credentials in the url replace those of ``rs``,
    and the TLS files stay only for a rediss:// url."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    changes: dict[str, Any] = {"url": url}
    if parts.password:
        changes.update(password=Secret(""), password_file=None, password_env=None)
    if parts.username:
        changes["username"] = ""
    if parts.scheme != "rediss":
        changes.update(ssl_ca_certs=None, ssl_certfile=None, ssl_keyfile=None)
    return dataclasses.replace(rs, **changes)


def redis_notifier(target: RedisSettings | str, channel: str) -> Callable[[int], None]:
    """``PUBLISH channel seq`` on the Redis of ``target`` (the [redis] settings with their credentials and TLS,
    or a bare url); the client connects lazily and reconnects. A failed PUBLISH raises a
    :class:`~stream.redis_client.RedisFailure` whose one line names the Redis (url redacted) and the cause. The
    timeout bounds each whole reply (``whole_reply``): a Redis trickling its replies held the learner's training step
    for as long as it trickled (each read within the timeout), and now fails the announcement after 1 s a try."""
    import redis

    from stream.redis_client import connect, failure

    settings = target if isinstance(target, RedisSettings) else RedisSettings(url=target)
    client = connect(settings, timeout_s=1.0, retries=1, whole_reply=True)

    def notify(seq: int) -> None:
        try:
            client.publish(channel, str(seq))
        except (redis.RedisError, OSError) as exc:
            raise failure(exc, settings) from exc

    return notify


# -- reading ---------------------------------------------------------------------------------------
def _fingerprint(path: Path) -> tuple[str, int, int] | None:
    """``(path, size, mtime)`` of this version of a file; None when it is gone. A file that cannot be looked at (a
    symlink loop, an I/O error, a stale NFS handle) is fingerprinted by its name and error, so it is rejected once."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return (str(path), -1, -(exc.errno or 1))
    return (str(path), st.st_size, st.st_mtime_ns)


_Version = tuple[str, int, int]  # a file version: _fingerprint's (path, size, mtime)


@dataclass
class _Shortages:
    """One step of using a delta (its read, its application) failing for want of a resource of this process: per file
    version the consecutive rounds it failed so, and the versions failing so in the current round. Reads and
    applications keep one each: a read that succeeds says nothing of an application that runs out of memory every
    round (it reset such a delta's tries, and it was retried for ever)."""

    failing: dict[_Version, int] = dataclasses.field(default_factory=dict)  # version -> consecutive rounds failed
    now: set[_Version] = dataclasses.field(default_factory=set)  # versions failing so in this round

    def prune(self, live: set[str]) -> None:
        """Forget the versions of files no longer listed (pruned, replaced)."""
        self.failing = {fp: n for fp, n in self.failing.items() if fp[0] in live}


def transient(exc: BaseException) -> bool:
    """Whether ``exc``, raised reading a delta, is this process short of a resource (not the file at fault)."""
    return isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS)


class DeltaReader:
    """Serving's side: the deltas a model has not seen yet, in order, each checked before it is yielded.

    ``on_reject(path, reason)`` hears of every file rejected (once per file version), ``on_skip(path,
    reason)`` of every delta passed over on purpose (another lineage). Rejections of unreadable files are
    remembered for good (a read failing for want of a resource of this process is first retried, :attr:`retries`,
    up to :data:`TRANSIENT_TRIES` rounds in a row; so is a yielded delta whose application failed so,
    :meth:`retry_apply`); :meth:`mark_unfit` remembers a delta that did not fit the live
    model only until :meth:`forget_unfit` (called when another artifact is swapped in: it may fit that one). With
    ``key`` (serving's signing key) only deltas signed with it are yielded; the others are rejected.
    """

    def __init__(self, directory: Path, on_reject: Callable[[Path, str], None] | None = None,
                 on_skip: Callable[[Path, str], None] | None = None, key: SigningKey | None = None) -> None:
        self.directory = Path(directory)
        self.key = key
        self.gaps = 0  # deltas pruned before this reader got to them
        self.rewinds = 0  # times the directory's numbering went back behind a model's seq (newer re-based)
        self._gapped: list[tuple[int, int]] = []  # missing seqs (first, last) already counted
        self._rewound: set[tuple[int, int]] = set()  # positions (seq, samples) a rewind was already counted at
        # seqs never (again) counted as gaps: those this reader got to (rejected, passed over: their loss is told
        # through on_reject/on_skip) and those counted when pruned between listing and reading; the newest _REMEMBER
        self._settled: set[int] = set()
        self.bad = 0  # unreadable files skipped
        self.on_reject, self.on_skip = on_reject, on_skip
        self._bad: set[tuple[str, int, int]] = set()
        self._unfit: set[tuple[str, int, int]] = set()
        self.retries = 0  # reads or applications of a delta that failed transiently and were left for the next round
        self._reads, self._applies = _Shortages(), _Shortages()  # (kept apart: _Shortages)
        self.retrying: Path | None = None  # the delta the last round ended at, read again next round (None: none)
        self._lineages: dict[tuple[str, int, int], str | None] = {}  # file version -> the lineage read in it

    def mark_bad(self, path: Path, reason: str = "could not be applied") -> None:
        """Never yield this version of ``path`` again."""
        fp = _fingerprint(path)
        if fp is None or fp in self._bad:
            return
        self.bad += 1
        self._bad.add(fp)
        self._settle(path)
        if self.on_reject is not None:
            self.on_reject(path, reason)
        else:
            log.error("delta %s rejected, skipped (the deltas after it still apply): %s", path.name, reason)

    def _retry_later(self, fp: _Version, path: Path, exc: BaseException) -> bool:
        """Whether the read of ``path`` (version ``fp``) that raised ``exc`` is left for the next round: a transient
        failure (``MemoryError``, an errno of :data:`TRANSIENT_ERRNOS`) short of :data:`TRANSIENT_TRIES` rounds in a
        row (:meth:`_again`). Any other failure ends the tries."""
        if not transient(exc):
            self._reads.failing.pop(fp, None)
            return False
        return self._again(self._reads, fp, path, f"could not be read ({type(exc).__name__}: {exc})", "retried")

    def retry_apply(self, path: Path, exc: BaseException) -> bool:
        """Whether delta ``path``, yielded by :meth:`newer`, whose application raised ``exc`` for want of a resource
        of this process (memory, descriptors: the caller's judgement, not a misfit) is yielded again next round rather
        than rejected: the rule of a read failing so (:meth:`_again`), with tries of its own. The caller ends the
        round there (values are absolute: no later delta applies before it). A misfit it is not: rejected as one, its
        rows were lost until the next artifact while the later deltas stepped past it."""
        fp = _fingerprint(path) or (str(path), -1, 0)  # (gone meanwhile: the next round finds it missing)
        return self._again(self._applies, fp, path, f"could not be applied ({type(exc).__name__}: {exc})",
                           "applied again")

    def _again(self, shortages: _Shortages, fp: _Version, path: Path, failure: str, again: str) -> bool:
        """The one rule for a delta (version ``fp`` of ``path``) one of whose steps just failed for want of a resource
        of this process: tried again next round, counted in :attr:`retries` and logged, up to :data:`TRANSIENT_TRIES`
        rounds in a row, then given up on (False: the caller rejects it). A second failure in one round (:meth:`newer`
        with ``same_round``) counts no further try: the tries are rounds of freshness, not attempts."""
        if fp in shortages.now:
            return True
        tries = shortages.failing.pop(fp, 0) + 1
        if tries >= TRANSIENT_TRIES:
            return False
        shortages.failing[fp] = tries
        shortages.now.add(fp)
        self.retries += 1
        log.warning("delta %s %s, this process is short of a resource; no later delta applies before it, it is %s "
                    "next round (try %d of %d)", path.name, failure, again, tries, TRANSIENT_TRIES)
        return True

    def mark_unfit(self, path: Path) -> None:
        """Do not yield this version of ``path`` again until :meth:`forget_unfit`."""
        fp = _fingerprint(path)
        if fp is not None:
            self._unfit.add(fp)
            self._settle(path)

    def forget_unfit(self) -> None:
        self._unfit.clear()

    def _vanish(self, seq: int, after_seq: int, lineage: str | None) -> None:
        """Delta ``seq`` was listed and is gone before it was read: pruned unread, a gap like one never listed (counted
        once, here, and not again when a later round finds it missing), unless a restart of ``lineage`` removed it as a
        dead branch (:func:`read_abandoned`). As for every gap, only past a known place (``after_seq`` > 0)."""
        if after_seq == 0 or seq in self._settled or _covered(seq, seq, read_abandoned(self.directory, lineage)):
            return
        self._settle(seq)
        self.gaps += 1
        log.warning("delta %d was pruned before serving read it; its rows wait for the next artifact", seq)

    def _settle(self, delta: Path | int) -> None:
        """Never count the seq of ``delta`` (a delta file or its seq) as a gap; the newest :data:`_REMEMBER` kept."""
        parsed = (delta, 0) if isinstance(delta, int) else _parse_name(delta, SUFFIX)
        if parsed is None:
            return
        self._settled.add(parsed[0])
        if len(self._settled) > _REMEMBER:
            self._settled.discard(min(self._settled))

    def _foreign(self, path: Path, lineage: str | None) -> bool:
        """Whether delta ``path`` is of another lineage than ``lineage`` (both known): an earlier training's delta
        left in the directory, which says nothing of this lineage's numbering. Read (whole, checked) once per file
        version, only for a delta :meth:`newer` would otherwise take for a rewind; one that cannot be read is not
        known foreign. Without it a new lineage's model (numbered after the earlier training's deltas, trained to
        fewer samples) counted a rewind at every round and applied its own deltas again each time."""
        fp = _fingerprint(path)
        if lineage is None or fp is None:
            return False
        if fp not in self._lineages:
            try:
                self._lineages[fp] = load_delta(path, self.key).lineage
            except (DeltaError, OSError, MemoryError, ValueError, RecursionError):
                return False
        theirs = self._lineages[fp]
        return theirs is not None and theirs != lineage

    def latest_seq(self) -> int:
        found = list_deltas(self.directory)
        return found[-1][0] if found else 0

    def newer(self, after_seq: int, after_samples: int, lineage: str | None = None,
              applied_samples: int | None = None, same_round: bool = False) -> Iterator[Delta]:
        """Checked deltas with ``seq > after_seq``, oldest first, of ``lineage`` (when both it and the delta have
        one); with ``after_seq`` 0 (the model's place in the numbering not known, or re-based below) only those with
        ``samples_trained > after_samples``: the others are already in the model's source checkpoint. Skipped by
        name, never read (module docstring: a learner's count goes back when its restore does).

        ``after_seq``: the last delta the model holds (a fresh artifact's: the seq its source checkpoint includes,
        ``source.delta_seq``, or 0 when it does not say); deltas missing between it and the first one listed after
        it were pruned unread and are counted in :attr:`gaps` (once per missing range). ``applied_samples``: the
        largest ``samples_trained`` the model holds (None: not known, the second rewind test below is not made).

        A stream that went backwards (the directory's latest seq below ``after_seq``, or a delta at or below it that
        was trained past ``applied_samples`` and is not of another lineage, :meth:`_foreign`: the numbering
        restarted, so those seqs were never applied) would be
        skipped forever (a latest seq below it is no rewind when a restart of ``lineage`` recorded every seq after it
        up to ``after_seq`` abandoned, :func:`read_abandoned`: the restart has written nothing newer yet); instead it
        is counted in :attr:`rewinds`, logged once per position, and the model is re-based on ``samples_trained``:
        every delta newer than ``after_samples`` comes, in seq order, as for a model that holds none (values are
        absolute, so the result is the learner's current rows). A delta whose seq a restart of ``lineage`` recorded
        abandoned is never read: a dead branch the restart could not remove (a directory refusing removals).

        ``same_round``: this call is part of the previous one's round (serving reads the deltas for a new artifact,
        then for the live model, in one check): a delta whose read failed transiently in that round and fails so again
        counts no second try of its :data:`TRANSIENT_TRIES`, which are rounds (nor does one whose application failed
        so again, :meth:`retry_apply`). A delta the caller goes on past (asks for the next one: applied, or rejected)
        starts its application's tries afresh."""
        self.retrying = None
        if not same_round:
            self._reads.now, self._applies.now = set(), set()
        found = list_deltas(self.directory)
        live = {str(p) for _, _, p in found}
        self._bad = {fp for fp in self._bad if fp[0] in live}  # forget files that are gone
        self._reads.prune(live)
        self._applies.prune(live)
        self._lineages = {fp: lin for fp, lin in self._lineages.items() if fp[0] in live}
        dead = read_abandoned(self.directory, lineage) if found else []  # the ranges a restart of lineage abandoned
        if dead:  # a dead branch a restart could not remove is never read
            found = [f for f in found if not _covered(f[0], f[0], dead)]
        held = after_samples if applied_samples is None else max(after_samples, applied_samples)
        latest = found[-1][0] if found else 0
        passed = applied_samples is not None and any(s <= after_seq and n > held and not self._foreign(p, lineage)
                                                     for s, n, p in found)
        # (not when a restart of the lineage removed every seq past the latest: nothing newer yet)
        behind = latest < after_seq and _covered(latest + 1, after_seq, dead) < after_seq - latest
        if after_seq > 0 and found and (behind or passed):
            if (after_seq, held) not in self._rewound:
                if len(self._rewound) > _REMEMBER:
                    self._rewound.clear()
                self._rewound.add((after_seq, held))
                self.rewinds += 1
                self._settled.clear()  # (seqs of the numbering that went back: the new one's same seqs are others)
                self._gapped.clear()
                log.warning("the deltas in %s went backwards (latest seq %d, trained to %d samples) behind this "
                            "model's seq %d (trained to %d): the learner's numbering restarted (its deltas directory "
                            "was emptied or replaced); re-basing on samples_trained: every delta past %d samples "
                            "applies, in seq order", self.directory, latest, max(n for _, n, _ in found), after_seq,
                            held, after_samples)
            after_seq = 0
        expected = after_seq + 1
        for seq, samples, path in found:
            if seq <= after_seq:
                continue
            if seq > expected and after_seq > 0:
                # (less those a restart removed as a dead branch: their rows went out again, nothing was lost; and
                # those counted already: when they vanished after a listing, or in a round that saw the same hole
                # end at another delta, one since pruned; and those this reader got to: not pruned unread)
                gone = seq - expected - _covered(expected, seq - 1,
                                                 dead + self._gapped + [(v, v) for v in self._settled])
                if gone:
                    if len(self._gapped) > _REMEMBER:
                        self._gapped.clear()
                    self._gapped.append((expected, seq - 1))
                    self.gaps += gone
                    log.warning("%d of deltas %d..%d were pruned before serving read them; their rows wait for the "
                                "next artifact", gone, expected, seq - 1)
            expected = seq + 1
            if samples <= after_samples and after_seq == 0:
                continue
            fp = _fingerprint(path)
            if fp is None:
                self._vanish(seq, after_seq, lineage)
                continue
            if fp in self._bad or fp in self._unfit:
                continue
            try:
                d = load_delta(path, self.key)
            except FileNotFoundError:
                self._vanish(seq, after_seq, lineage)
                continue
            except (DeltaError, OSError, MemoryError, ValueError, RecursionError) as exc:
                if self._retry_later(fp, path, exc):  # this process short of a resource: the round ends here
                    self.retrying = path
                    return
                # damaged, malformed, or unreadable (permissions, I/O): one file must not stop the updates after it
                self.mark_bad(path, (str(exc) if isinstance(exc, (DeltaError, OSError)) else f"{type(exc).__name__}: "
                                     f"{exc}") + (f" ({TRANSIENT_TRIES} reads in a row)" if transient(exc) else ""))
                continue
            self._reads.failing.pop(fp, None)  # (not its application's tries: they are rounds of their own)
            self._lineages[fp] = d.lineage
            if lineage is not None and d.lineage is not None and d.lineage != lineage:
                self._unfit.add(fp)
                self._settle(seq)
                if self.on_skip is not None:
                    self.on_skip(path, f"lineage {d.lineage} is not the live artifact's {lineage}")
                continue
            yield d
            self._applies.failing.pop(fp, None)  # gone on past: applied, or rejected as a misfit
