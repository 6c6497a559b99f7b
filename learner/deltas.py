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
    lineage          the learner's checkpoint lineage (``learner/checkpoint_lineage.py``), or null when unknown
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
resends every row with its first delta (:meth:`~learner.delta_writer.DeltaWriter.resend_all`), so serving ends on its
state. A delta of another lineage (a learner restarted from scratch, another learner's directory) never applies to an
artifact whose manifest names a different lineage; when either side has none (files written before
lineages existed, a writer built without one), ``samples_trained`` alone decides.

Numbering: a seq is never used twice by one checkpoint lineage, even when the deltas directory is emptied or
replaced (a new volume, an operator's ``rm``) while the checkpoints stay: before a delta takes a new seq, the
writer records it in ``<checkpoint_dir>/DELTA_SEQ`` (beside ``LINEAGE``; :data:`SEQ_FILE`), and a writer starts
after the larger of that and the directory's largest file. Serving, which skips every delta at or below the seq it
applied, would otherwise skip a restarted numbering without a word; it also notices a stream that went backwards
anyway (a learner from before this file, another directory) and re-bases
(:meth:`~learner.delta_reader.DeltaReader.newer`). A restored learner removes the deltas numbered past its checkpoint's
``delta_seq`` (:meth:`~learner.delta_writer.DeltaWriter.abandon_after`): they are of the training the restore threw
away, and an artifact of a later checkpoint mistook them for such a restart. The rows they carry are marked first, so
its first delta sends them with its values (serving may have applied them), and the range is recorded in the deltas
directory's :data:`ABANDONED` before any goes: a reader missing them lost nothing and counts no gap
(:func:`read_abandoned`).

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
daemon fsyncs the list with every checkpoint (:meth:`~learner.delta_writer.DeltaWriter.sync`), so each row trained
before a durable checkpoint is in a delta or in the list; rows trained after it are trained again on restart. (A list
that cannot be synced is logged and the checkpoint still written: a side output never holds training's state back.)
At a clean exit the daemon writes one last delta just before its final checkpoint (same ``samples_trained``:
an artifact of that checkpoint already holds it and skips it by name, and the checkpoint's ``delta_seq`` includes
it, so a fresh model that never saw it counts no gap when it is pruned unread).

Id maps after a restart: a restored learner's id maps are its checkpoint's, while serving may hold the maps and rows
of deltas written after that checkpoint (a row given from id A to id B and trained as B's). The restore marks every
admitted id's row (``RowMapper.owned_rows``; on N ranks each rank its shares', ``ShardedRowMapper.owned_rows``), and the
first delta after it carries the maps (they are due at a writer's start), so serving gets the maps together with every
row they give an id: no id is left on a row that holds another id's vector (the reverse of
:meth:`~learner.delta_writer.DeltaWriter.hold`). Its size: (8 + 4 (D + 1)) bytes per admitted id on top of the maps:
measured, 117 MB per million admitted ids at D = 16 (the maps alone 41 MB), so about 1.2 GB for 10 M; past the reader's
limit it goes out in parts (below).

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

Reading (:class:`~learner.delta_reader.DeltaReader`, :func:`load_delta`): a delta is checked whole before any of it is
used: where it lies (a file that is a symlink resolving outside its directory is refused unread; the file is opened
once, in its directory, without following a symlink, and checked and read from that descriptor), checksum,
signature (with a key), structure and types, ``seq``/``samples_trained`` equal to its file name, rows 1-D int64,
vectors (R, D + 1) float32, dense weights floating and every value finite. A file that fails is a
:class:`DeltaError`, rejected once (remembered by path, size and mtime), reported through ``on_reject``
and skipped: the deltas after it still apply. A read that fails for want of a resource of the reading process
(:data:`TRANSIENT_ERRNOS`, ``MemoryError``) says nothing of the file: it ends the round there and is retried on the
next (:data:`TRANSIENT_TRIES`); so is a delta whose application failed so (the caller's word,
:meth:`~learner.delta_reader.DeltaReader.retry_apply`). What a skipped delta carried is lost until a later delta touches
the same rows again (dense weights: the very next delta, since each carries them whole) or the next full artifact
arrives. Whether a delta fits a particular model (row range, dimensions, dense names and shapes) is checked by
``ScoringModel.apply_delta`` before it changes anything.

Here: the format, the names, the seq and abandoned-range files, and the encoding, decoding and reading of one file.
The two sides that use them: :class:`~learner.delta_writer.DeltaWriter` (the learner) in ``delta_writer.py``,
:class:`~learner.delta_reader.DeltaReader` (serving) in ``delta_reader.py``.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learner.tensorpack import PackError, SignatureError, SigningKey, is_signed, pack, unpack
from stream.errors import StreamrecError
from stream.files import MAX_STATE_FILE_BYTES, OutsideDirectory, open_entry, read_regular, resolved_entry

log = logging.getLogger("streamrec.deltas")

FORMAT = 2
KIND = "streamrec-delta"
_PREFIX = "delta-"
SUFFIX = ".delta"
_LEGACY_SUFFIX = ".pt"  # format 1
_NAME = re.compile(r"delta-(\d{1,18})-(\d{1,18})")
PENDING = "pending-rows.i64"  # rows marked since the last delta, int64 little-endian (a restarted writer's)
SEQ_FILE = "DELTA_SEQ"  # in the checkpoint directory: the largest seq its lineage's writers took (ASCII integer)
ABANDONED = "abandoned-seqs"  # the seqs restarts removed as a dead branch: "<first> <last> <lineage>" a line (ASCII)
ABANDONED_KEEP = 64  # ranges kept in it (one per restart that removed any)
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
    lineage: str | None = None  # the learner's checkpoint lineage (learner/checkpoint_lineage.py)
    signed: bool = False  # the file is a signed pack (checked against the key when the reader has one)


def delta_path(directory: Path, seq: int, samples_trained: int) -> Path:
    """``delta-<seq>-<samples_trained>.delta``: readers skip deltas by name, without loading them."""
    return directory / f"{_PREFIX}{seq:012d}-{samples_trained:015d}{SUFFIX}"


def parse_name(p: Path, suffix: str) -> tuple[int, int] | None:
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
        parsed = parse_name(p, SUFFIX)
        if parsed is not None:
            out.append((*parsed, p))
    return sorted(out)


def max_seq(directory: Path) -> int:
    """The largest seq among current and format-1 files and the ranges restarts removed (:data:`ABANDONED`): a
    restarted or upgraded writer continues after it. Without the ranges, a second restart before the first one's
    first delta numbered the removed seqs again when ``DELTA_SEQ`` could not be written (a full checkpoint volume):
    serving, past them, skipped the new ones."""
    seqs = [s for s, _, _ in list_deltas(directory)] + [b for _, b, _ in read_abandoned_file(directory / ABANDONED)]
    seqs += [parsed[0] for p in directory.glob(f"{_PREFIX}*{_LEGACY_SUFFIX}")
             if (parsed := parse_name(p, _LEGACY_SUFFIX)) is not None]
    return max(seqs, default=0)


def read_abandoned_file(path: Path) -> list[tuple[int, int, str]]:
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
    (:meth:`~learner.delta_writer.DeltaWriter.abandon_after`): missing to a reader, but not pruned unread (their rows
    went out again)."""
    return [(a, b) for a, b, lin in read_abandoned_file(Path(directory) / ABANDONED) if lineage in (None, lin)]


def covered(first: int, last: int, ranges: list[tuple[int, int]]) -> int:
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


def rough_bytes(obj: Any) -> int:
    """An upper bound of what ``obj`` (tensors, arrays, and containers of them) adds to a delta file: its data, plus
    room for each leaf's header and alignment. Lets :meth:`~learner.delta_writer.DeltaWriter._parts` skip encoding a
    delta twice to measure it: only one this bound puts near :data:`MAX_BYTES` is measured exactly."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size() + 512
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes) + 512
    if isinstance(obj, dict):
        return sum(rough_bytes(k) + rough_bytes(v) for k, v in obj.items()) + 64
    if isinstance(obj, (list, tuple)):
        return sum(rough_bytes(v) for v in obj) + 64
    if isinstance(obj, (str, bytes)):
        return 6 * len(obj) + 64  # (JSON writes a char in at most 6 bytes: \\uXXXX)
    return 64


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
    if not (type(seq) is int and seq >= 1):
        raise DeltaError(f"{where}: seq {str(seq)[:40]!r}, expected an integer >= 1")
    if not (type(samples) is int and samples >= 0):
        raise DeltaError(f"{where}: samples_trained {str(samples)[:40]!r}, expected an integer >= 0")
    if not (isinstance(created, (int, float)) and not isinstance(created, bool) and math.isfinite(created)):
        raise DeltaError(f"{where}: created {str(created)[:40]!r}, expected a finite unix time")
    named = parse_name(path, SUFFIX)
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
        return resolved_entry(path, path.parent)
    except OutsideDirectory as exc:
        if exc.target is None:  # a symlink loop
            raise DeltaError(f"delta {path}: {exc}; refused unread") from None
        raise DeltaError(f"delta {path}: resolves to {exc.target}, outside the deltas directory {exc.home} (a "
                         "symlink): refused unread; deltas are plain files written there by the learner") from None


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


def transient(exc: BaseException) -> bool:
    """Whether ``exc``, raised reading a delta, is this process short of a resource (not the file at fault)."""
    return isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS)
