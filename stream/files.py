"""Durable local files: the one home of fsync and atomic replacement.

Every stage that leaves state on disk (checkpoints and deltas in ``learner/``, artifacts and the
publish root in ``cache_refresh/``, poison strikes in ``stream/strikes.py``) writes through these
helpers, so "a crash leaves the old file or the new one, never half of one" is implemented once:

* :func:`write_synced` writes a file and fsyncs it (its name becomes durable with the directory);
* :func:`fsync_dir` makes a directory's entries (a rename, a new file, a removal) durable;
* :func:`write_atomic` replaces a file: temp file beside it, fsync, ``os.replace``, fsync of the
  directory. The temp file is named ``.<name>.tmp-<pid>-<thread>`` (:func:`temp_of` reads it back), so a cleanup
  can tell whether its writer is still alive (:func:`leftover_writer_alive`; ``cache_refresh.publish.clean_leftovers``,
  ``learner.checkpoint_write.remove_torn``).

And the one way a file another process left (a delta, ``CURRENT``, a manifest) is opened where a reading thread must
never hang: :func:`open_regular` (a FIFO put in its place blocked the reader for good, ``/dev/zero`` never ended),
and :func:`read_regular` on it, the one way a settings or secret file a path names is read (bounded in size).
What such a file holds as JSON is strict JSON: :func:`finite_json` (a manifest, ``last_run.json``, a summary).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import math
import os
import re
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

TMP_MARK = ".tmp-"  # in the name of every temp file write_atomic leaves when its process is killed
_TMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-\d+$")
_HASH_CHUNK = 8 << 20


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a rename, a new file, a removal) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write(fh)`` into ``path`` (created or truncated), then flush and fsync the file. A symlink at ``path`` is
    an OSError (ELOOP), never written through: the paths written are a writer's own (staged files, temp files) in
    directories others may share (a publish root), where one planted had the write truncate its target."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666), "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())


def finite_json(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, inf, -inf) as None, so ``json.dumps(allow_nan=False)`` takes it: the
    ``NaN`` and ``Infinity`` json.dumps writes by default are no JSON, and jq and other strict readers refuse the
    whole file (an AUC undefined on one class, a learner metric that overflowed). Dicts, lists and tuples (as lists)
    are walked; every other value is kept as it is."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def write_atomic(path: Path, data: bytes | Callable[[BinaryIO], object]) -> None:
    """Replace ``path`` with ``data`` (bytes, or a function writing to the open file) atomically and durably.

    On failure ``path`` is as it was and the temp file is removed (a process killed in between leaves
    it, named with its pid, for a cleanup); except :class:`NotDurable`: the new file is in place, only the
    directory's fsync after the rename failed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{threading.get_ident()}")
    write = (lambda fh: fh.write(data)) if isinstance(data, (bytes, bytearray, memoryview)) else data
    # What is at the temp name is a killed earlier process's (a container's pid 1 on every run) or planted: removed
    # first. A symlink there was written through (its target truncated, any file this process may write) and then
    # renamed over ``path`` itself (a publish root's CURRENT a symlink); write_synced refuses one planted meanwhile.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    try:
        write_synced(tmp, write)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    try:
        fsync_dir(path.parent)
    except OSError as exc:
        raise NotDurable(exc.errno, f"{path} is in place, but the fsync of its directory failed ({exc.strerror}): "
                                    "whether the rename survives a power loss is unknown") from exc


class NotDurable(OSError):
    """:func:`write_atomic` renamed the new file into place, but the directory's fsync after it failed: readers (and
    a restart) see the new file now; a power loss may still undo the rename. An OSError, so a caller that treats any
    failed write alike goes on doing so; one for which "in place" matters (a checkpoint, read at restart) tells it
    apart from a write that left the old file."""


def process_exists(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (True when that cannot be told: a process of another user, a pid
    out of range), so a caller that removes what a dead process left behind errs on leaving it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def process_identity(pid: int) -> tuple[str, int] | None:
    """``(executable name, start time in clock ticks since boot)`` of the live process ``pid`` (Linux /proc); None for
    no process, a zombie or one that cannot be read. The pair tells a process from a later one the system gave the same
    pid, which the name alone does not (a stale pid file's pid now another run of the same program). The executable,
    not the command line: redis-server rewrites its own. The start time is the fork's: an exec keeps it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        exe = Path(os.readlink(f"/proc/{pid}/exe")).name.removesuffix(" (deleted)")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": the state (field 3) ... starttime (field 22)
    return None if fields[0] == "Z" else (exe, int(fields[19]))


def process_matches(pid: int, exe_name: str, started: int | None = None) -> bool:
    """Whether ``pid`` is a live run of the executable ``exe_name`` that started at ``started`` (clock ticks, as
    :func:`process_identity` gives; None: any start, for a record written without it)."""
    ident = process_identity(pid)
    return ident is not None and ident[0] == exe_name and started in (None, ident[1])


def listens_on(pid: int, port: int, proc: Path = Path("/proc")) -> bool:
    """Whether the process ``pid`` holds a listening TCP socket on ``port`` (Linux /proc; True when that cannot be
    told: no /proc, no /proc/net/tcp, another user's process): a server just started on a port found free answers a
    probe only once it listens, while another process that took the port first answers at once (and this one then
    exits). ``proc``: where /proc is (a test's own layout)."""
    try:
        fds = os.listdir(proc / str(pid) / "fd")
    except PermissionError:
        return True
    except FileNotFoundError:  # the process is gone, unless there is no /proc to ask (the stack never started there)
        return not (proc / "self" / "fd").is_dir()
    listening, tables = set(), 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            rows = (proc / "net" / table).read_text().splitlines()[1:]
            tables += 1
            listening |= {f"socket:[{f[9]}]" for f in map(str.split, rows)
                          if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port}  # 0A: LISTEN
    if not tables:
        return True
    for fd in fds:
        with contextlib.suppress(OSError):  # closed since listed
            if os.readlink(proc / str(pid) / "fd" / fd) in listening:
                return True
    return False


def leftover_writer_alive(pid: int) -> bool:
    """Whether the writer ``pid`` named in a leftover (a temp file of :func:`write_atomic`, a staged artifact) may
    still be writing it, for a cleanup that has nothing of its own in flight (the learner's sequential saves, a
    refresh holding its root's lock): its own pid is then an earlier process's (pid 1 in a container, every run), so
    not alive; any other pid is alive while :func:`process_exists` says so."""
    return pid != os.getpid() and process_exists(pid)


def temp_of(path: Path) -> tuple[str, int] | None:
    """``(name of the file it was replacing, pid of its writer)`` of a temp file :func:`write_atomic` names
    (``.<name>.tmp-<pid>-<thread>``), None for any other file."""
    m = _TMP_NAME.match(Path(path).name)
    return (m["name"], int(m["pid"])) if m else None


def open_entry(dir_fd: int, name: str) -> int:
    """Entry ``name`` of the directory open as ``dir_fd``, opened for reading (a descriptor): never through a symlink
    (``OSError`` ``ELOOP`` when the entry is one), without blocking (a FIFO cannot hang it: check ``fstat`` for a
    regular file before reading), close-on-exec (a process the reader spawns does not inherit it). Relative to the
    directory's descriptor, what is opened is an entry of that directory whatever is renamed meanwhile: the one open a
    file checked and then read must go through (a check by path and an open that follows symlinks can read a file
    swapped in between)."""
    return os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


class OutsideDirectory(OSError):
    """:func:`resolved_entry`: the path resolves elsewhere than an entry of its directory (``target``: where it
    resolves, ``home``: the directory resolved), or cannot be resolved (a symlink loop: ``target`` None)."""

    def __init__(self, message: str, target: Path | None, home: Path | None) -> None:
        super().__init__(message)
        self.target, self.home = target, home


def resolved_entry(path: Path, parent: Path) -> Path:
    """What ``path`` resolves to, every symlink followed, checked to be an entry directly inside ``parent`` (resolved
    too: a parent that is itself a symlink is fine); :class:`OutsideDirectory` otherwise. The one check of "a symlink
    or a path leaving the directory" that the artifact versions and the deltas both make before reading."""
    try:
        target, home = Path(path).resolve(), Path(parent).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop (pathlib raises either, by version)
        raise OutsideDirectory(str(exc), None, None) from None
    if target.parent != home:
        raise OutsideDirectory(f"{path} resolves to {target}, outside {home}", target, home)
    return target


class NotRegularFile(OSError):
    """:func:`open_regular` found something else than a regular file (a FIFO, a device, a directory, a socket)."""


@contextlib.contextmanager
def open_regular(path: Path) -> Iterator[tuple[io.FileIO, os.stat_result]]:
    """``path`` opened for reading (unbuffered) with its ``fstat``, refused unread unless it is a regular file.

    Opened without blocking (opening a FIFO otherwise waits for a writer), and the check made on the open file, so a
    file swapped for a FIFO or a device since a caller's own ``stat`` cannot hang the reader either. Raises
    :class:`NotRegularFile` (an OSError naming the path and its mode) for anything else, and what ``open`` raises
    (FileNotFoundError, PermissionError, ...). The reading itself stays the caller's (bounded by a size it knows)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:  # fstat before fdopen: FileIO refused a directory itself, naming only the fd ("Is a directory: 3"), leaked
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)}): refused unread")
        fh = os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise
    with fh:
        yield fh, st


def open_append_regular(path: Path) -> io.TextIOWrapper:
    """``path`` opened (created when missing) for appending UTF-8 text, refused unless it is a regular file: opened
    without blocking (opening a FIFO for writing otherwise waits for a reader for good; without one it is ENXIO) and
    checked on the open file, so a FIFO, a device or a directory is :class:`NotRegularFile` (an OSError naming it)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)}): refused")
        os.set_blocking(fd, True)
        return open(fd, "a", encoding="utf-8")  # noqa: SIM115 - the caller's to close
    except BaseException:
        os.close(fd)
        raise


# The most a settings or secret file (a --config file, a password, key or rules file) may hold: far more than any real
# one, and a bound on what a file named by mistake (a data set, a log) costs to read before it is refused.
MAX_SETTINGS_FILE_BYTES = 4 << 20
# The most a small state file a stage leaves for its next start may hold (a delta seq, a lineage id, ``last_run.json``,
# a pid file, the monitor's firing state): far more than any real one, a bound on a file put there by mistake.
MAX_STATE_FILE_BYTES = 16 << 20


class FileTooLarge(OSError):
    """:func:`read_regular` found more than its bound in the file."""


class ReadAt(io.RawIOBase):
    """A read-only view of the open file ``fd`` with a position of its own (``os.preadv``): readers of one open file
    that must not move each other. Two file objects of one descriptor (or a ``dup``) share its offset: a reader whose
    background read-ahead outlives it (pyarrow's streaming CSV reader with threads) moved the next reader's position,
    which then took a data row of the middle of the file for the header. The descriptor stays the caller's."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd, self._pos = fd, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = os.preadv(self._fd, [buffer], self._pos)
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: os.fstat(self._fd).st_size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


def read_regular(path: Path | str, limit: int, what: str = "a settings or secret file") -> bytes:
    """The whole of ``path``, a regular file of at most ``limit`` bytes (``what``: a settings or secret file, a state
    file a stage left for its next start). Opened with
    :func:`open_regular`, so a FIFO, a device (``/dev/zero``, a tty) or a directory is refused unread rather than
    hanging the process or reading without end (:class:`NotRegularFile`); a larger file is :class:`FileTooLarge`
    after ``limit + 1`` bytes. Both are OSErrors whose message says what the file is, as ``open``'s errors are."""
    return read_regular_stat(path, limit, what)[0]


def read_regular_stat(path: Path | str, limit: int, what: str = "a settings or secret file") -> tuple[bytes,
                                                                                                     os.stat_result]:
    """:func:`read_regular`, with the ``fstat`` of the file it read (a secret file's permissions: no second look by
    name, which may find another file)."""
    chunks: list[bytes] = []
    size = 0
    with open_regular(Path(path)) as (fh, st):
        while size <= limit:
            chunk = fh.read(limit + 1 - size)
            if not chunk:
                return b"".join(chunks), st
            chunks.append(chunk)
            size += len(chunk)
    raise FileTooLarge(f"{path} holds more than {limit} bytes: too large for {what} (is it the right file?)")


def read_tail(path: Path, limit: int, since: int = 0) -> str:
    """The last ``limit`` bytes of the regular file ``path`` after its first ``since`` (from the start of a line when
    cut), as text: a log or a summary that grows over every run is not read whole, and a log's earlier runs are
    left out. A FIFO or a device is refused unread (:func:`open_regular`, :class:`NotRegularFile`)."""
    with open_regular(path) as (fh, st):
        start = max(since, st.st_size - limit)
        fh.seek(start)
        data = b""
        while len(data) < limit and (chunk := fh.read(limit - len(data))):
            data += chunk
    if start > since:
        data = data[data.find(b"\n") + 1:] if b"\n" in data else b""
    return data.decode("utf-8", errors="replace")


def sha256_file(source: Path | BinaryIO) -> str:
    """The hex sha256 of a file, read in chunks (artifacts hold tables of gigabytes): a path (a FIFO or a device is
    :class:`NotRegularFile`, refused unread: :func:`open_regular`), or a file already open, hashed from its start and
    left at its start (a reader that loads the very bytes it hashed: ``learner.artifact.open_artifact``)."""
    h = hashlib.sha256()
    if isinstance(source, (str, os.PathLike)):
        with open_regular(Path(source)) as (fh, _):
            while chunk := fh.read(_HASH_CHUNK):
                h.update(chunk)
        return h.hexdigest()
    source.seek(0)
    while chunk := source.read(_HASH_CHUNK):
        h.update(chunk)
    source.seek(0)
    return h.hexdigest()


def describe_os_error(exc: OSError) -> str:
    """An OSError in words an operator acts on (a full or read-only file system says so)."""
    what = {errno.ENOSPC: "the file system is full (no space left on device)",
            errno.EDQUOT: "the disk quota is exceeded",
            errno.EROFS: "the file system is read-only",
            errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted"}.get(exc.errno or -1)
    where = f" ({exc.filename})" if exc.filename else ""
    return f"{what}{where}: {exc.strerror or exc}" if what else f"{type(exc).__name__}: {exc}"
