"""The refresh's record of its runs, ``<publish_root>/last_run.json``: the last success (written by a publish), the
last run a rollback pin held back (``pin_held``) and the last scheduled run that did not publish (``last_ran``), each
read back for the scheduler's catch-up at start, the last-success gauge and ``--status``; a recorded time from the
future (beyond :data:`MAX_CLOCK_SKEW_S`) is no record. Without a usable record the last success is the live version's
publish time (:func:`live_published_at`)."""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from pathlib import Path
from typing import Any

from cache_refresh import metrics
from learner import artifact_manifest, artifact_versions
from stream.files import MAX_STATE_FILE_BYTES, describe_os_error, finite_json, read_regular, write_atomic

log = logging.getLogger("streamrec.refresh")

LAST_RUN = "last_run.json"


# How far in the future a recorded time (last_run.json's last_success, the live manifest's created) may lie and still
# be believed: clocks of the hosts that write and read a publish root differ by a little (NTP keeps them within
# seconds). Beyond it the time is untrusted (clock skew, a root copied from another host, a hand edit): believed, it
# kept the last-success gauge ahead of now, and the staleness alert on it silent, for as long as it was ahead.
MAX_CLOCK_SKEW_S = metrics.MAX_CLOCK_SKEW_S  # (the gauge is held to it too: metrics._set_last_success)


def _in_future(when: float, now: float | None = None) -> bool:
    return when > (time.time() if now is None else now) + MAX_CLOCK_SKEW_S


def _when(t: float) -> str:
    """``t`` (epoch seconds) for a log line: UTC, or the number when no date has it."""
    try:
        return _utc(t)
    except (OverflowError, ValueError, OSError):
        return f"{t!r} (epoch seconds)"


def read_last_success(root: Path, now: float | None = None) -> dt.datetime | None:
    """When the last refresh succeeded (UTC), from ``<publish_root>/last_run.json``; None if never.

    A file that cannot be read or does not hold a usable time (not JSON, not an object, ``last_success``
    missing, null, not a number, out of range) is no record either, with a warning naming the file: the
    scheduler then starts as if no run had succeeded (it may catch up one run), ``--status`` shows none. So is one
    that is not a regular file (a FIFO there hung the scheduler's start) or holds more than
    :data:`~stream.files.MAX_STATE_FILE_BYTES`. So is a time more than :data:`MAX_CLOCK_SKEW_S` after ``now``
    (default: the clock), with a warning naming the file and the time: it was believed, and the staleness alert
    stayed silent until the clock caught up with it.
    """
    path = Path(root) / LAST_RUN
    try:
        raw = read_regular(path, MAX_STATE_FILE_BYTES, "a last-run record")
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read %s (%s); treated as no record of a successful refresh", path,
                    describe_os_error(exc))
        return None
    try:
        when = json.loads(raw.decode("utf-8"))["last_success"]
        if isinstance(when, bool) or not isinstance(when, (int, float, str)):
            raise TypeError(f"last_success is {type(when).__name__}, not a number")
        last = dt.datetime.fromtimestamp(float(when), tz=dt.timezone.utc)
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, OSError, RecursionError) as exc:
        log.warning("%s does not hold a usable last success (%s: %s); treated as no record of a successful "
                    "refresh", path, type(exc).__name__, str(exc)[:200])
        return None
    if _in_future(last.timestamp(), now):
        log.warning("%s records a last success at %s, in the future (more than %g s ahead of this host's clock: "
                    "clock skew, a publish root copied from another host, a hand edit); not trusted, treated as no "
                    "record of a successful refresh", path, last.isoformat(timespec="seconds"), MAX_CLOCK_SKEW_S)
        return None
    return last


def live_published_at(root: Path, now: float | None = None) -> float | None:
    """When the live version was published, as the publish root itself tells (without ``last_run.json``): its
    manifest's ``created`` (set when the artifact was built, moments before its publish; it travels with the version,
    and after a rollback it is the rolled-back model's age), else, when the manifest cannot be read, the modification
    time of ``CURRENT`` (written by the publish or rollback). None when nothing is live: nothing published, or a
    ``CURRENT`` that is malformed or names a version that is gone (serving has no model to start with either). A time
    more than :data:`MAX_CLOCK_SKEW_S` in the future is not trusted either (a warning naming it): the next one, or
    None."""
    try:
        current = artifact_versions.read_current(root)
    except artifact_versions.ArtifactError:
        return None
    if current is None:
        return None
    try:
        created = float(artifact_manifest.read_manifest(current)["created"])
        if not _in_future(created, now):
            return created
        log.warning("the live version's manifest (%s) says it was created at %s, in the future (more than %g s "
                    "ahead of this host's clock); not trusted: its publish time is taken from %s's modification time",
                    current / artifact_manifest.MANIFEST, _when(created), MAX_CLOCK_SKEW_S,
                    Path(root) / artifact_versions.CURRENT)
    except artifact_versions.ArtifactError as exc:
        log.warning("the live version's manifest cannot be read (%s); its publish time is taken from %s's "
                    "modification time", exc, Path(root) / artifact_versions.CURRENT)
    try:
        mtime = (Path(root) / artifact_versions.CURRENT).stat().st_mtime
    except OSError:
        return None
    if _in_future(mtime, now):
        log.warning("%s was modified at %s, in the future (more than %g s ahead of this host's clock); not trusted: "
                    "the live version's publish time is unknown", Path(root) / artifact_versions.CURRENT, _when(mtime),
                    MAX_CLOCK_SKEW_S)
        return None
    return mtime


def restore_last_success(root: Path) -> dt.datetime | None:
    """:func:`read_last_success`, also set as ``streamrec_refresh_last_success_timestamp_seconds``
    (``metrics.restore_last_success``): called when the scheduler starts and when a run starts, so the gauge says how
    old the published model is from the first scrape, not 0 until this process publishes. Without a usable record
    (``last_run.json`` missing or unreadable: a fresh state dir, a deleted file, a new container with the publish root
    mounted) the gauge is set from the live version's publish time (:func:`live_published_at`); it stays 0 only when
    nothing is live (with a staleness alert on it, that alert fired at once although a version was serving). Returns
    the latest recorded run, for the scheduler's catch-up at start (``scheduler.missed_run``): the last success, or a
    later scheduled run that ran without publishing (failed or held by the pin, :func:`read_last_ran`: it was not
    missed; before, only a publish counted and a restart ran it again). A record in the future (beyond
    :data:`MAX_CLOCK_SKEW_S`) is no record (:func:`read_last_success`): the gauge then comes from the live version,
    and the catch-up counts no success."""
    when = read_last_success(root)
    ran = read_last_ran(root)
    if when is not None:
        metrics.restore_last_success(when.timestamp())
        return max(when, ran) if ran is not None else when
    published = live_published_at(root)
    if published is not None:
        log.info("no usable %s in %s; the last success is the live version's publish time, %s", LAST_RUN, root,
                 _utc(published))
        metrics.restore_last_success(published)
    return ran


def read_last_run(root: Path) -> dict[str, Any]:
    """``<publish_root>/last_run.json`` as written (``{}`` when absent or unreadable: not a regular file, larger than
    :data:`~stream.files.MAX_STATE_FILE_BYTES`)."""
    try:
        data = json.loads(read_regular(Path(root) / LAST_RUN, MAX_STATE_FILE_BYTES, "a last-run record"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _utc(when: float) -> str:
    return dt.datetime.fromtimestamp(when, tz=dt.timezone.utc).isoformat(timespec="seconds")


def write_last_success(root: Path, when: float, version: str,
                       lineage_switched: dict[str, Any] | None = None) -> None:
    """A publish: replaces the whole record (a ``pin_held`` of earlier runs ends with the publish).
    ``lineage_switched``: the publish replaced a version of another training run
    (:func:`~cache_refresh.job._lineage_switch`), else null."""
    write_atomic(Path(root) / LAST_RUN, json.dumps({
        "last_success": when, "version": version, "last_success_utc": _utc(when),
        "lineage_switched": lineage_switched}).encode())


def write_pin_held(root: Path, when: float, built: str, pin: artifact_versions.Pin) -> None:
    """A scheduled run that did not publish because of a rollback pin: added to the record, which keeps
    the last success (and the catch-up at start counts the run as ran: :func:`_record_ran`)."""
    data = read_last_run(root)
    data["pin_held"] = {"at": when, "at_utc": _utc(when), "built": built, "pinned": pin.version,
                        "rolled_back_from": pin.rolled_back_from, "problem": pin.problem}
    write_atomic(Path(root) / LAST_RUN, json.dumps(finite_json(data), allow_nan=False).encode())  # a NaN read back


def _record_ran(root: Path, began: float, failed: str | None = None) -> None:
    """``last_ran``: when a scheduled run that did not publish (failed, or held by the pin) began; best effort.
    ``last_ran_failed``: why it failed (its error, redacted by the caller), null for a run the pin held."""
    data = read_last_run(root)
    data["last_ran"], data["last_ran_utc"] = began, _utc(began)
    data["last_ran_failed"] = failed[:1000] if failed else None
    try:
        write_atomic(Path(root) / LAST_RUN, json.dumps(finite_json(data), allow_nan=False).encode())
    except OSError as exc:
        log.warning("could not record the run in %s (%s); a restart within misfire_grace_s runs it again",
                    Path(root) / LAST_RUN, describe_os_error(exc))


def read_last_ran(root: Path, now: float | None = None) -> dt.datetime | None:
    """``last_ran`` of ``last_run.json`` (:func:`_record_ran`); None when none is recorded or it is not a usable time
    (a number, finite, not in the future beyond :data:`MAX_CLOCK_SKEW_S`)."""
    when = read_last_run(root).get("last_ran")
    if isinstance(when, bool) or not isinstance(when, (int, float)) or _in_future(when, now):
        return None
    try:
        return dt.datetime.fromtimestamp(when, tz=dt.timezone.utc)
    except (OverflowError, ValueError, OSError):  # (NaN, out of range)
        return None


def _record_success(root: Path, version: str, lineage_switched: dict[str, Any] | None = None) -> bool:
    """``last_run.json`` after a publish; False (with a warning) when it cannot be written."""
    try:
        write_last_success(root, time.time(), version, lineage_switched)
        return True
    except OSError as exc:
        log.warning("published %s but could not record it in %s (%s); the scheduler may run a missed run again "
                    "at its next start", version, root / LAST_RUN, describe_os_error(exc))
        return False


def _record_warnings(root: Path, version: str, warnings: list[str]) -> None:
    """Add a published run's warnings to ``last_run.json`` (``warnings``; ``--status`` shows them as
    ``last_run_warnings``): published with warnings, not a clean publish. The next publish's record replaces them.
    Best effort: each was alerted already (``refresh_degraded``), a failure here is logged."""
    data = read_last_run(root)
    if data.get("version") != version:  # not this run's record (unreadable, or another run's since)
        return
    data["warnings"] = [w[:1000] for w in warnings]
    try:
        write_atomic(Path(root) / LAST_RUN, json.dumps(finite_json(data), allow_nan=False).encode())
    except OSError as exc:
        log.warning("published %s with warnings, but could not record them in %s (%s)", version, root / LAST_RUN,
                    describe_os_error(exc))
