"""The publish root's version directories: their names, ``CURRENT``, the rollback pin, and the one error of an artifact.

The readers of a publish root (``CURRENT``, the versions, the rollback pin) and the names and paths they accept; the
layout of a publish root is ``learner/artifact.py``'s docstring, the manifest ``learner/artifact_manifest.py``, an
artifact's build and files ``learner/artifact.py``. Writing a root (publish, rollback, pruning, the refresh lock,
cleanup) is ``cache_refresh/publish.py``.

Paths: names read from the root (``CURRENT``, ``PINNED``, the entries of ``versions/``) must be plain
version names (:func:`is_version_name`: letters, digits, ``. _ -``, no path separator, not starting with
a dot, so never ``..``); manifest file names likewise. A version directory must resolve (symlinks
followed) to a directory inside ``<root>/versions``, and every artifact file (the manifest included) to a
file inside its version directory: a symlink leaving them is an ArtifactError (:func:`version_path`,
:func:`read_current`, :func:`verify`), and :func:`list_versions` leaves such entries out; the files the manifest
lists are opened without following a symlink at all (:func:`open_artifact`).

Errors: :class:`ArtifactError` for every artifact that cannot be used (missing, truncated or altered
files; a manifest that is not UTF-8, not JSON, repeats a key, not an object, lacks a key or has a key of the
wrong type or value; a ``CURRENT`` that names no valid version; a scorer that does not load or score); the message
names the file, what was wrong and what to do. No other exception escapes :func:`decode_manifest`,
:func:`read_current`, :func:`read_pin` or ``serving.model.ScoringModel.load`` for a damaged artifact.

(:func:`verify` and :func:`open_artifact` are ``learner/artifact.py``'s, :func:`decode_manifest`
``learner/artifact_manifest.py``'s.)
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stream.errors import BadMessage, StreamrecError, shown
from stream.events import count_keys, reject_duplicate_keys
from stream.files import OutsideDirectory, open_regular, resolved_entry

__all__ = ["CURRENT", "PIN", "STAGING", "VERSIONS", "ArtifactError", "Pin", "current_version", "is_version_name",
           "list_versions", "new_version_name", "pin_holding", "read_current", "read_pin", "version_path",
           "versions_dir"]

CURRENT = "CURRENT"
PIN = "PINNED"
VERSIONS = "versions"
STAGING = ".staging"
log = logging.getLogger("streamrec.artifact")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # version and file names: no path separators
_MAX_POINTER = 4096


class ArtifactError(StreamrecError):
    """An artifact that cannot be used: missing, truncated or altered files, or an unreadable manifest."""


def is_version_name(name: str) -> bool:
    """Whether ``name`` is a plain version (or file) name: letters, digits, ``. _ -``; no path in it."""
    return NAME_RE.fullmatch(name) is not None


def num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_TIME_NAME_RE = re.compile(r"\d{8}T\d{9}Z")  # new_version_name's form


def _time_name(t: dt.datetime) -> str:
    return t.strftime("%Y%m%dT%H%M%S") + f"{t.microsecond // 1000:03d}Z"


def new_version_name(now: float | None = None, root: Path | None = None) -> str:
    """``YYYYMMDDTHHMMSSmmmZ``: UTC, sorts in time order.

    With ``root`` (a publish root), also after every name of that form in its ``versions/``: when the clock is at or
    behind the newest one (it went back: a clock set ahead and corrected, a restored VM), the name is 1 ms after that
    one. Name order is publish order, which pruning (the newest ``keep_versions`` names stay) and rollback (the newest
    name before ``CURRENT``) go by: after the clock went back, a new version sorted before the ones published while it
    was ahead, so pruning deleted the version just replaced (the rollback target) and kept the older ones for ever, and
    a rollback went to an older model than the one live before, or found none."""
    name = _time_name(dt.datetime.fromtimestamp(time.time() if now is None else now, tz=dt.timezone.utc))
    if root is None:
        return name
    d = versions_dir(root)
    try:
        names = [p.name for p in d.iterdir()] if d.is_dir() else []
    except OSError:
        names = []
    for newest in sorted((n for n in names if _TIME_NAME_RE.fullmatch(n)), reverse=True):
        if name > newest:
            return name
        try:
            later = _time_name(dt.datetime.strptime(newest[:-1], "%Y%m%dT%H%M%S%f") + dt.timedelta(milliseconds=1))
        except (ValueError, OverflowError):  # of the form, but no time (month 13, year 9999's last ms): not ours
            continue
        if later in names:  # newest + 1 ms is year 9999's last ms, there already: no name can follow it
            log.warning("%s holds %s, the last name of its form: no version name can follow it, so the new version "
                        "is named by the clock, %s; remove the versions named in year 9999 for names to keep the "
                        "order of publishing", d, later, name)
            return name
        break
    else:
        return name
    log.warning("the clock (%s) is not after the newest version in %s (%s): the new version is named %s, so that "
                "names keep the order of publishing (pruning and rollback go by it)", name, d, newest, later)
    return later


# -- reading a publish root -----------------------------------------------------------------------
def read_regular(path: Path, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of ``path`` (so a caller notices a longer file without reading it whole).

    ``CURRENT``, ``PINNED`` and manifests are read on serving's updater thread (and at its start): a FIFO put in
    their place blocked that thread for good (no swap, no delta, a service that never started) and a symlink to
    ``/dev/zero`` never ended. So they are opened with :func:`stream.files.open_regular`: anything but a regular file
    is its :class:`~stream.files.NotRegularFile`, an OSError as ``open`` raises (FileNotFoundError, ...), which the
    callers report as an unreadable file."""
    with open_regular(path) as (fh, _):
        chunks, n = [], 0
        while n <= limit and (chunk := fh.read(limit + 1 - n)):
            chunks.append(chunk)
            n += len(chunk)
        return b"".join(chunks)


def versions_dir(root: Path) -> Path:
    """``<root>/versions``."""
    return Path(root) / VERSIONS


def resolve_inside(path: Path, parent: Path, what: str) -> Path:
    """``path`` with every symlink resolved; ArtifactError unless that is an entry directly inside ``parent``
    (resolved too: a publish root that is itself a symlink is fine)."""
    try:
        return resolved_entry(path, parent)
    except OutsideDirectory as exc:
        if exc.target is None:  # a symlink loop
            raise ArtifactError(f"{path} cannot be resolved ({exc}): {what}; refused") from None
        raise ArtifactError(f"{exc} (a symlink or a path leaving it): {what}; refused. Publish with `streamrec "
                            "refresh --now`, which writes plain directories and files") from None


def check_version_dir(version_dir: Path) -> Path:
    """``version_dir`` as an absolute path; ArtifactError when it resolves outside the directory holding it."""
    version_dir = Path(os.path.abspath(version_dir))
    resolve_inside(version_dir, version_dir.parent, f"a version directory must lie in {version_dir.parent}")
    return version_dir


def list_versions(root: Path) -> list[str]:
    """Published versions, oldest first: the entries of ``versions/`` with a version name that are directories
    inside it (hidden entries, other names and symlinks resolving elsewhere are left out)."""
    d = versions_dir(root)
    if not d.is_dir():
        return []
    home = d.resolve()
    out = []
    for p in d.iterdir():
        if p.name.startswith(".") or not is_version_name(p.name):
            continue
        try:
            if p.is_dir() and p.resolve().parent == home:
                out.append(p.name)
        except (OSError, RuntimeError):  # a symlink loop, or gone meanwhile
            continue
    return sorted(out)


def version_path(root: Path, name: str) -> Path:
    """``<root>/versions/<name>``, checked: ArtifactError when ``name`` is not a version name or the entry
    resolves outside ``<root>/versions`` (a symlink). It need not exist."""
    if not (isinstance(name, str) and is_version_name(name)):
        raise ArtifactError(f"{shown(name)} is not a version name (letters, digits, . _ -): refused")
    path = versions_dir(root) / name
    resolve_inside(path, versions_dir(root), f"a version must be a directory in {versions_dir(root)}")
    return path


def current_version(root: Path) -> str | None:
    """The name in ``CURRENT``; None when nothing was published. ArtifactError when it names no valid version."""
    path = Path(root) / CURRENT
    try:
        raw = read_regular(path, _MAX_POINTER)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ArtifactError(f"{path} cannot be read ({exc}); check the publish root's permissions") from None
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = None
    if name == "":
        return None
    if name is None or len(raw) > _MAX_POINTER or not NAME_RE.fullmatch(name):
        raise ArtifactError(f"{path} holds {shown(raw[:60])}, not a version name: it was not written by "
                            "`streamrec refresh`; publish again with `streamrec refresh --now` or write a version "
                            f"from {versions_dir(root)} into it")
    return name


def read_current(root: Path) -> Path | None:
    """The current version's directory, or None when nothing was published (or it is gone).

    ArtifactError when ``CURRENT`` holds something that is not a version name, or names an entry that
    resolves outside ``<root>/versions`` (:func:`version_path`)."""
    name = current_version(root)
    if name is None:
        return None
    path = versions_dir(root) / name
    return version_path(root, name) if path.is_dir() else None


@dataclass(frozen=True)
class Pin:
    """``<root>/PINNED``: the version a rollback returned to; serving applies no deltas to it
    (``cache_refresh/publish.py`` explains the pin)."""

    version: str | None  # None: the pin file is unreadable; it then pins whatever is live (fail closed)
    rolled_back_from: str | None
    at: float | None
    problem: str | None = None

    def holds(self, version: str) -> bool:
        return self.version is None or self.version == version


def read_pin(root: Path) -> Pin | None:
    """The rollback pin, None when there is none. An unreadable pin is a Pin with ``problem`` set."""
    path = Path(root) / PIN
    try:
        raw = read_regular(path, _MAX_POINTER)
    except FileNotFoundError:
        return None
    except OSError as exc:  # (not a regular file too: unreadable, so it pins whatever is live: fail closed)
        return Pin(None, None, None, f"{path} cannot be read ({exc})")
    why = ""
    try:
        d = json.loads(raw.decode("utf-8"))
        reject_duplicate_keys(raw, count_keys(d))  # two versions in one pin: which one holds is not ours to guess
    except BadMessage as exc:
        d, why = None, f" ({exc})"
    except (UnicodeDecodeError, ValueError, RecursionError):
        d = None
    ok = (isinstance(d, dict) and isinstance(d.get("version"), str) and NAME_RE.fullmatch(d["version"])
          and (d.get("rolled_back_from") is None
               or (isinstance(d["rolled_back_from"], str) and NAME_RE.fullmatch(d["rolled_back_from"])))
          and (d.get("at") is None or num(d["at"])))
    if not ok or len(raw) > _MAX_POINTER:
        return Pin(None, None, None, f"{path} holds {shown(raw[:60])}, not a rollback pin{why}; deltas stay paused "
                   "and scheduled refreshes do not publish until an operator publishes (`streamrec refresh --now`)")
    return Pin(d["version"], d.get("rolled_back_from"), d.get("at"))


def pin_holding(root: Path) -> Pin | None:
    """The rollback pin that holds the live version now (or an unreadable pin, which holds whatever is
    live), else None (no pin, or a stale one naming another version than ``CURRENT``)."""
    pin = read_pin(root)
    if pin is None:
        return None
    if pin.problem is not None:
        return pin
    try:
        current = current_version(root)
    except ArtifactError:
        return pin  # CURRENT unreadable: fail closed, as serving does with an unreadable pin
    return pin if current is not None and pin.holds(current) else None
