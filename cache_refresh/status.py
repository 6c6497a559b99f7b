"""``streamrec refresh --status``: what a publish root holds and says about its refreshes (the live version and its
manifest, the rollback pin, the last run's record, versions that never were current, entries that are no version),
read without taking its lock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cache_refresh.publish import TRASH, unfinished
from cache_refresh.run_records import read_last_ran, read_last_run, read_last_success
from learner import artifact_manifest, artifact_versions
from stream.files import describe_os_error


def _current_name(root: Path) -> str | None:
    try:
        return artifact_versions.current_version(root)
    except artifact_versions.ArtifactError:
        return None


def status(root: Path) -> dict[str, Any]:
    """``streamrec refresh --status``: the live version and its manifest summary, the rollback pin, the last run it
    held back, the versions that never were current (``never_current``: a publish killed between moving a version
    into place and writing ``CURRENT``; a rollback skips them), the one a publish running now has moved into place
    and not yet made current (``publishing``; ``publish.unfinished``); ``error`` says why there is no live version where
    something is wrong (a missing publish root, a CURRENT naming a version that is gone, a broken artifact), None for
    a root where nothing is published yet, or one it may not read (the reason: a traceback, before);
    ``last_run_failed``: when the last scheduled run failed since the last publish, and why."""
    def failed(error: str) -> dict[str, Any]:
        return {"publish_root": str(root), "current": None, "versions": [], "last_success": None, "pinned": None,
                "last_pin_held": None, "error": error}

    try:  # (is_dir too: a root in a directory it may not search is a PermissionError, not False)
        if not root.is_dir():
            return failed(f"publish root {root} {'is not a directory' if root.exists() else 'does not exist'}: "
                          "check --publish-root / [refresh] publish_root (nothing was published there)")
        return _status(root)
    except OSError as exc:
        return failed(f"cannot read the publish root {root}: {describe_os_error(exc)}; run the status as a user who "
                      "may read it")


def _status(root: Path) -> dict[str, Any]:
    last = read_last_success(root)
    pin = artifact_versions.read_pin(root)
    last_run = read_last_run(root)
    held = last_run.get("pin_held")
    versions = artifact_versions.list_versions(root)
    out: dict[str, Any] = {"publish_root": str(root), "current": None,
                           "versions": versions,
                           "last_success": last.isoformat() if last else None, "pinned": None,
                           "last_pin_held": held if isinstance(held, dict) else None, "error": None}
    if (ran := read_last_ran(root)) is not None and isinstance(failed := last_run.get("last_ran_failed"), str):
        # a scheduled run that failed after the last publish (a publish's record replaces it): said, not left to
        # last_success alone, which read as if nothing had run since
        out["last_run_failed"] = {"at": ran.isoformat(), "error": failed}
    if (warned := last_run.get("warnings")) and isinstance(warned, list):  # the last publish's: published with them
        out["last_run_warnings"] = warned
    if leftovers := _leftovers(root, versions):  # said, never hidden: they hold disk and were once mistaken
        out["not_versions"] = leftovers
    try:  # moved into place by a publish that never made them current (never a rollback target), or one running now
        never, publishing = unfinished(root)
    except artifact_versions.ArtifactError as exc:
        never, publishing, out["history_error"] = None, None, str(exc)
    if never:
        out["never_current"] = never
    if publishing:
        out["publishing"] = publishing
    try:
        current = artifact_versions.read_current(root)
        out["error"] = dangling_current(root)  # CURRENT naming a version that is gone: read_current says None
        if current is not None:
            m = artifact_manifest.read_manifest(current)
            out["current"] = current.name
            out["manifest"] = {"version": m["version"], "created_utc": m["created_utc"], "format": m["format"],
                               "source": {k: m["source"].get(k)
                                          for k in ("checkpoint", "samples_trained", "offsets", "lineage")},
                               "hot_set": m["hot_set"], "bytes": {n: f["bytes"] for n, f in m["files"].items()}}
    except artifact_versions.ArtifactError as exc:  # the status of a broken publish root is that error
        out["current"], out["error"] = None, str(exc)
    if pin is not None and (pin.problem is not None or (out["current"] is not None and pin.holds(out["current"]))):
        out["pinned"] = {"version": pin.version, "rolled_back_from": pin.rolled_back_from, "problem": pin.problem,
                         "deltas": "paused until an operator publishes (`streamrec refresh --now`)",
                         "scheduled_runs": "build and validate but do not publish while the pin holds"}
    return out


def _leftovers(root: Path, versions: list[str]) -> dict[str, str]:
    """The entries of ``versions/`` that are no complete version (name, escaped -> what it is): a version directory
    without a manifest (half-written, or not a refresh's: pruning and rollback skip it, nothing deletes it), and
    anything else but a pruned version being removed. At most 50 named."""
    d = artifact_versions.versions_dir(root)
    found: dict[str, str] = {}
    for name in versions:
        if not (d / name / artifact_manifest.MANIFEST).is_file():
            found[ascii(name)] = (f"no {artifact_manifest.MANIFEST}: half-written, or not a refresh's; skipped, "
                                  "not deleted")
    try:
        others = sorted(p.name for p in d.iterdir() if p.name not in versions and not p.name.startswith(TRASH))
    except OSError:
        others = []
    for name in others:
        found[ascii(name)] = "not a version directory (another name, a file or a link elsewhere); ignored"
    return dict(list(found.items())[:50])


def dangling_current(root: Path) -> str | None:
    """Why there is no live version although ``CURRENT`` names one (the version is gone), else None."""
    try:
        name = artifact_versions.current_version(root)
    except artifact_versions.ArtifactError:
        return None  # a malformed CURRENT: read_current says so itself
    if name is None or (artifact_versions.versions_dir(root) / name).is_dir():
        return None
    return (f"{Path(root) / artifact_versions.CURRENT} names {name}, which is not in "
            f"{artifact_versions.versions_dir(root)}: a "
            "restarting server has no model; publish with `streamrec refresh --now`")
