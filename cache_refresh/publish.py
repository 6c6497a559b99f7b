"""Writing a publish root: publish, rollback and the pin, pruning, the refresh lock, cleanup of killed runs.

The layout of a root is ``learner/artifact.py``, every reader of it ``learner/artifact_versions.py``; this module is the
only writer.

Publishing: an artifact is staged in ``<root>/.staging/`` (``learner.artifact.build_artifact``), fsynced,
verified (every file against the manifest), renamed into ``versions/`` (same file system, so the rename
is atomic) and only then named in ``CURRENT`` (``stream.files.write_atomic``: temp file, fsync,
``os.replace``, fsync of the directory). A crash at any point leaves ``CURRENT`` naming a complete
version (tested with SIGKILLs at every step, ``tests/integration/test_faults_serving.py``). Once ``CURRENT`` names it,
the version is added to ``<root>/CURRENT_HISTORY`` (:data:`HISTORY`, best effort; after the ``CURRENT`` write, never
before, so the history never names a version that was not current). A ``CURRENT`` that cannot
be written (full or read-only file system) takes the new version back out of ``versions/``: nothing
half-published stays. The last ``keep`` versions (and always the current one, and those a live scoring process
serves: ``served``, read from Redis by the run, ``serving/served_versions.py``) are kept; a pruned version
is renamed to a hidden ``versions/.trash-*`` before it is deleted, so a killed prune never leaves a
half-deleted version behind. A refresh holds :func:`refresh_lock` for its run (one refresh per root at a
time) and first removes what killed runs left (:func:`clean_leftovers`: staged directories of dead
processes, trash, temp files); serving never reads any of them. From its move until ``CURRENT`` and the history name
the version, a publish also holds :data:`PUBLISHING` (naming the version): ``streamrec refresh --status`` shows that
version as ``publishing``, not as never current (:func:`unfinished`), and a killed publish's as never current again.

Rollback and the pin: :func:`rollback` goes to the version live just before the current one, by the history (a
version a killed publish moved into ``versions/`` without making it current is complete and verifies, and was chosen
by its name), then to those that predate the history (a root written before it was kept: chosen by name, as before),
never to a version a rollback went back from (the history's rollback records name it, ``from``; before, a rollback
after a rollback and a publish went to the version the operator had rolled back from). It
verifies the older version, writes ``<root>/PINNED`` (JSON
``{"version", "rolled_back_from", "at"}``) and then points ``CURRENT`` at it. While ``PINNED`` names the
live version, serving applies no learner deltas to it: the learner kept training past the newer
artifact, so every delta it writes belongs to the model the operator just rolled away from (its dense
weights would bring that model back). The pin is the operator's decision, so only an operator ends it:
``publish(over_pin=True)`` (``streamrec refresh --now``) removes it; ``publish(over_pin=False)`` (the
scheduled refresh) raises :class:`PinHeld` and changes nothing. A pin naming another version than
``CURRENT`` (a crash between the two writes) is stale and ignored; an unreadable pin is treated as a pin
(fail closed: the model is staler, never the wrong one).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import stat
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from learner.artifact import verify
from learner.artifact_manifest import MANIFEST
from learner.artifact_versions import (
    CURRENT,
    PIN,
    STAGING,
    ArtifactError,
    Pin,
    current_version,
    is_version_name,
    list_versions,
    pin_holding,
    read_pin,
    versions_dir,
)
from learner.tensorpack import SigningKey
from stream.errors import shown
from stream.files import (
    MAX_STATE_FILE_BYTES,
    TMP_MARK,
    NotDurable,
    describe_os_error,
    fsync_dir,
    leftover_writer_alive,
    read_regular,
    write_atomic,
)

log = logging.getLogger("streamrec.publish")

LOCK = ".refresh.lock"
# Held (flock, exclusive) by a publish from before it moves its version into versions/ until CURRENT and the history
# name it (or it has taken the version back out); holds that version's name. A status probes it (shared, not
# waiting): held, the version named is being published, not "never current" (:func:`unfinished`). The kernel releases
# it when the publisher dies: a killed publish's version is never_current again at once.
PUBLISHING = ".publishing.lock"
PUBLISHING_WAIT_S = 10.0  # the longest a publish waits for a status's probe of PUBLISHING (_publishing)
HISTORY = "CURRENT_HISTORY"  # JSON: the versions CURRENT has named, oldest first (_record_current); rollback reads it
_HISTORY_MAX = 1000  # entries kept: far more than keep_versions, so a version still held is never forgotten
TRASH = ".trash-"  # versions/.trash-<version>-<pid>: a pruned version being removed (list_versions skips it)
_STALE_STAGING_S = 3600.0


class PinHeld(ArtifactError):
    """``publish(..., over_pin=False)`` found a rollback pin holding the live version; nothing changed."""

    def __init__(self, message: str, pin: Pin) -> None:
        super().__init__(message)
        self.pin = pin


class RefreshBusy(ArtifactError):
    """:func:`refresh_lock` is held by another run (``holder``: the pid written in the lock, or "unknown"): not a
    failure of this one, which did nothing; the other run is the one refreshing."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


# -- leftovers and the lock ------------------------------------------------------------------------
_PID_RE = re.compile(r"-(\d+)(?:-\d+)?$")  # <version>-<pid> (staging), .<name>.tmp-<pid>-<thread> (temp files)


def _owner_gone(name: str) -> bool:
    """Whether the process named at the end of ``name`` is gone from this host (False when unsure). This process's
    own pid counts as gone (``stream.files.leftover_writer_alive``): the caller holds the lock, so nothing of this
    process is being written, and a container's refresh has the same pid (1) on every run."""
    m = _PID_RE.search(name)
    return m is not None and not leftover_writer_alive(int(m.group(1)))


def clean_leftovers(root: Path) -> list[str]:
    """Remove what killed refreshes left under ``root``; returns the paths removed (relative to ``root``).

    That is: staged artifacts (``.staging/<version>-<pid>``) whose process is gone or that are older than an
    hour (a ``.staging`` that is a symbolic link: the link, never its target), versions a killed prune had begun to
    remove (``versions/.trash-*``), and temp files of
    ``stream.files.write_atomic`` whose process is gone ("gone" includes this process's own pid: an earlier
    process's, e.g. a container's pid 1). Call it holding :func:`refresh_lock`, so that no other refresh is
    building and this one has nothing in flight: a staged directory of another live process is never touched.
    None of these is ever read by serving or named by ``CURRENT``; removing them only frees the space (a staged
    artifact holds a whole copy of the cold rows).
    """
    root = Path(root)
    removed: list[str] = []

    def rm(path: Path) -> None:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(str(path.relative_to(root)))
        except OSError as exc:
            log.warning("could not remove the leftover %s (%s)", path, exc)

    staging = root / STAGING
    fd = -1
    if not staging.is_symlink():
        try:  # by a descriptor opened without following: a symlink put there after the check is not followed
            fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:  # none there; or a link put there after the check (ELOOP, ENOTDIR): below
            pass
    if fd < 0 and staging.is_symlink():  # no refresh makes one: followed, the cleanup deleted old entries of any dir
        try:
            target = os.readlink(staging)
        except OSError as exc:  # removed meanwhile
            target = describe_os_error(exc)
        log.warning("%s is a symbolic link (to %s), which no refresh makes: removing the link, not its target",
                    staging, target)
        rm(staging)
    elif fd >= 0:
        try:
            for name in sorted(os.listdir(fd)):
                try:
                    old = time.time() - os.stat(name, dir_fd=fd).st_mtime > _STALE_STAGING_S
                except OSError:
                    continue
                if old or _owner_gone(name):
                    try:
                        if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                            os.unlink(name, dir_fd=fd)
                        elif sys.version_info >= (3, 11):
                            shutil.rmtree(name, dir_fd=fd)
                        else:  # no dir_fd before 3.11: by its path (a link swapped in at once is followed)
                            shutil.rmtree(staging / name)
                        removed.append(f"{STAGING}/{name}")
                    except OSError as exc:
                        log.warning("could not remove the leftover %s (%s)", staging / name, exc)
        finally:
            os.close(fd)
    versions = versions_dir(root)
    if versions.is_dir():
        for d in sorted(versions.iterdir()):
            if d.name.startswith(TRASH):
                rm(d)
    if root.is_dir():
        for f in sorted(root.iterdir()):
            if f.name.startswith(".") and TMP_MARK in f.name and f.is_file() and _owner_gone(f.name):
                rm(f)
    return removed


@contextlib.contextmanager
def refresh_lock(root: Path) -> Iterator[None]:
    """Hold ``<root>/.refresh.lock`` (``flock``, exclusive, not waiting) for one refresh run.

    One refresh at a time per publish root (a manual ``--now`` while the scheduled run builds fails at
    once instead of racing it), and a refresh holding it knows that every staged artifact of a dead
    process is garbage (:func:`clean_leftovers`). The kernel releases the lock when the process dies,
    SIGKILL included, so a killed run never blocks the next one. :func:`rollback` takes it too (without
    waiting: a rollback while a refresh runs fails at once, naming the refresh's pid), so a publish can
    neither prune the version a rollback is switching to nor clear the pin a rollback has just written.
    :class:`RefreshBusy` when the lock is held (naming the pid written in it); ArtifactError when the root cannot be
    opened.
    """
    root = Path(root)
    path = root / LOCK
    # O_NOFOLLOW, and the pid written only into a regular file of its own: a symlink planted there (a publish root on
    # a shared volume) had the refresh truncate its target, any file the refresh's user may write, to the pid
    flags = os.O_NOFOLLOW | os.O_NONBLOCK  # (NONBLOCK: a FIFO there does not hang the open)
    try:
        root.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise
            fd = os.open(path, os.O_RDONLY | flags)  # a read-only root: the lock still works, publishing fails later
    except OSError as exc:
        raise ArtifactError(f"cannot open the publish root's lock {path}: {_why_not_opened(exc)}") from None
    try:
        st = os.fstat(fd)
        own = stat.S_ISREG(st.st_mode) and st.st_nlink == 1  # not a hard link to another file either
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = (os.pread(fd, 64, 0).decode("ascii", "replace").strip() if own else "") or "unknown"
            raise RefreshBusy(f"another refresh (pid {holder}) is running on {root}: it holds {path}; this run "
                              "does nothing (the live artifact is untouched)", holder) from None
        except OSError as exc:  # a lock that cannot be taken (not a file flock works on)
            raise ArtifactError(f"cannot lock the publish root's lock {path}: {describe_os_error(exc)}") from None
        if own:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        _close(fd, path, [])  # releases the flock


def _close(fd: int, path: Path, said: list[str]) -> None:
    """Close a lock file's descriptor (releasing its flock). An error of the close (EIO of an NFS root) is a warning
    (:func:`_warn`), never raised: Linux has released the descriptor, and its flock, whatever close reports, and a
    publish or a run closing it after ``CURRENT`` named its version has happened (before, the EIO escaped publish()
    and the run reported a failed publish, deleting the embedding-store rows of the version it had made live)."""
    try:
        os.close(fd)
    except OSError as exc:
        _warn(said, "closing %s failed (%s); the descriptor and its lock are released all the same", path,
              describe_os_error(exc))


def _warn(said: list[str], message: str, *args: object) -> None:
    """A problem after a publish's switch (or a lock's close): logged, and added to ``said`` (:func:`publish`'s
    ``warnings``: the run reports them, published with warnings)."""
    text = message % args
    log.warning("%s", text)
    said.append(text)


def _why_not_opened(exc: OSError) -> str:
    """Why a lock file of the publish root (:data:`LOCK`, :data:`PUBLISHING`) could not be opened (``O_NOFOLLOW``)."""
    if exc.errno == errno.ELOOP:
        return "it is a symbolic link, which no refresh makes: remove it"
    return describe_os_error(exc)


@contextlib.contextmanager
def _publishing(root: Path, version: str, said: list[str]) -> Iterator[None]:
    """Hold :data:`PUBLISHING` (``flock``, exclusive) while :func:`publish` moves ``version`` into place and makes it
    current, with ``version`` written in it. It waits: publishes are serialised by :func:`refresh_lock`, so what can
    hold it meanwhile is a status's shared probe (:func:`unfinished`), for as long as reading a few small files takes;
    for at most :data:`PUBLISHING_WAIT_S`, after which it publishes without it (a status probe stopped half-way).
    ArtifactError, with nothing changed, when it cannot be opened, locked or written (the publish root is read-only or
    full, or a symlink or another file was put there). Its close is :func:`_close`: a failure there comes after
    ``CURRENT`` named the version, and is a warning in ``said``."""
    path = Path(root) / PUBLISHING
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        raise ArtifactError(f"cannot open {path}: {_why_not_opened(exc)}; nothing was published, CURRENT is "
                            "unchanged") from None
    named = False  # the file is ours to write (checked below) and holds this version's name
    try:
        st = os.fstat(fd)
        if not (stat.S_ISREG(st.st_mode) and st.st_nlink == 1):
            raise ArtifactError(f"{path} is not a regular file of its own (a hard link or another kind of file), "
                                "which no refresh makes: remove it; nothing was published, CURRENT is unchanged")
        try:
            deadline = time.monotonic() + PUBLISHING_WAIT_S
            while True:  # bounded: a status stopped while it probes (Ctrl-Z, SIGSTOP) must not stop the publish
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        log.warning("%s is still held by a status probe after %g s: publishing %s without it (a "
                                    "`refresh --status` meanwhile shows it as never_current)", path,
                                    PUBLISHING_WAIT_S, version)
                        break
                    time.sleep(0.01)
            os.ftruncate(fd, 0)
            named = True
            os.pwrite(fd, version.encode(), 0)
        except OSError as exc:
            raise ArtifactError(f"cannot hold {path} for the publish of {version}: {describe_os_error(exc)}; nothing "
                                "was published, CURRENT is unchanged") from None
        yield
    finally:
        if named:  # never a file this refused to touch (a hard link to another file: it would be emptied)
            with contextlib.suppress(OSError):  # no name is left behind for a status to read in the next publish's
                os.ftruncate(fd, 0)             # moment between its lock and its write (unfinished)
        _close(fd, path, said)  # releases the flock


def unfinished(root: Path, _again: bool = True) -> tuple[list[str] | None, str | None]:
    """What ``versions/`` holds besides the versions that were current: ``(never_current, publishing)``.

    ``never_current``: the versions (other than the current one) :data:`HISTORY` shows never were (a publish killed
    between its move and ``CURRENT``, or one that took its version back out half-way; :func:`never_current`, None for
    a root without the history). ``publishing``: the version a publish running now has moved into place and not yet
    made current (None: none), left out of ``never_current``. Before, that version was listed as never current.

    No race: while the shared probe of :data:`PUBLISHING` is held, no publish is between its move and its record in
    the history, so every version not in it really never was current; when a publish holds it, its name is read after
    ``versions/`` and the history were (so it names the publish that moved what was seen). A publish whose process died
    holds nothing (the kernel released its lock): its version is never_current. The probe does not wait and never
    makes a refresh fail or skip (a publish waits for it, as long as reading three small files takes).
    ArtifactError when the history cannot be read."""
    path = Path(root) / PUBLISHING
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        seen = _snapshot(root)
        if _again and path.exists():  # a publish began meanwhile (it creates the file before it moves): look again
            return unfinished(root, _again=False)
        return seen[2], None
    except OSError as exc:
        log.warning("cannot probe %s (%s): a version a publish running now has moved into place is shown as never "
                    "current", path, describe_os_error(exc))
        return _snapshot(root)[2], None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # a publish is between its move and its record
            versions, current, never = _snapshot(root)
            name = os.pread(fd, 256, 0).decode("ascii", "replace").strip()
            if name not in versions or name == current:
                return never, None  # not moved yet (or made current since)
            return ([v for v in never if v != name] if never is not None else None), name
        except OSError as exc:
            log.warning("cannot probe %s (%s): a version a publish running now has moved into place is shown as "
                        "never current", path, describe_os_error(exc))
        return _snapshot(root)[2], None
    finally:
        _close(fd, path, [])  # releases the shared probe (an EIO of the close failed the prune and the status)


def _snapshot(root: Path) -> tuple[list[str], str | None, list[str] | None]:
    """The versions, the one ``CURRENT`` names (None: nothing, or a malformed ``CURRENT``) and those never current."""
    versions = list_versions(root)
    try:
        current = current_version(root)
    except ArtifactError:
        current = None
    return versions, current, never_current(root, [v for v in versions if v != current])


# -- publish and roll back ---------------------------------------------------------------------
def _set_current(root: Path, version: str) -> None:
    write_atomic(Path(root) / CURRENT, (version + "\n").encode())


class History:
    """:data:`HISTORY`: ``versions``, what ``CURRENT`` has named (oldest first); ``began``, what it named when the
    history began (None: nothing was current then, so every version that ever was is in ``versions``);
    ``rolled_back_from``, the versions a rollback in it went back from (never a rollback target again)."""

    def __init__(self, versions: list[str], began: str | None, rolled_back_from: frozenset[str] = frozenset()) -> None:
        self.versions, self.began, self.rolled_back_from = versions, began, rolled_back_from


def read_history(root: Path) -> History | None:
    """The history of ``CURRENT`` (:data:`HISTORY`, JSON ``{"began": <version> | null, "versions": [{"version",
    "at", "how", "from"}, ...]}``; ``how`` is ``publish``, ``rollback`` or ``was current``, ``from`` what a rollback
    went back from); None for a root without the file (written only by refreshes before it was kept).
    A ``rollback`` record without ``from`` (written before it was) went back from the record before it.
    ArtifactError naming the file when it cannot be read or is malformed: a rollback then refuses rather than
    guess."""
    path = Path(root) / HISTORY
    try:
        raw = read_regular(path, MAX_STATE_FILE_BYTES, "the history of CURRENT")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ArtifactError(f"cannot read {path}: {describe_os_error(exc)}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        began, entries = data.get("began"), data.get("versions")
        if began is not None and not (isinstance(began, str) and is_version_name(began)):
            raise ValueError(f"began is {shown(began)}, not a version name or null")
        if not isinstance(entries, list) or not all(
                isinstance(e, dict) and isinstance(e.get("version"), str) and is_version_name(e["version"])
                and (e.get("from") is None or (isinstance(e["from"], str) and is_version_name(e["from"])))
                for e in entries):
            raise ValueError('versions is not a list of {"version": <name>, ...} records')
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ArtifactError(f"{path} does not hold the history of CURRENT ({exc}); remove it to roll back by the "
                            "version names alone (as before the history was kept)") from None
    rejected = {e.get("from") or (entries[i - 1]["version"] if i else None)
                for i, e in enumerate(entries) if e.get("how") == "rollback"}
    return History([e["version"] for e in entries], began, frozenset(v for v in rejected if v is not None))


def _record_current(root: Path, version: str, previous: str | None, how: str) -> str | None:
    """Add to :data:`HISTORY` that ``version`` is current now (called after ``CURRENT`` was written, never before:
    a crash in between leaves the version out, never in without having been current). ``previous``, what ``CURRENT``
    named before, is added first when the history does not end with it (a crash between an earlier ``CURRENT`` write
    and its record): it was current. A rollback's record names ``previous`` as ``from``. A new history (a root written
    before it was kept) begins at ``previous``. The last :data:`_HISTORY_MAX` records are kept. Best effort: a failure
    is logged (the publish or rollback has happened) and returned (None: recorded)."""
    path = Path(root) / HISTORY
    try:
        try:
            old = read_history(root)
        except ArtifactError as exc:
            log.warning("%s; it is begun again", exc)
            old = None
        history = old or History([], previous)
        entries: list[dict[str, object]] = []
        if old is not None:
            entries = json.loads(read_regular(path, MAX_STATE_FILE_BYTES, "the history of CURRENT"))["versions"]
        if previous is not None and history.versions[-1:] != [previous]:
            entries.append({"version": previous, "at": None, "how": "was current"})
        entries.append({"version": version, "at": time.time(), "how": how}
                       | ({"from": previous} if how == "rollback" else {}))
        write_atomic(path, json.dumps({"began": history.began, "versions": entries[-_HISTORY_MAX:]}).encode())
    except Exception as exc:  # noqa: BLE001 - CURRENT names it already: nothing here may undo that
        said: list[str] = []
        _warn(said, "%s is current; recording that in %s failed (%s): the next publish records it as the previous "
              "version", version, path, _describe(exc))
        return said[0]
    return None


def _clear_pin(root: Path) -> None:
    path = Path(root) / PIN
    if path.exists():
        path.unlink(missing_ok=True)
        fsync_dir(Path(root))


def _prune(root: Path, keep: int, served: Mapping[str, Sequence[str]] | None = None,
           kept: list[str] | None = None) -> list[str]:
    """Remove all but the last ``keep`` versions (never the one ``CURRENT`` names, never one a rollback pin
    names, never one a live scoring process serves: ``served``, version -> its ``host:pid``s, each kept said in ``kept``
    and logged; a version that never was current is not counted, and removed once not among the last ``keep`` of all).
    Each is first renamed to a hidden ``versions/.trash-*`` name (atomic), then deleted: a prune killed
    half-way leaves a hidden directory that :func:`clean_leftovers` removes, never a half-deleted version that
    :func:`rollback` could pick. ``CURRENT`` is read again here, not taken from the caller, so the version it
    names at the time of pruning is the one kept."""
    protected = {current_version(root)}
    pin = read_pin(root)
    if pin is not None and pin.version is not None:
        protected.add(pin.version)
    removed = []
    # Only complete versions (a manifest) count toward ``keep``: a half-written or foreign directory with a later
    # name must not push good versions, the ones a rollback falls back to, out. Such a directory is not deleted
    # here (it may be another writer's): it is logged.
    complete = []
    for name in list_versions(root):
        if (versions_dir(root) / name / MANIFEST).is_file():
            complete.append(name)
        else:
            log.warning("version directory %s has no %s (half-written, or not a refresh's): not counted toward "
                        "keep_versions, left as it is", versions_dir(root) / name, MANIFEST)
    # A version that never was current (a killed publish's, :func:`unfinished`) or was rolled back from is no rollback
    # target, so it does not count toward ``keep``: it pushed the only version a rollback could go to out. It is pruned
    # as before, once it is not among the last ``keep`` of all (``--status`` names it until then). One a publish running
    # now moved in is neither counted nor pruned.
    try:
        never, running = unfinished(root)
        history = read_history(root)
    except ArtifactError as exc:
        log.warning("%s; every complete version counts toward keep_versions", exc)
        never, running, history = None, None, None
    orphans = set(never or ()) | (history.rolled_back_from if history is not None else set())
    targets = [v for v in complete if v not in orphans and v != running]
    for name in sorted(set(targets[:-keep]) | {v for v in complete[:-keep] if v in orphans}):
        if name in (served or {}) and name not in protected:
            said = f"kept {name}: served by {', '.join((served or {})[name])}"
            log.info("%s (a scoring process still serves it: its publishes since were rejected, or it has not "
                     "swapped yet)", said)
            if kept is not None:
                kept.append(said)
        elif name not in protected:
            trash = versions_dir(root) / f"{TRASH}{name}-{os.getpid()}"
            try:
                os.rename(versions_dir(root) / name, trash)
            except OSError as exc:
                log.warning("could not prune version %s (%s); it stays", name, exc)
                continue
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(name)
    return removed


def publish(root: Path, staged_dir: Path, keep: int, over_pin: bool = True,
            signing_key: SigningKey | None = None, warnings: list[str] | None = None,
            served: Mapping[str, Sequence[str]] | None = None, kept: list[str] | None = None) -> Path:
    """Verify a staged artifact, move it into ``versions/`` and make it current (clearing a rollback pin);
    keep the last ``keep`` versions, and those in ``served`` (what live scoring processes serve; each kept for it
    said in ``kept``).

    ArtifactError, with nothing changed, when the staged files do not verify, or when ``CURRENT`` cannot be
    written (a full or read-only file system: the version moved into ``versions/`` is removed again, so
    nothing half-published stays). With ``over_pin=False`` (the scheduled refresh) a rollback pin holding
    the live version is respected: :class:`PinHeld`, nothing changed. After ``CURRENT`` names the new
    version the publish has happened; clearing the pin and pruning are then best effort (logged): a pin
    left behind names an older version and is stale, a version left behind is pruned next time. With
    ``signing_key`` the staged manifest must carry its signature (what serving with the key will check). The move
    and the ``CURRENT`` write hold :data:`PUBLISHING` (:func:`_publishing`; ArtifactError, nothing changed, when it
    cannot be held). Every step after the switch (the durability of ``CURRENT``, the history, the close of
    :data:`PUBLISHING`, the pin, the prune) is contained: its error is logged and added to ``warnings`` (the run
    reports the publish with them), never raised, and never takes the live version back out.
    """
    if keep < 1:  # [refresh] keep_versions >= 1; complete[:-0] would prune nothing
        raise ValueError(f"publish keep must be >= 1, got {keep}")
    root, staged_dir = Path(root), Path(staged_dir)
    manifest = verify(staged_dir, signing_key=signing_key)
    version = manifest["version"]
    if not over_pin:
        pin = pin_holding(root)
        if pin is not None:
            raise PinHeld(f"{root / PIN} pins {pin.version or 'the live version'}"
                          + (f" (rolled back from {pin.rolled_back_from})" if pin.rolled_back_from else "")
                          + (f" [{pin.problem}]" if pin.problem else "")
                          + f": {version} was not published; an operator ends the pin with `streamrec refresh "
                          "--now`", pin)
    said: list[str] = [] if warnings is None else warnings
    with _publishing(root, version, said):
        _move_and_switch(root, staged_dir, version, said)
    _after_switch(root, version, keep, said, served, kept)
    return versions_dir(root) / version


def _move_and_switch(root: Path, staged_dir: Path, version: str, said: list[str]) -> None:
    """:func:`publish`'s move into ``versions/``, ``CURRENT`` write and history record (holding :data:`PUBLISHING`).

    Whether ``CURRENT`` was switched is told by the error of its write (``write_atomic``: :class:`NotDurable` once the
    new file is in place), not by reading ``CURRENT`` again: on a root failing with EIO that read failed too, and the
    version ``CURRENT`` named already was taken back out (a dangling ``CURRENT``: no model for serving, and the run
    deleted its embedding-store rows). Any other OSError is told by :func:`_switched`: a rename that happened and
    reported an error (NFS) is a publish, and one not known leaves the version in place (ArtifactError)."""
    versions = versions_dir(root)
    target = versions / version
    try:
        previous = current_version(root)
    except ArtifactError:
        previous = None
    try:
        versions.mkdir(parents=True, exist_ok=True)
        if target.exists():
            raise ArtifactError(f"version {version} already exists in {versions}; refusing to overwrite it")
        os.rename(staged_dir, target)  # atomic: same file system (staging lives inside root)
    except OSError as exc:
        raise ArtifactError(f"could not move {staged_dir.name} into {versions}: {describe_os_error(exc)}; nothing "
                            f"was published, CURRENT still names {previous or 'nothing'}") from exc
    try:
        fsync_dir(versions)
        fsync_dir(staged_dir.parent)
        _set_current(root, version)
    except NotDurable as exc:  # CURRENT names the version: published
        _warn(said, "%s is current, but making that durable failed (%s)", version, describe_os_error(exc))
    except OSError as exc:
        switched = _switched(root, version)
        if switched is None:  # not known: the version stays (taken out, a CURRENT naming it would dangle)
            raise ArtifactError(f"could not make {version} current in {root}: {describe_os_error(exc)}, and CURRENT "
                                f"cannot be read again: whether {version} is live is not known (it stays in "
                                f"{versions}); check `streamrec refresh --status` when the file system is back"
                                ) from exc
        if not switched:  # CURRENT is as it was: take the new version back out
            _take_out(target, staged_dir)
            raise ArtifactError(f"could not make {version} current in {root}: {describe_os_error(exc)}; nothing "
                                f"was published, CURRENT still names {previous or 'nothing'}") from exc
        _warn(said, "%s is current, but its write reported an error (%s)", version, describe_os_error(exc))
    problem = _record_current(root, version, previous, "publish")
    if problem is not None:
        said.append(problem)


def _take_out(target: Path, staged_dir: Path) -> None:
    """Take a version that never was current back out of ``versions/``: renamed back to ``staged_dir`` (the caller
    removes it), else to a hidden ``versions/.trash-*`` name first, then deleted: a removal failing half-way (EIO)
    leaves what :func:`clean_leftovers` removes, never a ``versions/<version>`` without its manifest, which no prune
    ever removes."""
    try:
        os.rename(target, staged_dir)
        return
    except OSError:
        pass
    trash = target.with_name(f"{TRASH}{target.name}-{os.getpid()}")
    try:
        os.rename(target, trash)
    except OSError:
        trash = target
    shutil.rmtree(trash, ignore_errors=True)


def _switched(root: Path, version: str) -> bool | None:
    """After a write of ``CURRENT`` that raised an OSError other than :class:`NotDurable`: whether ``CURRENT`` names
    ``version`` (a rename an NFS server did although its reply was an error), None when it cannot be read (not known:
    a caller then neither takes ``version`` out nor counts it as live)."""
    try:
        return current_version(root) == version
    except ArtifactError as exc:
        log.warning("%s", exc)
        return None


def _after_switch(root: Path, version: str, keep: int, said: list[str],
                  served: Mapping[str, Sequence[str]] | None = None, kept: list[str] | None = None) -> None:
    """:func:`publish` after ``CURRENT`` names ``version``: clear the pin, prune. The publish has happened: an error
    here, any (an OSError, an ArtifactError of a ``CURRENT`` or history that cannot be read again), is logged, never
    raised. Before, only an OSError was contained: another escaped publish(), and ``job.run_once`` reported a failed
    publish (and deleted the embedding-store rows of the version now live). Each error is added to ``said``."""
    try:
        _clear_pin(root)  # after CURRENT: a pin naming an older version is stale from here on
    except Exception as exc:  # noqa: BLE001 - published already
        _warn(said, "%s is current; removing the stale rollback pin failed (%s): it names an older version and "
              "is ignored", version, _describe(exc))
    try:
        _prune(root, keep, served, kept)
    except Exception as exc:  # noqa: BLE001 - published already
        _warn(said, "%s is current; pruning old versions failed (%s): they are pruned next time", version,
              _describe(exc))


def _describe(exc: Exception) -> str:
    return describe_os_error(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"


def rollback(root: Path, signing_key: SigningKey | None = None) -> str:
    """Make the version before the current one current again and pin it; returns its name.

    "Before" is the version live just before the current one by :data:`HISTORY` (:func:`_rollback_targets`), never
    one a rollback went back from (the operator rejected it) nor one that never was current (both skipped, logged);
    none left is an ArtifactError saying so; an unreadable :data:`HISTORY` is one naming it.

    Holds :func:`refresh_lock` throughout (not waiting: while a refresh runs on ``root`` this is an
    ArtifactError naming its pid, and nothing changes), so no publish can prune the target or clear the
    pin between the choice of the target and the write of ``CURRENT``. The older version is verified first
    (size and sha256 of every file, and with ``signing_key`` its manifest's signature: serving with the key
    would refuse an unsigned one): a damaged one is an ArtifactError and ``CURRENT`` stays as it was. The pin
    (``PINNED``) stops serving from applying learner deltas to the rolled-back version, and scheduled
    refreshes from publishing over it, until an operator publishes (``streamrec refresh --now``; see the
    module docstring). Every failure, a read-only or full file system included, is an ArtifactError saying
    what ``CURRENT`` names; a pin written before ``CURRENT`` could not be is taken back."""
    root = Path(root)
    if not versions_dir(root).is_dir():
        raise ArtifactError(f"nothing to roll back to: {versions_dir(root)} does not exist")
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(refresh_lock(root))
        except ArtifactError as exc:
            raise ArtifactError(f"cannot roll back now: {exc}; roll back again when it has finished") from None
        try:
            return _rollback_locked(root, signing_key)
        except OSError as exc:  # reading the publish root (the writes say more, below): nothing was changed
            raise ArtifactError(f"cannot roll back in {root}: {describe_os_error(exc)}; CURRENT is unchanged") from None


def _rollback_locked(root: Path, signing_key: SigningKey | None) -> str:
    versions = [v for v in list_versions(root) if is_version_name(v)]
    current = current_version(root)
    if not versions:
        raise ArtifactError(f"nothing to roll back to: no version is published in {versions_dir(root)}")
    older, never, rejected = _rollback_targets(root, versions, current)
    if not older:
        why = ([f"{', '.join(never)} never was, by {root / HISTORY}: moved into versions/ by a publish that did not "
                "make it current"] if never else []) + [f"{', '.join(rejected)} was rolled back from"] * bool(rejected)
        raise ArtifactError(f"cannot roll back: no version older than {current} in {versions_dir(root)} was ever "
                            f"current ({'; '.join(why) or f'published: {versions}'}); CURRENT still names {current}")
    # The newest older version that verifies; a half-written or damaged one (a foreign copy, a killed manual
    # restore, a version not signed with the key) is skipped with its reason, not a dead end for the rollback.
    skipped: list[str] = []
    for target in older:
        try:
            verify(versions_dir(root) / target, signing_key=signing_key)
            break
        except ArtifactError as exc:
            skipped.append(f"{target}: {exc}")
            log.warning("rollback: skipping %s, which does not verify (%s)", target, exc)
    else:
        raise ArtifactError(f"cannot roll back: no version older than {current} verifies ({'; '.join(skipped)}); "
                            f"CURRENT still names {current}")
    now = time.time()
    try:
        write_atomic(root / PIN, json.dumps({"version": target, "rolled_back_from": current, "at": now,
                                              "at_utc": dt.datetime.fromtimestamp(now, tz=dt.timezone.utc)
                                              .isoformat(timespec="seconds")}).encode())
    except OSError as exc:
        raise ArtifactError(f"cannot roll back to {target}: writing {root / PIN} failed: {describe_os_error(exc)}; "
                            f"CURRENT still names {current}") from None
    try:
        _set_current(root, target)
    except NotDurable as exc:  # CURRENT names the target (told by the write, not by a read that may fail as well)
        log.warning("%s is current, but making that durable failed (%s)", target, describe_os_error(exc))
    except OSError as exc:
        switched = _switched(root, target)
        if switched is None:  # not known: the pin stays (one naming a version not live holds nothing)
            raise ArtifactError(f"cannot roll back to {target}: writing {root / CURRENT} failed: "
                                f"{describe_os_error(exc)}, and CURRENT cannot be read again: whether {target} is "
                                "live is not known; check `streamrec refresh --status` when the file system is back"
                                ) from None
        if not switched:  # CURRENT unchanged: the pin just written names a version not live
            with contextlib.suppress(OSError):
                _clear_pin(root)
            raise ArtifactError(f"cannot roll back to {target}: writing {root / CURRENT} failed: "
                                f"{describe_os_error(exc)}; CURRENT still names {current}") from None
        log.warning("%s is current, but its write reported an error (%s)", target, describe_os_error(exc))
    _record_current(root, target, current, "rollback")
    return target


def _rollback_targets(root: Path, versions: list[str],
                      current: str | None) -> tuple[list[str], list[str], list[str]]:
    """The versions of ``versions`` a rollback from ``current`` may go to, the first choice first; those skipped as
    never current; those skipped as rolled back from.

    By :data:`HISTORY`: the versions ``CURRENT`` named before, the one live just before ``current`` first, then the
    versions up to the one current when the history began (they predate it), newest name first. A version a rollback
    went back from (``rolled_back_from``, bounded with the history) is never a target: the operator rejected it. One
    the history does not name was moved into ``versions/`` by a publish that never made it current (killed between the
    rename and the ``CURRENT`` write, or a version taken back out half-way): never a target either. A root without the
    file (written before it was kept) goes by name alone (logged): the versions older than ``current``, newest
    first."""
    others = [v for v in versions if v != current]
    history = read_history(root)
    if history is None:
        log.warning("rollback: %s has no %s (written before the history of CURRENT was kept): the version to roll "
                    "back to is chosen by name alone", root, HISTORY)
        return [v for v in reversed(others) if current is None or v < current], [], []
    never = never_current(root, others) or []
    for v in never:
        log.warning("rollback: skipping %s, which was never current (not in %s)", v, root / HISTORY)
    rejected = [v for v in others if v in history.rolled_back_from]
    began = history.began
    live = list(dict.fromkeys(reversed(history.versions))) + [v for v in reversed(others) if began and v <= began]
    present = set(others) - set(never) - history.rolled_back_from
    return list(dict.fromkeys(v for v in live if v in present)), never, rejected


def never_current(root: Path, versions: list[str]) -> list[str] | None:
    """Those of ``versions`` that :data:`HISTORY` shows never were current (:func:`_rollback_targets`); None for a root
    without the history (nothing known). Versions up to the one current when the history began predate it: not
    named. ArtifactError when the history cannot be read."""
    history = read_history(root)
    if history is None:
        return None
    known, began = set(history.versions), history.began
    return [v for v in versions if v not in known and not (began is not None and v <= began)]
