"""One refresh: hot set -> latest checkpoint -> artifact -> validate -> publish -> notify serving.

    Redis counts (last D days) --hot_set--> hot rows ---+
    learner checkpoint (newest) --------------------------+--build_artifact--> staged artifact
                                                          validate: probe == learner, holdout >= live - bound
                                                          embedding_store ([refresh] embedding_store = layered):
                                                            non-hot rows -> Redis <prefix>:emb:<v>:, meta last
                                                          publish: versions/<v>, CURRENT -> <v>, keep N
                                                          notify: Redis PUBLISH <prefix>:model-updates

Failures raise :class:`RefreshError` naming the stage and the cause, after the staged artifact was
removed (nothing is published: the live artifact keeps serving), a firing alert was written to the
Kafka ``alerts`` topic and the log. Failing closed: the checkpoint is loaded without unpickling code
(``load_latest(safe=True)``) and checked before anything is built (``artifact_manifest.check_checkpoint``: meta,
feature config, table shape, finite weights); an unreadable newest checkpoint falls back to the previous
one (logged, and named in the summary), none loadable is a failure naming each file's reason. With
``signing_key_file`` (read at the start of each run, stage ``signing_key``) the manifest of the artifact
built is signed (``learner/artifact_manifest.py``), the staged artifact is loaded and published only if its
signature checks, and the live artifact compared against is loaded only if signed with the same key. Only a
staged artifact that validated is published, and ``publish`` verifies every file again before the
rename; a failed run is not retried by the job itself (the schedule's next run, or ``--now``, is the
retry), so a bad checkpoint costs one failed run and one alert, never a loop.

The layered deployment (``serving/embedding_store.py``): with ``embedding_store = "layered"`` the validated
artifact's rows outside the hot set are written to Redis before the version is published (a failure fails stage
``embedding_store``: nothing is published; the rows of versions a killed run of this publish root began to write are
deleted first, best effort), and after publishing the rows of versions no longer in the publish
root (pruned) are deleted, best effort. A run that wrote its rows and then did not publish (held by a rollback pin, a
failed publish) deletes them, best effort: no ranker loads that version.

Redis is retried with exponential backoff before it counts as
unreachable. A failed notification does not fail the refresh: the version is published, serving
polls ``CURRENT`` and finds it; the summary says ``notified: false`` (so does a notification no serving process
received: ``notify_receivers`` is Redis's count of them, null when it could not be sent).

One run at a time per publish root: a run holds ``refresh_lock``; a second run does nothing and says so at once
(:func:`skipped`: a ``refresh_skipped`` warning naming the pid of the first, ``outcome="skipped"``; not a failure,
the first run is refreshing; a lock that cannot be opened fails stage ``lock``) and a run starts by removing what
killed runs left (``clean_leftovers``: staged directories of dead processes, a half-pruned version, temp files; the
summary lists them under ``cleaned``). A full or read-only publish root fails the stage that hit it
with a message saying so (``describe_os_error``); nothing half-written is made current. Once
``CURRENT`` names the new version the run has published, whatever happens next: recording ``last_run.json``
(``last_run_recorded: false`` in the summary), pruning the embedding store, notifying serving and the summary are
each contained (``_AfterPublish``); an error in one is logged, counted (``streamrec_refresh_degraded_total``) and
alerted as ``refresh_degraded`` (a warning), kept in ``last_run.json`` (``warnings``; ``--status``:
``last_run_warnings``) and the run reports its publish (``--now`` exits 0). The summary is
made from the manifest of the validated artifact, the files ``publish`` verified and renamed: nothing is read back
from the publish root after the switch.

**Times from the future.** ``last_run.json``'s last success (and, without it, the live manifest's ``created`` or
``CURRENT``'s modification time) more than ``MAX_CLOCK_SKEW_S`` (5 minutes) ahead of this host's clock is not trusted
(clock skew, a copied root, a hand edit; a warning names the file and the time): believed, it held the last-success
gauge ahead of now and kept the staleness alert silent for as long. It counts as no record
(:func:`~cache_refresh.run_records.read_last_success`).

**Another training run.** A checkpoint's ``meta["lineage"]`` names its training run (``learner/checkpoint_lineage.py``).
A publish whose checkpoint lineage differs from the live version's source lineage (both known) replaces the serving
model with one of another training run (a learner started afresh, e.g. pointed at an empty checkpoint directory):
maybe meant, maybe a large quality drop. It publishes (the samples-trained guard does not apply across lineages), and
says so: a ``refresh_lineage_switched`` warning (labels ``from_lineage``, ``to_lineage``, ``replaced``), a log
warning, ``streamrec_refresh_lineage_switched_total``, and ``lineage_switched`` in the summary and ``last_run.json``
(null when the lineage stayed, either is unknown, or nothing was live).

**Rollback pins.** An operator's ``streamrec refresh --rollback`` pins the older version
(``<publish_root>/PINNED``). A *scheduled* run (``respect_pin=True``, :func:`scheduled_run`) while the
pin holds the live version builds and validates as usual (so the operator learns whether the newest
checkpoint would pass) but publishes nothing: it removes its staged artifact, logs an error, writes a
``refresh_pinned`` alert (severity ``warning``, labels ``{"stage": "publish", "pinned": <version>}``),
records ``pin_held`` in ``last_run.json`` (shown by ``--status``) and returns a summary with
``published: false`` and ``pin_held``. Only an operator ends the pin: ``streamrec refresh --now``
(``respect_pin=False``) publishes over it and removes it (logged as a warning; ``unpinned`` in the
summary names the pin it ended).

The alert is a ``monitor.alerts.Alert``, sent through the monitor's own sinks (the log at once, and Kafka
through a retrying queue: ``cache_refresh/alerts.py``; a broker down at alert time delays the alert, it does not
lose it while the scheduler runs) with the monitor's record shape: ``{"rule": "refresh_failed", "source":
"refresh", "severity": "critical", "state": "firing", "value": null, "threshold": null, "message", "ts" (ms),
"labels": {"stage"}, "kind": "series", "fingerprint"}``, keyed by the rule name. The next run that
publishes sends the "resolved" record of each alert fired since the last publish, whichever process on the publish
root fired it (``RefreshAlerts.resolve_firing``, ``cache_refresh/alerts.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import redis

from cache_refresh import hot_set, metrics, validate
from cache_refresh.alerts import FAILED_RULE, RefreshAlerts
from cache_refresh.publish import PinHeld, RefreshBusy, clean_leftovers, publish, refresh_lock
from cache_refresh.redis_client import _redis, redis_timeout_s
from cache_refresh.run_records import (
    LAST_RUN,
    _record_ran,
    _record_success,
    _record_warnings,
    restore_last_success,
    write_pin_held,
)
from cache_refresh.settings import RefreshSettings
from cache_refresh.status import _current_name
from cache_refresh.stored_rows import (
    _delete_abandoned,
    _delete_unfinished,
    _discard_stored,
    _may_be_live,
    _may_hold,
    _owner,
    _prune_stored,
)
from learner import artifact, artifact_manifest, artifact_versions
from learner import checkpoint as ckpt_io
from learner.features import FeatureConfig
from learner.row_mapper import RowMapper
from learner.scorer import CALIBRATED_FORMATS
from learner.tensorpack import SigningKey, load_signing_key
from serving import stored_versions
from serving.model import ScoringModel
from serving.served_versions import served_versions
from serving.settings import EmbeddingStore
from stream.config import KafkaSettings, RedisSettings
from stream.errors import ConfigError, StreamrecError
from stream.files import describe_os_error
from stream.redis_client import RedisAuthError, connect, describe, verify
from stream.secrets import redact
from stream.stop_signals import put_back_signals, take_stop_signals

log = logging.getLogger("streamrec.refresh")
T = TypeVar("T")

ALERT_RULE = FAILED_RULE  # "refresh_failed"
PIN_RULE = "refresh_pinned"
SKIP_RULE = "refresh_skipped"  # did nothing: another run was going (skipped())
DEGRADED_RULE = "refresh_degraded"  # published, with something an operator should look at (_published_warnings)
LINEAGE_RULE = "refresh_lineage_switched"  # published a model of another training run than the live one's


class RefreshError(StreamrecError):
    """A refresh failed and published nothing; ``stage`` says where (hot_set, checkpoint, build, ...)."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(f"refresh failed at {stage}: {message}")
        self.stage = stage


def notify_channel(rs: RefreshSettings, rds: RedisSettings) -> str:
    return rs.notify_channel or f"{rds.prefix}:model-updates"


# -- the job -------------------------------------------------------------------------------------
def notify(rs: RefreshSettings, rds: RedisSettings, version: str, path: Path, sleep: Any = time.sleep,
           on_retry: Callable[[str], None] | None = None) -> int | None:
    """PUBLISH the new version to serving (best effort, retried; ``on_retry``: each retry's warning, the run's
    :class:`RunProgress`); serving also polls CURRENT. Returns how many
    subscribers received it (Redis's answer to PUBLISH; 0: no serving process listens on the channel, e.g. another
    [redis] prefix or notify_channel), None when it could not be sent. The summaries say ``notified`` only for a
    message someone received (it said true for 0 receivers) and give ``notify_receivers``."""
    message = json.dumps({"version": version, "path": str(path), "ts": int(time.time() * 1000)})
    try:
        client = _redis(rds, rs)
    except ConfigError as exc:  # a password or TLS file gone since the hot set was read: published all the same
        log.warning("published %s but could not notify serving (%s); serving will find it by polling", version, exc)
        return None
    try:
        receivers = int(hot_set.with_retries("notify serving",
                                             lambda: client.publish(notify_channel(rs, rds), message),
                                             rs.redis_attempts, rs.redis_backoff_s, sleep, on_retry))
    except (hot_set.RedisUnavailable, redis.RedisError) as exc:  # NOPERM on the channel is a ResponseError
        log.warning("published %s but could not notify serving (%s); serving will find it by polling", version,
                    describe(exc, rds) if isinstance(exc, redis.RedisError) else exc)
        return None
    finally:
        client.close()
    if receivers == 0:
        log.warning("published %s; no serving process is subscribed to %s (is serving up, with the same [redis] "
                    "prefix / notify_channel?); serving will find it by polling CURRENT", version,
                    notify_channel(rs, rds))
    return receivers


def _served(rs: RefreshSettings, rds: RedisSettings) -> dict[str, list[str]]:
    """The versions live scoring processes serve (``serving/served_versions.py``: version -> ``host:pid``s), which
    the prune and the embedding store's cleanup keep. Redis unreachable or refusing: ``{}`` and a WARNING, and they
    prune as before (the last keep_versions, the current one and the pinned one)."""
    try:
        client = _redis(rds, rs)
        try:
            return served_versions(client, rds.prefix)
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 - best effort: never worse than before
        log.warning("refresh: could not read which versions serving serves (%s); pruning keeps only the last "
                    "keep_versions, the current and the pinned version", exc)
        return {}


class RefreshTerminated(BaseException):  # noqa: N818 - a stop, not an error of the run's own
    """SIGTERM/SIGINT during :func:`run_now`, raised where the run is; it ends as a failed run at that stage.

    A ``BaseException``, as ``KeyboardInterrupt``: the run's best-effort ``except Exception`` blocks (a newest
    checkpoint skipped as unreadable, a malformed holdout message, Redis cleanups) must not take it for their own
    failure and go on, to publish after the operator asked the run to stop; only the run's failure path
    (:func:`_run_locked`, which records the failed run) catches it."""


class StopSignals:
    """How :func:`run_now`'s SIGTERM/SIGINT reach the run: the signals' handler, passed down to the run (``run_once``'s
    ``stop``), which says where a stop may still raise; no state of the module (a scheduled run is not touched).

    The first signal raises :class:`RefreshTerminated` where the run is from its first stage, taking the lock
    (:meth:`arm`; a signal that came before raises there: every stop is a failed run of the run's one failure path,
    alerted and counted, never an error outside the run), until the run begins its publish (:meth:`hold`: publish() is
    atomic and short, and after it the run has published; a failure raised there would report a publish as failed),
    begins to handle a failure (the failure is the run's outcome, alerted and counted: a stop raised in its handler
    replaced it) or is skipped; from then on, and for any later signal, it is logged with the reason given to
    :meth:`hold` and the run finishes as it is.

    A stop never replaces an exception in flight: one that comes while the run (or anything it calls, in any package)
    is in an ``except``, a ``finally`` or an ``__exit__`` with an exception (``sys.exc_info()`` in the handler) is
    logged and kept pending instead of raised. Raised there, it replaced a failure on its way out (Redis down at the
    hot set, the stop in the client's ``close()``): the alert said "stopped by SIGTERM", not the reason, and the
    cleanup was cut short (build_artifact's removal of its staged directory). The failure then ends the run as itself;
    a run that got past the exception (a best-effort ``except``) stops at the end of its stage (:meth:`check`),
    before any publish."""

    def __init__(self) -> None:
        self.got: list[int] = []
        self._armed = False
        self._held: str | None = None
        self._pending = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.got.append(signum)
        if self._armed and len(self.got) == 1:
            self._armed = False
            failing = sys.exc_info()[1]
            if failing is None:
                raise self._terminated()
            self._pending = True
            log.warning("%s while the refresh handles %s: the stop does not replace it (the run ends as that failure; "
                        "if it goes on, it stops at the end of its stage)", signal.Signals(signum).name,
                        type(failing).__name__)
        elif self._held is not None or len(self.got) > 1:
            log.warning("%s %s", signal.Signals(signum).name, self._held or "again: the run is already stopping")

    def stopped(self) -> bool:
        """Whether a stop came (in the run, or before it: the run ended as failed, or finished as held)."""
        return bool(self.got)

    def _terminated(self) -> RefreshTerminated:
        return RefreshTerminated(f"stopped by {signal.Signals(self.got[0]).name} before it published: nothing was "
                                 "published, the live artifact keeps serving; run `streamrec refresh --now` again")

    def arm(self) -> None:
        """The run's first stage: from here a stop raises where the run is; one that came before raises now."""
        if self.got:
            raise self._terminated()
        self._armed = True

    def check(self) -> None:
        """The end of each stage (where the next begins: ``_run_locked``'s ``begin``), between the units of a long
        stage (each older checkpoint loaded, each file the build writes or hashes, the staged artifact loaded, each
        probe scoring, holdout poll, holdout batch scored and try of a broker request) and before the publish: a stop
        kept pending (it came while an exception was in flight, which the run got past) raises now, named with that
        stage; nothing once the run is held, nor while an exception is in flight (called there, it stays pending)."""
        if self._pending and self._held is None and sys.exc_info()[1] is None:
            self._pending = False
            raise self._terminated()

    def hold(self, why: str) -> None:
        """From here on a stop lets the run finish, logged with ``why``."""
        self._armed, self._held = False, why


class RunProgress:
    """Where the scheduled run in progress is: its stage and the last error it saw (a Redis retry's warning, at the
    hot set or notifying serving after the publish, a layered run's embedding store cleanup's error, before its write
    or after its publish, or the failure it is cleaning up after), written by the run's
    thread, read by the scheduler's when a stop abandons the run (``scheduler.run_forever``'s ``where``). Its
    abandonment alert said "shutdown" alone: a run held up by a Redis outage (5 attempts of up to redis_timeout_s
    each, with backoff: ~32 s by default) said nothing of Redis."""

    def __init__(self) -> None:
        self.stage: str | None = None  # None: no run in progress
        self.error: str | None = None

    def enter(self, stage: str) -> str:
        """The run begins ``stage`` (returned); errors seen in the stage before are forgotten."""
        self.stage, self.error = stage, None
        return stage

    def saw(self, error: str) -> None:
        self.error = error

    def where(self) -> tuple[str | None, str | None]:
        return self.stage, self.error


def run_now(rs: RefreshSettings, kafka: KafkaSettings, rds: RedisSettings, allow_older: bool = False,
            stop: StopSignals | None = None) -> dict[str, Any]:
    """``streamrec refresh --now``: :func:`run_once` (over a rollback pin) in the main thread, with SIGTERM/SIGINT
    ending the run the way a failed run ends: the staged artifact (and layered rows) removed, nothing published, an
    error line and a ``refresh_failed`` alert naming the stage and the signal, ``streamrec_refresh_runs_total
    {outcome="failed"}``, :class:`RefreshError` (exit 1, as the scheduler's abandoned run: ``EXIT_ABANDONED``).
    Before, the signal's default action ended the process at once with none of these. Only the first signal raises,
    and none once the publish has begun (the run finishes and says it was asked to stop): :class:`StopSignals`, the
    caller's (whose ``got`` says, after the run, whether a stop came in it) or one of its own."""
    stop = StopSignals() if stop is None else stop
    previous: dict[int, Any] = {}
    take_stop_signals(previous, stop)
    try:
        return run_once(rs, kafka, rds, respect_pin=False, allow_older=allow_older, stop=stop)
    finally:
        put_back_signals(previous)


def run_once(rs: RefreshSettings, kafka: KafkaSettings, rds: RedisSettings, sleep: Any = time.sleep,
             respect_pin: bool = False, allow_older: bool = False,
             alerts: RefreshAlerts | None = None, stop: StopSignals | None = None,
             progress: RunProgress | None = None) -> dict[str, Any]:
    """Run one refresh; returns its summary. Raises :class:`RefreshError` (and alerts) on any failure.

    ``respect_pin=False`` (``streamrec refresh --now``, an operator) publishes over a rollback pin and
    removes it; ``respect_pin=True`` (the schedule) builds and validates but does not publish while a pin
    holds the live version: the summary then says ``published: false`` and ``pin_held`` (see the module
    docstring). Either way the run holds the publish root's lock and cleans what killed runs left first.
    A checkpoint that has trained fewer samples than the live version is refused at stage ``checkpoint``
    unless ``allow_older`` (``--now --allow-older``, an operator's decision).

    ``alerts``: the scheduler's, which outlives the run (an alert Kafka did not take is retried until it does);
    None: the run opens its own and closes it before returning, draining what Kafka has not acknowledged yet
    (``cache_refresh/alerts.py``). ``stop``: :func:`run_now`'s signal handler (None: signals are not the run's).
    ``progress``: the scheduler's :class:`RunProgress`, kept up to date by the run.
    """
    if alerts is None:
        own = RefreshAlerts(kafka, rs.alerts_topic, publish_root=Path(rs.publish_root))
        try:
            return run_once(rs, kafka, rds, sleep, respect_pin, allow_older, own, stop, progress)
        finally:
            own.close()
    t0 = time.monotonic()
    alerts.record_in(Path(rs.publish_root))  # what it fires, a later publish resolves (cache_refresh/alerts.py)
    restore_last_success(Path(rs.publish_root))  # a publish by another process (an operator's --now) counts too
    try:
        with contextlib.ExitStack() as held:  # the publish root's lock, taken by the run's first stage
            summary = _run_locked(rs, kafka, rds, sleep, respect_pin, allow_older, alerts, held, stop or StopSignals(),
                                  progress or RunProgress())
    except RefreshError as exc:
        metrics.observe(None, time.monotonic() - t0, exc.stage)
        raise
    if not summary.get("skipped"):  # (counted by skipped())
        metrics.observe(summary, time.monotonic() - t0)
    return summary


def skipped(alerts: RefreshAlerts, root: Path, why: str, stage: str, holder: str | None = None) -> dict[str, Any]:
    """A run that did nothing because another was going: logged, alerted as ``refresh_skipped`` (a warning: the other
    run publishes, or fails and alerts itself), counted ``streamrec_refresh_runs_total{outcome="skipped", stage}``.
    ``stage``: ``lock`` (another process's run holds the publish root: a ``--now`` and the scheduled run overlapping),
    ``scheduler`` (this scheduler's previous run has not ended when the next is due) or ``missed`` (the schedule's fire
    time passed more than ``misfire_grace_s`` ago: the machine asleep, a suspended VM). Returns the summary
    (``published: false``, ``skipped``); ``streamrec refresh --now`` exits 3 with it.

    Before, an overlap at the lock was a failure: a critical ``refresh_failed`` at stage ``lock`` (and ``--now`` exit 1)
    while the other run was publishing; the scheduler's own skip was a log line only."""
    message = f"refresh skipped: {why}"
    log.warning("%s", message)
    metrics.skipped(stage)
    alerts.fire(stage, message, SKIP_RULE, severity="warning", labels={"holder": holder} if holder else None)
    return {"published": False, "version": None,
            "skipped": {"stage": stage, "holder": holder, "message": message}, "current": _current_name(root)}


def scheduled_run(rs: RefreshSettings, kafka: KafkaSettings, rds: RedisSettings,
                  alerts: RefreshAlerts | None = None, progress: RunProgress | None = None) -> dict[str, Any] | None:
    """One run of the schedule: respects a rollback pin; failures are logged and alerted (through ``alerts``, the
    scheduler's, which keeps retrying what Kafka did not take), never raised (the schedule goes on, the live
    artifact keeps serving). Returns the summary, None after a failure. ``progress``: the scheduler's view of the run.
    A run that failed or was held by the pin is recorded as ``last_ran`` (when it began) in ``last_run.json``, with
    ``last_ran_failed`` (its error; ``--status`` shows both as ``last_run_failed``): the catch-up at start counts it as
    ran for its fire time (:func:`restore_last_success`), so a restart within the grace does not run it again and
    repeat its alert.
    """
    began, summary, failed = time.time(), None, None
    try:
        summary = run_once(rs, kafka, rds, respect_pin=True, alerts=alerts, progress=progress)
        return summary
    except RefreshError as exc:
        failed = str(exc)
        return None  # logged and alerted by run_once
    except BaseException as exc:  # not the run's own failure (a bug): APScheduler logs it; recorded all the same
        failed = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if summary is None or summary.get("pin_held"):  # it ran: failed or held (a skipped run did not)
            _record_ran(Path(rs.publish_root), began, redact(failed) if failed else None)
        if progress is not None:
            progress.stage = progress.error = None


def _live_source(root: Path) -> tuple[str, dict[str, Any]] | None:
    """The live version's name and its manifest's ``source`` (checkpoint, samples_trained, lineage, ...); None when
    nothing is live, or (with a warning) when it cannot be read: the checkpoint is then not compared with it."""
    try:
        current = artifact_versions.read_current(root)
        source = artifact_manifest.read_manifest(current)["source"] if current is not None else None
    except (artifact_versions.ArtifactError, KeyError, TypeError) as exc:
        log.warning("the live version's source cannot be read (%s); not comparing the checkpoint with it", exc)
        return None
    if current is None or not isinstance(source, dict):
        return None
    return current.name, source


def _sharded_only(directory: Path) -> str | None:
    """Why a checkpoint_dir without a single-process checkpoint has none to build from when it holds the sharded
    learner's (``dcp-*/``, written under torchrun, ``learner/sharded_checkpoint.py``), with how to go on (the
    single-process learner's wording, ``learner.daemon.refuse_sharded``); None when it holds none either. The refresh
    reads single-process checkpoints only; before, it asked whether the learner was running with that checkpoint_dir,
    which it was."""
    from learner import sharded_checkpoint  # torch.distributed.checkpoint: only on this failure

    found = sharded_checkpoint.describe_newest(directory)
    if found is None:
        return None
    return (f"checkpoint_dir {directory} holds only sharded checkpoints ({found}), which a refresh does not read; "
            "nothing was built or published, the live artifact is untouched. Convert the newest into a single-process "
            f"checkpoint with `streamrec train --checkpoint-dir {directory} --unshard NEW_DIR` and refresh from it "
            "(`streamrec refresh --checkpoint-dir NEW_DIR`, or [refresh] checkpoint_dir)")


def _lineage_switch(live: tuple[str, dict[str, Any]] | None, ckpt: ckpt_io.Checkpoint) -> dict[str, Any] | None:
    """What publishing ``ckpt`` over the live version replaces when it is of another training run: the checkpoint's
    lineage and the live version's source lineage are both known and differ (a learner started afresh, e.g. pointed
    at an empty checkpoint_dir; its count of samples starts again). ``{"from", "to", "replaced", ...}``, else None
    (same lineage, either unknown, nothing live)."""
    if live is None:
        return None
    name, source = live
    before, after = source.get("lineage"), ckpt["meta"].get("lineage")
    if not (before and after) or before == after:
        return None
    return {"from": before, "to": after, "replaced": name, "replaced_checkpoint": source.get("checkpoint"),
            "replaced_samples_trained": source.get("samples_trained"), "checkpoint": ckpt["path"],
            "samples_trained": ckpt["meta"].get("samples_trained")}


def _refuse_older_than_live(live: tuple[str, dict[str, Any]] | None, ckpt: ckpt_io.Checkpoint,
                            problems: list[tuple[Path, str]]) -> None:
    """RefreshError (stage ``checkpoint``) when the chosen checkpoint has trained fewer samples than the live
    version's source (``live``: :func:`_live_source`; same lineage, or either without one: as for deltas): publishing
    it would take serving back in time, e.g. when the newest checkpoint is torn and ``load_latest`` fell back to an
    older one. An unreadable live version is no reason to refuse (serving cannot load it either). A checkpoint of
    another lineage passes (its count starts again); its publish alerts (:func:`_warn_lineage_switched`)."""
    if live is None or _lineage_switch(live, ckpt) is not None:
        return
    name, source = live
    live_samples, have = source.get("samples_trained"), ckpt["meta"].get("samples_trained")
    if (isinstance(live_samples, int) and not isinstance(live_samples, bool) and isinstance(have, int)
            and have < live_samples):
        skipped = ("; newer checkpoints skipped: " + "; ".join(f"{p.name}: {why}" for p, why in problems)
                   if problems else "")
        raise RefreshError("checkpoint", f"the checkpoint {ckpt['path']} has trained {have} samples, fewer than "
                           f"the live version {name} ({live_samples} samples, from {source.get('checkpoint')}): "
                           f"publishing it would take serving back in time{skipped}. Nothing was built or "
                           "published, the live artifact keeps serving. Let the learner write a newer checkpoint "
                           "(or remove the damaged one), or publish it anyway with `streamrec refresh --now "
                           "--allow-older`")


def _run_locked(rs: RefreshSettings, kafka: KafkaSettings, rds: RedisSettings, sleep: Any,
                respect_pin: bool, allow_older: bool, alerts: RefreshAlerts, held: contextlib.ExitStack,
                stop: StopSignals, progress: RunProgress) -> dict[str, Any]:
    """One run; its first stage (``lock``) enters the publish root's lock into ``held``, for the caller to release.
    Every failure, a stop signal's too, leaves through the one ``except`` below: alerted, and counted by run_once."""
    stage = "start"
    staged: Path | None = None
    stored: str | None = None  # the version whose rows this run wrote to the embedding store (layered)
    timings: dict[str, float] = {}
    t_start = time.time()
    root = Path(rs.publish_root)
    unpinned: artifact_versions.Pin | None = None
    after_switch: list[str] = []  # what went wrong in publish() after CURRENT named the version (publish's warnings)
    kept_served: list[str] = []  # "kept v3: served by host:pid": the prune kept it, a scoring process serves it

    def timed(name: str, t0: float) -> None:
        timings[name] = round(time.monotonic() - t0, 3)

    def begin(name: str) -> str:  # the stage before ends: a stop kept pending raises here, named with it (check)
        stop.check()
        return progress.enter(name)

    try:
        stage = progress.enter("lock")
        stop.arm()
        try:
            held.enter_context(refresh_lock(root))
        except RefreshBusy as busy:  # another run is refreshing: this one did nothing, and that is no failure
            stop.hold("while the refresh is skipped: it ends as skipped")
            return skipped(alerts, root, str(busy), "lock", holder=busy.holder)

        # not "signing_key": "signing_key: <text>" reads as a secret to the log redactor
        stage = begin("signing")
        try:
            key = load_signing_key(rs.signing_key_file)
        except ConfigError as exc:
            raise RefreshError(stage, f"[refresh] {exc}; nothing was built or published") from exc

        stage = begin("cleanup")  # lists the publish root: its first reader
        cleaned = clean_leftovers(root)
        if cleaned:
            log.info("removed what killed refreshes left in %s: %s", root, ", ".join(cleaned))

        stage = begin("checkpoint")
        t0 = time.monotonic()
        problems: list[tuple[Path, str]] = []
        # One policy for every bad newest file (torn, foreign, a newer format, diverged, another shape): skipped and
        # reported, the newest one that loads and passes the artifact checks used (bounded by the live version's
        # samples below); the run alerts when it published from behind skipped ones.
        configs: dict[Path, FeatureConfig] = {}
        ckpt = ckpt_io.load_latest(Path(rs.checkpoint_dir), safe=True, problems=problems, between=stop.check,
                                   accept=lambda c: configs.__setitem__(c.path, artifact_manifest.check_checkpoint(c)))
        if ckpt is None and problems:
            raise RefreshError(stage, f"no checkpoint in {rs.checkpoint_dir} loads and passes the checks: "
                               + "; ".join(f"{p.name}: {why}" for p, why in problems)
                               + "; the live artifact is untouched. Let the learner write a new one")
        if ckpt is None:
            raise RefreshError(stage, _sharded_only(Path(rs.checkpoint_dir))
                               or f"no checkpoint in {rs.checkpoint_dir}; is the learner (`streamrec train`) "
                                  "running with the same checkpoint_dir?")
        cfg = configs[ckpt.path]
        live_source = _live_source(root)  # the version this run replaces (the lock keeps it live until the publish)
        switch = _lineage_switch(live_source, ckpt)  # alerted once published, never a reason not to publish
        if not allow_older:
            _refuse_older_than_live(live_source, ckpt, problems)
        timed(stage, t0)
        log.info("refresh: checkpoint %s (%s samples trained)", ckpt["path"], ckpt["meta"].get("samples_trained"))

        stage = begin("hot_set")
        t0 = time.monotonic()
        client = _redis(rds, rs)
        try:
            # One PING first (no retries): refused credentials fail the run now, with the fix, not after every
            # retry of the hot set's reads; an outage is left to those retries.
            pinger = connect(rds.clustered(rs.embedding_store_cluster), timeout_s=redis_timeout_s(rs), retries=0,
                             whole_reply=True)
            try:
                verify(pinger, rds, reachable=False)
            finally:
                pinger.close()
            hs = hot_set.compute(client, rds.prefix, rds.counts_ttl_days, cfg, rs.days, rs.hot_items, rs.hot_users,
                                 event=rs.count_event, fallback=rs.fallback_event,
                                 small_field_rows=rs.small_field_rows,
                                 attempts=rs.redis_attempts, backoff_s=rs.redis_backoff_s, sleep=sleep,
                                 mapper=RowMapper.from_state(cfg, ckpt.get("id_maps")), on_retry=progress.saw,
                                 between=stop.check)
        except RedisAuthError as exc:
            raise RefreshError(stage, f"{exc}; the live artifact is untouched") from exc
        except hot_set.RedisUnavailable as exc:
            raise RefreshError(stage, f"{exc} (url {redact(rds.url)}, each reply within {redis_timeout_s(rs):g} s: "
                                      "[refresh] redis_timeout_s); the live artifact is untouched. Is Redis up and "
                                      "answering in time (`streamrec stack status`, STREAMREC_REDIS_URL)?") from exc
        finally:
            client.close()
        timed(stage, t0)
        log.info("refresh: hot set of %d rows; hottest items %s; hottest users %s", len(hs.rows),
                 hot_set.describe_top(hs.stats["top_items"]), hot_set.describe_top(hs.stats["top_users"]))

        stage = begin("build")
        t0 = time.monotonic()
        batches: list[Any] | None = None  # the holdout, read here for a calibrated format (calibration_split)
        calibration = None
        if rs.format in CALIBRATED_FORMATS:
            batches = validate.read_holdout(kafka, rs.holdout_messages, rs.holdout_timeout_s, between=stop.check)
            calibration, batches = validate.calibration_split(batches, rs.format, rs.holdout_messages)
        staged = artifact.build_artifact(ckpt, root, hs.rows, format=rs.format, hot_stats=hs.stats, signing_key=key,
                                         between=stop.check, calibration=calibration)
        timed(stage, t0)
        log.info("refresh: built %s", staged)

        stage = begin("validate")
        t0 = time.monotonic()
        new = ScoringModel.load(staged, signing_key=key, mapped=True)  # read about once: not copied
        stop.check()
        probe = validate.probe(new, ckpt, rs.probe_samples, rs.validate_tolerance, hot_rows=hs.rows,
                               between=stop.check, on=batches)  # read already for a calibrated format only
        live, live_problem = _live_model(root, key)
        if batches is None:
            batches = validate.read_holdout(kafka, rs.holdout_messages, rs.holdout_timeout_s, between=stop.check)
        quality = validate.holdout(new, live, batches, rs.max_auc_drop, rs.max_int8_auc_drop, between=stop.check,
                                   switched_off=rs.holdout_messages == 0)
        if live_problem is not None and batches:
            quality["skipped"] = quality["unchecked"] = f"the live artifact does not load ({live_problem})"
        timed(stage, t0)
        log.info("refresh: %s validated", new.version)

        if rs.embedding_store is EmbeddingStore.LAYERED:
            stage = begin("embedding_store")
            t0 = time.monotonic()
            written = _store_rows(rs, rds, new, progress.saw, between=stop.check)
            stored = new.version
            timed(stage, t0)
            log.info("refresh: %d rows of %s written to the embedding store (%s)", written["stored"], new.version,
                     written["dtype"])

        stage = begin("publish")
        t0 = time.monotonic()
        pin = artifact_versions.pin_holding(root)
        previous = _current_name(root)  # live until rankers swap to the new version: its stored rows stay
        served = _served(rs, rds)  # versions scoring processes still serve: neither their files nor rows pruned
        stop.check()
        stop.hold("during the refresh's publish: the run finishes")
        try:
            path = publish(root, staged, rs.keep_versions, over_pin=not respect_pin, signing_key=key,
                           warnings=after_switch, served=served, kept=kept_served)
        except PinHeld as held:
            shutil.rmtree(staged, ignore_errors=True)
            staged = None
            if stored is not None:
                _discard_stored(rs, rds, stored, "held by the rollback pin", progress.saw)
            return _pin_held(alerts, root, new.version, held, {
                "checkpoint": ckpt["path"], "samples_trained": ckpt["meta"].get("samples_trained"),
                "probe": probe, "holdout": quality, "cleaned": cleaned,
                "seconds": {**timings, "total": round(time.time() - t_start, 3)}})
        staged = stored = None  # published: the version and its rows are the live ones from here on
        unpinned = pin
        timed(stage, t0)
    except (Exception, RefreshTerminated) as exc:  # (a stop is no Exception: nothing on the way may swallow it)
        stop.hold("while the refresh handles its failure: the run ends as that failure, alerted and counted")
        if isinstance(exc, RefreshError):
            err = exc
        elif isinstance(exc, OSError):
            err = RefreshError(stage, f"{describe_os_error(exc)} (publish root {root}); nothing was published, the "
                               "live artifact keeps serving; fix the file system and run `streamrec refresh --now`")
        elif isinstance(exc, (validate.ValidationFailed, artifact_versions.ArtifactError, RefreshTerminated)):
            err = RefreshError(stage, str(exc))
        else:
            err = RefreshError(stage, f"{type(exc).__name__}: {exc}")
        progress.saw(f"the run failed (its refresh_failed alert is sent) and is cleaning up: {err}")
        # Alerted before the cleanups (a Redis timeout each against the Redis that may have failed the run): a scheduler
        # stopped meanwhile abandons the run after its stop grace, and the alert then was "shutdown" alone.
        alerts.fire(err.stage, str(err), ALERT_RULE)
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
        if stored is not None and not _may_be_live(root, stored):
            _discard_stored(rs, rds, stored, "not published")
        if err is exc:
            raise
        raise err from exc

    # Published: CURRENT names the new version. Nothing below may turn that into a failure: each step is contained
    # (_AfterPublish) and what went wrong is a refresh_degraded warning of a published run.
    after = _AfterPublish(path.name)
    progress.enter("after_publish")  # CURRENT names the new version
    if unpinned is not None:
        pinned = (f"the rollback pin of {unpinned.version} (rolled back from {unpinned.rolled_back_from})"
                  if unpinned.version is not None else f"an unreadable rollback pin ({unpinned.problem})")
        log.warning("published %s over %s: an operator's run ends the rollback; serving applies learner deltas "
                    "again", path.name, pinned)
    after.step("resolve", lambda: alerts.resolve_firing(path.name), 0)  # before this run's own warnings fire
    switched = (after.step("lineage", lambda: _warn_lineage_switched(alerts, path.name, switch), None)
                if switch is not None else None)
    recorded = after.step("record", lambda: _record_success(root, path.name, switched), False)
    if rs.embedding_store is EmbeddingStore.LAYERED:
        after.step("embedding_store", lambda: _prune_stored(rs, rds, root, previous, progress.saw, served), None)
    no_warnings: list[tuple[str, str]] = []
    found = after.step("warnings", lambda: _published_warnings(
        rs, path.name, ckpt, problems, quality, hs.stats), no_warnings)
    t0 = time.monotonic()
    no_receivers: int | None = None
    receivers = after.step("notify", lambda: notify(rs, rds, path.name, path, sleep, progress.saw), no_receivers)
    timed("notify", t0)
    # The manifest publish() verified is the one the validated model was loaded from (the rename moves the same
    # files): nothing is read from the publish root again, so nothing there can fail a run that has published.
    manifest = new.manifest
    summary: dict[str, Any] = {
        "published": True, "version": path.name, "path": str(path), "format": rs.format, "checkpoint": ckpt["path"],
        "signed": key is not None,
        "samples_trained": ckpt["meta"].get("samples_trained"), "hot_set": manifest.get("hot_set"),
        "skipped_checkpoints": [{"path": str(p), "reason": why} for p, why in problems],
        "probe": probe, "holdout": quality, "notified": bool(receivers), "notify_receivers": receivers,
        "channel": notify_channel(rs, rds),
        "bytes": after.step("summary", lambda: {name: f["bytes"] for name, f in manifest["files"].items()}, {}),
        "unpinned": ({"version": unpinned.version, "rolled_back_from": unpinned.rolled_back_from}
                     if unpinned is not None else None),
        "last_run_recorded": recorded, "cleaned": cleaned, "lineage_switched": switched, "kept_served": kept_served,
    }
    found = [*found, *(("publish", w) for w in after_switch), *after.problems]
    summary["warnings"] = _warn_degraded(alerts, found)
    if summary["warnings"] and recorded:
        _record_warnings(root, path.name, summary["warnings"])
    summary["seconds"] = {**timings, "total": round(time.time() - t_start, 3)}
    log.info("published %s (%s, %d hot rows) from %s", path.name, rs.format, len(hs.rows), ckpt["path"])
    return summary


class _AfterPublish:
    """The steps of a run after ``CURRENT`` names its version: the run has published, whatever they do.

    :meth:`step` runs one; an exception (any: a Redis client, a file system, a bug) is logged and kept in
    :attr:`problems` as a ``(stage, message)`` warning for ``refresh_degraded`` (:func:`_warn_degraded`), and the
    step's ``default`` stands in for its result. Before, an error there escaped ``run_once``: no runs metric, no
    alert, ``--now`` exited 1 although serving was switching to the new version."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.problems: list[tuple[str, str]] = []

    def step(self, stage: str, fn: Callable[[], T], default: T) -> T:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - published already: reported as degraded, never a failure
            message = (f"published {self.version}, but the step {stage!r} after the switch failed: "
                       f"{type(exc).__name__}: {str(exc)[:500]}; the version is live (serving polls CURRENT)")
            log.warning("%s", message)
            self.problems.append((stage, message))
            return default


def _pin_held(alerts: RefreshAlerts, root: Path, built: str, held: PinHeld,
              summary: dict[str, Any]) -> dict[str, Any]:
    """A scheduled run that validated but did not publish over a rollback pin: say so everywhere."""
    pin = held.pin
    message = (f"scheduled refresh did not publish: {held}. The rollback stays in force; the artifact {built} "
               "built and validated from the newest checkpoint was discarded")
    log.error("%s", message)
    alerts.fire("publish", message, PIN_RULE, severity="warning", labels={"pinned": pin.version or "unreadable"})
    try:
        write_pin_held(root, time.time(), built, pin)
    except OSError as exc:
        log.warning("could not record the held pin in %s (%s)", root / LAST_RUN, describe_os_error(exc))
    return {"published": False, "version": None, "built": built,
            "pin_held": {"version": pin.version, "rolled_back_from": pin.rolled_back_from, "problem": pin.problem,
                         "message": message},
            "current": _current_name(root), **summary}


def _store_rows(rs: RefreshSettings, rds: RedisSettings, model: ScoringModel,
                on_error: Callable[[str], None] | None = None, between: Callable[[], object] = lambda: None,
                ) -> dict[str, Any]:
    """The layered deployment: write the validated artifact's non-hot rows to Redis before it is published
    (serving/stored_versions.py), ``meta`` last, ``between`` (the run's stop check) after each chunk of rows: a stop
    raised there deletes the rows written, as a failure does (nothing is published). A stop signal
    while the rows of a failed write are deleted lets the deletion finish (:class:`StopSignals` raises none while an
    exception is in flight): raised inside it, it left them in Redis and replaced the failure. ``on_error``: the
    error of the best-effort cleanup before the write (:func:`~cache_refresh.stored_rows._cleanup_failed`). Only a
    write that began (its writer marker's SET sent, and not refused: :func:`_may_hold`) is deleted: a stop in that
    cleanup, before it, or a refused marker, cost a SCAN of the keyspace for nothing."""
    client = _redis(rds, rs)
    try:
        _delete_abandoned(client, rds, _owner(rs), on_error, between,
                          published=set(artifact_versions.list_versions(Path(rs.publish_root))))
        try:
            return stored_versions.write_version(client, rds.prefix, model.version, model.table, model.non_hot_rows(),
                                                 rs.embedding_store_dtype, owner=_owner(rs), between=between)
        except BaseException as exc:  # any failure, and a stop (RefreshTerminated): the rows written so far go
            if not isinstance(exc, stored_versions.VersionTaken) and _may_hold(client, rds, model.version, exc):
                _delete_unfinished(client, rds, model.version)  # (not another writer's rows: nothing was written)
            if isinstance(exc, stored_versions.VersionTaken):
                raise RefreshError("embedding_store", f"{exc}; nothing was published, the live artifact keeps "
                                   "serving") from exc
            if isinstance(exc, redis.RedisError):
                raise RefreshError("embedding_store", f"{describe(exc, rds)}; nothing was published, the live "
                                   "artifact keeps serving") from exc
            raise
    finally:
        client.close()


def _live_model(root: Path, key: SigningKey | None = None) -> tuple[ScoringModel | None, str | None]:
    """The live artifact to compare with, or None and why not when there is one that does not load (with ``key``:
    also when it is not signed with it, e.g. after a key rotation): the comparison is then skipped, and the
    publish alerts (:func:`_published_warnings`)."""
    try:
        current = artifact_versions.read_current(root)
        return (ScoringModel.load(current, signing_key=key, mapped=True) if current is not None else None), None
    except artifact_versions.ArtifactError as exc:
        log.warning("the live artifact does not load (%s); the holdout comparison is skipped", exc)
        return None, str(exc)


def _published_warnings(rs: RefreshSettings, version: str, ckpt: ckpt_io.Checkpoint,
                        problems: list[tuple[Path, str]], quality: dict[str, Any],
                        counted: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What a successful publish must not hide, as ``(stage, message)`` for :func:`_warn_degraded`: the quality gate
    could not compare with a live artifact that exists (it does not load with this run's key, or it has another
    feature config) or could not measure a reduced-precision artifact's AUC cost (no samples, one class), newer
    checkpoints were skipped (torn, refused, diverged), or the hot set has no counted id of a kind it has a budget for
    (``counted``: the hot set's stats, ``items`` / ``users``; Redis holds no counts of that kind: a wrong prefix, or
    lost on a restart). Per kind, not their sum: on a Redis Cluster each kind's counts live on one node (their hash
    tag), so a node restarted empty loses one kind's while the other's remain."""
    found: list[tuple[str, str]] = []
    if quality.get("unchecked"):
        found.append(("validate", f"published {version} without the holdout comparison with the live version: "
                                  f"{quality['unchecked']}; compare them by hand (`streamrec evaluate`) or roll back "
                                  "with `streamrec refresh --rollback`"))
    if quality.get("unmeasured"):
        found.append(("validate", f"published {version} unchecked by its quality gate: {quality['unmeasured']}; "
                                  "publish an exact format (e.g. --format onnx) until the holdout has samples of "
                                  "both classes, or roll back with `streamrec refresh --rollback`"))
    if problems:
        found.append(("checkpoint", f"published {version} from {Path(ckpt['path']).name}, behind newer checkpoints "
                                    "that were skipped: " + "; ".join(f"{p.name}: {why}" for p, why in problems)))
    empty = [kind for kind, budget in (("item", rs.hot_items), ("user", rs.hot_users))
             if budget and not counted.get(f"{kind}s", 0)]
    if empty:
        what = " or ".join(empty)
        found.append(("hot_set", f"published {version} with no counted {what} in its hot set: Redis under this "
                                 f"prefix holds no {what} counts for the last days (a wrong [redis] prefix, or counts "
                                 "lost on a restart: on a Redis Cluster, of the node holding that kind's counts); "
                                 "scores are right but row lookups miss the hot cache"))
    return found


def _warn_lineage_switched(alerts: RefreshAlerts, version: str, switch: dict[str, Any]) -> dict[str, Any]:
    """A publish that replaced the live version with a model of another training run (:func:`_lineage_switch`): logged,
    counted (``streamrec_refresh_lineage_switched_total``) and alerted as ``refresh_lineage_switched`` (a warning;
    labels ``stage: publish``, ``from_lineage``, ``to_lineage``, ``replaced``). The publish stands: an intended
    switch (a new model trained from scratch) is as legitimate as a mistaken one (a learner pointed at an empty
    checkpoint directory), which only an operator can tell apart; it may be a large quality drop. Returns ``switch``
    with the message, for the summary and ``last_run.json``."""
    message = (f"published {version} from lineage {switch['to']} ({switch['checkpoint']}, "
               f"{switch['samples_trained']} samples trained) over {switch['replaced']} of lineage {switch['from']} "
               f"({switch['replaced_checkpoint']}, {switch['replaced_samples_trained']} samples trained): serving now "
               "ranks with a model of another training run (a learner started afresh, e.g. pointed at an empty "
               "checkpoint_dir); check its quality, or roll back with `streamrec refresh --rollback`")
    log.warning("%s", message)
    metrics.LINEAGE_SWITCHED.inc()
    alerts.fire("publish", message, LINEAGE_RULE, severity="warning",
                labels={"from_lineage": str(switch["from"]), "to_lineage": str(switch["to"]),
                        "replaced": switch["replaced"]})
    return {**switch, "message": message}


def _warn_degraded(alerts: RefreshAlerts, found: list[tuple[str, str]]) -> list[str]:
    """Alert each warning of a published run (rule ``refresh_degraded``, severity warning, the stage as a label) and
    count it (``streamrec_refresh_degraded_total{stage}``); returns the messages for the summary. Never raises."""
    for stage, message in found:
        metrics.DEGRADED.labels(stage).inc()
        alerts.fire(stage, message, DEGRADED_RULE, severity="warning")
    return [message for _, message in found]
