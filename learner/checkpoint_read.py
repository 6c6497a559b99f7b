"""Reading checkpoints: one file, safely (:func:`load`: tensors, numpy arrays and plain containers only, every
record against its CRC-32, every trained tensor finite), and the newest that loads, falling back past damaged ones
(:func:`load_latest`; the learner's resume: :func:`restore_latest`); the newest sidecar's metadata for
``streamrec train --status`` (:func:`latest_meta`). Why loads are weights-only: ``learner/checkpoint.py`` ("Loading").
"""

from __future__ import annotations

import io
import json
import logging
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from learner.checkpoint_files import _PREFIX, DAMAGED, REFUSED, list_checkpoints
from learner.checkpoint_format import Checkpoint, CheckpointError, _opened
from stream.errors import StreamrecError
from stream.files import MAX_STATE_FILE_BYTES, describe_os_error, open_regular, read_regular

log = logging.getLogger("streamrec.checkpoint")


def _numpy_globals() -> list[Any]:
    """What ``torch.load(weights_only=True)`` needs to rebuild numpy arrays (the metrics' histograms)."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 | 1
    dtypes = [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    return [np.ndarray, np.dtype, core.multiarray._reconstruct, *dtypes]


def _check_crcs(path: Path, fh: BinaryIO) -> None:
    """Raise ``ValueError`` when a record of the checkpoint's zip fails the CRC-32 its writer stored.

    ``torch.load`` does not check them: a checkpoint damaged on disk inside a tensor (a flipped bit, a bad sector
    read back as other bytes) loaded as a model with wrong weights, which the learner resumed and the refresh
    published without a word. Checked, it is a damaged file like a torn one (:func:`load_latest` falls back to the
    previous checkpoint and reports it). A record stored without a CRC (0: a writer that turned them off) is not
    checked; a file that is not a zip is left to ``torch.load`` to refuse. About 3 GB/s (zlib's crc32)."""
    try:
        archive = zipfile.ZipFile(fh)
    except zipfile.BadZipFile:
        return
    with archive:
        for info in archive.infolist():
            if info.CRC == 0:
                continue
            try:
                with archive.open(info) as member:  # raises BadZipFile at its end when the CRC differs
                    while member.read(8 << 20):
                        pass
            except zipfile.BadZipFile as exc:
                raise ValueError(f"checkpoint {path} is damaged: {exc}") from None


def load(path: Path, safe: bool = True) -> dict[str, Any]:
    """One checkpoint file: tensors, numpy arrays and plain containers only (no code runs; anything else is an
    ``UnpicklingError`` naming the global), every record matching its CRC-32 (:func:`_check_crcs`). ``safe`` is
    kept for older callers: every load is safe. Opened with :func:`~stream.files.open_regular`: a FIFO or a device
    named like a checkpoint is refused unread (``NotRegularFile``, a damaged file to :func:`load_latest`) instead of
    hanging the learner's or the refresh's start."""
    del safe  # every load is weights-only (module docstring)
    with open_regular(Path(path)) as (raw, _), io.BufferedReader(raw, 1 << 20) as fh:
        _check_crcs(path, fh)
        fh.seek(0)
        with torch.serialization.safe_globals(_numpy_globals()):
            ckpt = torch.load(fh, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict):
        raise ValueError(f"checkpoint {path} holds a {type(ckpt).__name__}, not a dict")
    _check_finite(path, ckpt)
    return ckpt


_TRAINED = ("model", "sparse_opt", "dense_opt")  # the parts training reads: a NaN there makes every later loss NaN


def _check_finite(path: Path, ckpt: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first tensor of the model or an optimizer's state that holds a NaN or an inf.
    Its CRCs match, but such a checkpoint (a training that blew up, a crafted file) loaded as the model: every later
    loss was NaN and every step skipped, and the refresh built an artifact from it. It is a damaged file like a torn
    one (:func:`load_latest` reports it and uses the previous one)."""
    stack: list[tuple[str, Any]] = [(part, ckpt.get(part)) for part in _TRAINED]
    while stack:
        where, value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise ValueError(f"checkpoint {path} is damaged: {where} holds non-finite values (NaN/inf)")
        elif isinstance(value, Mapping):
            stack.extend((f"{where}.{k}", v) for k, v in value.items())
        elif isinstance(value, list | tuple):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))


def _reason(exc: BaseException) -> str:
    """One line of why a file did not load (torch's weights-only errors are a page long)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    line = next((ln for ln in lines if "Unsupported global" in ln), lines[0] if lines else "")
    return f"{type(exc).__name__}: {line[:300]}"


# Not the file's fault, so never a reason to skip it for an older one (its training would be thrown away unseen): the
# process is out of host or device memory. Raised as they are; the next start reads the newest checkpoint again.
_NOT_DAMAGE = (MemoryError, torch.OutOfMemoryError)


def load_latest(directory: Path, safe: bool = True, problems: list[tuple[Path, str]] | None = None,
                accept: Callable[[Checkpoint], object] | None = None,
                check: Callable[[Checkpoint], object] | None = None,
                between: Callable[[], object] | None = None) -> Checkpoint | None:
    """The newest checkpoint that loads (safely: :func:`load`); a corrupt or foreign newest one is reported and
    the previous one used.

    ``problems`` (when given) receives ``(path, reason)`` of every file skipped on the way. ``accept`` (the refresh's
    artifact check): a checkpoint that loads but that it refuses (by raising), or that
    :func:`~learner.checkpoint_format.upgrade` refuses (a newer format, no format version), is skipped the same way, so
    one policy covers every bad newest file. Without it an upgrade failure is raised (the learner must not resume from
    an older checkpoint past a file a newer streamrec wrote). ``check`` (the learner's resume, without ``accept``): a
    checkpoint that loads but does not fit the model its own config describes (the check raises anything but a
    :class:`StreamrecError`: a tensor of another shape, a missing key, a negative offset) is skipped as damaged; a
    ``StreamrecError`` (other shaping settings, another topic: the operator's to decide) is raised, and so is an
    ``OSError`` (the check reads and writes the directory's ``LINEAGE``, not the file); a file this process may not
    read (``PermissionError``) is a :class:`CheckpointError` naming it and the fix, not a damaged one (the refresh,
    with ``accept``, skips it as unreadable). Out of memory (``_NOT_DAMAGE``)
    is no damaged file on any path: it is raised, and the previous checkpoint is not used. A meta whose shaping
    settings, topic or lineage has another type (:func:`~learner.checkpoint_format.mistyped`) is a damaged file on every
    path (skipped, in ``problems``).

    A listed file that is gone when it is opened was pruned by a learner saving meanwhile (``save`` keeps the last
    ``keep``), so newer ones exist: that is no damaged file (not in ``problems``); the directory is listed again and
    the newest file not tried yet is read. Falling back to the older files instead found them pruned too (the
    refresh failed "no checkpoint loads") or published from behind newer ones with a degraded alert.

    ``between`` (the refresh's stop check) is called before each file after the first is read, outside any
    ``except``: what it raises ends the walk (a stop need not wait while every older checkpoint is read)."""
    tried: set[Path] = set()
    pending = list(reversed(list_checkpoints(directory)))
    while pending:
        if tried and between is not None:
            between()
        path = pending.pop(0)
        tried.add(path)
        try:
            raw = load(path, safe=safe)
        except FileNotFoundError:
            log.info("checkpoint %s was pruned while being read (a learner saved meanwhile); listing again", path)
            pending = [p for p in reversed(list_checkpoints(directory)) if p not in tried]
            continue
        except _NOT_DAMAGE:
            raise
        except PermissionError as exc:
            if accept is not None:  # (the refresh publishes the previous one, reported; it sets nothing aside)
                _skip(path, "is unreadable", exc, problems)
                continue
            raise _unreadable(path, exc) from None
        except Exception as exc:  # noqa: BLE001 - a torn or corrupt file: fall back to the previous one
            _skip(path, "is unreadable", exc, problems)
            continue
        if accept is None:
            try:
                ckpt = _opened(path, raw)
            except CheckpointError:
                raise
            except ValueError as exc:  # a mistyped meta: damaged
                _skip(path, "is damaged", exc, problems)
                continue
            try:
                if check is not None:
                    check(ckpt)
            except (StreamrecError, OSError, *_NOT_DAMAGE):
                raise
            except Exception as exc:  # noqa: BLE001 - its content does not fit its own model: damaged
                _skip(path, "does not fit its own model", exc, problems)
                continue
            return ckpt
        try:
            ckpt = _opened(path, raw)
            accept(ckpt)
        except _NOT_DAMAGE:
            raise
        except Exception as exc:  # noqa: BLE001 - refused (diverged, foreign shape, newer format): the previous one
            _skip(path, "is refused", exc, problems)
            continue
        return ckpt
    return None


def _unreadable(path: Path, exc: OSError) -> CheckpointError:
    """The learner's resume of a checkpoint this process may not read (EACCES: a backup tool's or another user's
    mode). Not damage: the file is whole. Taken as damaged, the learner resumed the previous checkpoint, set the
    newest aside and pruned it, discarding for good everything trained between them."""
    return CheckpointError(f"checkpoint {path} cannot be read ({describe_os_error(exc)}): give the learner's user "
                           "read access to it (chmod/chown) and restart, or move it away to resume from the one "
                           "before it")


def _skip(path: Path, what: str, exc: Exception, problems: list[tuple[Path, str]] | None) -> None:
    reason = _reason(exc)
    log.warning("checkpoint %s %s (%s); trying the previous one", path, what, reason)
    if problems is not None:
        problems.append((path, reason))


def restore_latest(directory: Path, check: Callable[[Checkpoint], object] | None = None) -> Checkpoint | None:
    """What the learner resumes from (``check`` loads it into the learner: :func:`load_latest`), None in a
    directory without checkpoints, and a
    :class:`CheckpointError` naming every file and why when there are checkpoints but none loads (a learner
    must not silently start a new model over a directory of unreadable or foreign files)."""
    problems: list[tuple[Path, str]] = []
    ckpt = load_latest(directory, safe=True, problems=problems, check=check)
    if ckpt is None and not problems:  # only checkpoints set aside (``checkpoint_files.set_aside``): as refused now
        problems = [(p, "set aside by an earlier restart: it did not load")
                    for p in sorted([*Path(directory).glob(f"{_PREFIX}*.pt{DAMAGED}"),
                                     *Path(directory).glob(f"{_PREFIX}*.pt{REFUSED}")])]
    if ckpt is None and problems:
        raise CheckpointError(f"no checkpoint in {directory} loads: "
                              + "; ".join(f"{p}: {why}" for p, why in problems)
                              + ". They were refused without running anything in them; move them away to train "
                              "a new model there, or restore good ones")
    return ckpt


def latest_meta(directory: Path) -> dict[str, Any] | None:
    """The newest checkpoint's metadata, from its JSON sidecar, with its ``path``; None when no checkpoint has one.
    A sidecar that cannot be read or holds no JSON object (torn, edited, a disk error) is passed over with a warning
    naming it, and the next older one answers: ``streamrec train --status`` printed a traceback instead."""
    for path in reversed(list_checkpoints(directory)):
        side = path.with_suffix(".json")
        try:
            meta = json.loads(read_regular(side, MAX_STATE_FILE_BYTES, "a checkpoint's metadata"))
        except FileNotFoundError:
            continue
        except (OSError, ValueError, RecursionError) as exc:  # (JSONDecodeError, UnicodeDecodeError: ValueErrors)
            log.warning("the metadata of %s cannot be read (%s: %s); reporting an older checkpoint", path.name,
                        type(exc).__name__, exc)
            continue
        if not isinstance(meta, dict):
            log.warning("the metadata of %s is not a JSON object; reporting an older checkpoint", path.name)
            continue
        meta["path"] = str(path)
        return meta
    return None
