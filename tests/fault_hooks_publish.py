"""Run ``streamrec refresh`` or ``streamrec serve`` with a fault injected, for tests/integration/test_faults_serving.py.

``python -m tests.fault_hooks_publish refresh --now ...`` is ``streamrec refresh --now ...`` except that:

* ``STREAMREC_TEST_KILL_AT=<point>``: the process SIGKILLs itself at that point (a real ``kill -9`` of
  the real command, at a moment a timer could hardly hit). Refresh points, in run order:
  ``build:cold_half`` (half of ``cold_rows.npy`` written into the staging directory), ``build:staged``
  (staged and complete, not validated), ``publish:before_rename``, ``publish:renamed`` (in ``versions/``,
  not current), ``publish:current_tmp`` (the new ``CURRENT`` written to its temp file, not renamed),
  ``publish:current`` (``CURRENT`` replaced, pin and prune not done), ``publish:pruning`` (a pruned
  version half deleted), ``last_run`` (before ``last_run.json`` is replaced). Serve points:
  ``swap:<version>`` (that version loaded beside the live one, not swapped in), ``delta:<seq>`` (that
  delta read, not applied).
* ``STREAMREC_TEST_PAUSE_AT=<point>`` (one of the points above): the process writes ``fault hook: paused at
  <point>`` to stderr there and waits for SIGTERM or SIGINT (the test sends it), then hands it to the process's
  handler (or the default action).
* ``STREAMREC_TEST_PUBLISH_FAULT=<file>``: while the file exists, the publish root (``--publish-root``)
  fails as its content says: ``ENOSPC:build`` (the disk fills while the cold rows are written: half
  written, then ENOSPC), ``ENOSPC:publish`` (the staged artifact fits, then no byte more: writing
  ``CURRENT`` fails), ``EROFS`` (mounted read-only: every create, write, rename and unlink under it
  fails).

Test code only; ``tests/fault_hooks.py`` is the same idea for the joiner and the learner.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from learner import artifact, artifact_manifest, artifact_versions, scorer
from serving.model import ScoringModel
from stream import files
from stream.files import write_synced

KILL_AT = os.environ.get("STREAMREC_TEST_KILL_AT", "")
PAUSE_AT = os.environ.get("STREAMREC_TEST_PAUSE_AT", "")
FAULT_FILE = os.environ.get("STREAMREC_TEST_PUBLISH_FAULT")
_state = {"current_replaced": False}


def _root() -> Path | None:
    argv = sys.argv[1:]
    for i, a in enumerate(argv):
        if a == "--publish-root" and i + 1 < len(argv):
            return Path(argv[i + 1]).resolve()
        if a.startswith("--publish-root="):
            return Path(a.split("=", 1)[1]).resolve()
    return None


ROOT = _root()


def _pause(point: str) -> None:
    """Wait at ``point`` until SIGTERM or SIGINT comes, then hand it to the process's own handler (which may raise
    out of here, or let the run go on) or, without one, to the default action."""
    got: list[int] = []
    sigs = (signal.SIGTERM, signal.SIGINT)
    own = {sig: signal.signal(sig, lambda signum, frame: got.append(signum)) for sig in sigs}
    sys.stderr.write(f"fault hook: paused at {point}\n")
    sys.stderr.flush()
    while not got:
        time.sleep(0.05)
    for sig, handler in own.items():
        signal.signal(sig, handler)
    handler = own[got[0]]
    if callable(handler):
        handler(got[0], None)
    else:
        os.kill(os.getpid(), got[0])


def _die(point: str) -> None:
    if PAUSE_AT == point:
        _pause(point)
    if KILL_AT == point:
        sys.stderr.write(f"fault hook: SIGKILL at {point}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _under_root(path: object) -> bool:
    if ROOT is None or isinstance(path, int):
        return False
    try:
        p = Path(os.fsdecode(path)).resolve()  # type: ignore[arg-type]
    except (TypeError, ValueError, OSError):
        return False
    return p == ROOT or ROOT in p.parents


def _fault() -> str | None:
    if FAULT_FILE and Path(FAULT_FILE).exists():
        return Path(FAULT_FILE).read_text().strip()
    return None


def _erofs(path: object) -> None:
    if _fault() == "EROFS" and _under_root(path):
        raise OSError(errno.EROFS, "Read-only file system (injected)", os.fsdecode(path))  # type: ignore[arg-type]


# -- writes of the artifact and publish modules ----------------------------------------------------------------
_write_synced = write_synced


def _hooked_write_synced(path, write):  # noqa: ANN001, ANN202 - a patch
    p = Path(path)
    fault = _fault()
    _erofs(p)
    half = (KILL_AT == "build:cold_half" and p.name == artifact_manifest.COLD_FILE) or (
        fault == "ENOSPC:build" and p.name == artifact_manifest.COLD_FILE and _under_root(p))
    if half:
        buf = io.BytesIO()
        write(buf)
        data = buf.getvalue()
        with open(p, "wb") as fh:
            fh.write(data[: len(data) // 2])
            fh.flush()
            os.fsync(fh.fileno())
        _die("build:cold_half")
        raise OSError(errno.ENOSPC, "No space left on device (injected)", str(p))
    if fault == "ENOSPC:publish" and _under_root(p) and p.parent.resolve() == ROOT:
        with open(p, "wb"):
            pass  # the inode fits, the data does not
        raise OSError(errno.ENOSPC, "No space left on device (injected)", str(p))
    return _write_synced(p, write)


# every module that writes artifact or publish-root files looks write_synced up in its own globals
for _module in (artifact, scorer, files):
    _module.write_synced = _hooked_write_synced  # type: ignore[attr-defined]

_build = artifact.build_artifact


def _hooked_build(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a patch
    staged = _build(*args, **kwargs)
    _die("build:staged")
    return staged


artifact.build_artifact = _hooked_build

# -- file system calls (os.* is what pathlib and shutil call too) ---------------------------------
_rename, _replace, _mkdir, _unlink, _open, _rmtree = os.rename, os.replace, os.mkdir, os.unlink, os.open, shutil.rmtree


def _hooked_rename(src, dst, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - a patch
    _erofs(src)
    _erofs(dst)
    staged = (artifact_versions.STAGING in Path(os.fsdecode(src)).parts
              and artifact_versions.VERSIONS in Path(os.fsdecode(dst)).parts)
    if staged:
        _die("publish:before_rename")
    out = _rename(src, dst, *args, **kwargs)
    if staged:
        _die("publish:renamed")
    return out


def _hooked_replace(src, dst, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - a patch
    _erofs(dst)
    name = Path(os.fsdecode(dst)).name
    if name == artifact_versions.CURRENT:
        _die("publish:current_tmp")
    elif name == "last_run.json":
        _die("last_run")
    out = _replace(src, dst, *args, **kwargs)
    if name == artifact_versions.CURRENT:
        _state["current_replaced"] = True
        _die("publish:current")
    return out


def _hooked_mkdir(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - a patch
    if not os.path.lexists(path):  # an existing directory is EEXIST on a read-only mount too
        _erofs(path)
    return _mkdir(path, *args, **kwargs)


def _hooked_unlink(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - a patch
    if kwargs.get("dir_fd") is None:
        _erofs(path)
    return _unlink(path, *args, **kwargs)


def _hooked_open(path, flags, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - a patch
    if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and kwargs.get("dir_fd") is None:
        _erofs(path)
    return _open(path, flags, *args, **kwargs)


def _hooked_rmtree(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - a patch
    p = Path(os.fsdecode(path))
    if KILL_AT == "publish:pruning" and _state["current_replaced"] and p.name.startswith(".trash-"):
        files = sorted(f for f in p.iterdir() if f.is_file())
        if files:
            files[0].unlink()  # half deleted
        _die("publish:pruning")
    return _rmtree(path, *args, **kwargs)


os.rename, os.replace, os.mkdir, os.unlink, os.open = (_hooked_rename, _hooked_replace, _hooked_mkdir,
                                                       _hooked_unlink, _hooked_open)
shutil.rmtree = _hooked_rmtree

# -- serving --------------------------------------------------------------------------------------
_load = ScoringModel.load.__func__  # type: ignore[attr-defined]
_apply_delta = ScoringModel.apply_delta


def _hooked_load(cls, version_dir, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - a patch
    model = _load(cls, version_dir, *args, **kwargs)
    _die(f"swap:{Path(version_dir).name}")  # loaded beside the live model, not swapped in
    return model


def _hooked_apply_delta(self, rows, vectors, dense_state, seq, **kwargs):  # noqa: ANN001, ANN003, ANN202 - a patch
    _die(f"delta:{seq}")  # (**kwargs: whatever apply_delta takes besides, passed on as it is)
    return _apply_delta(self, rows, vectors, dense_state, seq, **kwargs)


ScoringModel.load = classmethod(_hooked_load)  # type: ignore[method-assign, assignment]
ScoringModel.apply_delta = _hooked_apply_delta  # type: ignore[method-assign]

if __name__ == "__main__":
    from streamrec.cli import main

    sys.exit(main(sys.argv[1:]))
