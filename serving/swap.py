"""Hot swap and freshness: which model answers, and how a new artifact or a learner delta reaches it.

    <root>/CURRENT (polled every poll_s)  --+
    PUBLISH <prefix>:model-updates <ver>  --+--> ModelUpdater thread --> load beside the live model
    PUBLISH <prefix>:model-deltas <seq>   --+        |                   apply the deltas it lacks
    <deltas_dir>/delta-*.delta (polled)   --+        |                   holder.live = new  (one assignment)
                                                     +--> apply newer deltas to the live model

One thread does every change, so a swap and a delta never race. A request reads ``holder.live`` once
and scores on that :class:`LiveModel` to the end: requests in flight finish on the model they started
with, and the old model is freed when the last of them drops its reference. Pub/sub only wakes the
thread early: a missed message costs one poll.

Failing closed, once:

* **Artifacts.** A ``CURRENT`` that names no valid version, or a version that fails to load for any
  reason (malformed manifest, checksum, scorer, ...), is rejected ONCE: logged as an error, counted in
  ``streamrec_serving_rejected_total{kind="artifact"}`` (and ``..._swap_rejected_total``), and remembered by
  its path and the size, mtime, ctime and inode of its files, so it is not read or hashed again at every poll;
  it is tried again only when those change (a republish, a repaired file: ctime is what a ``chmod`` changes).
  The live model keeps serving; with none yet, ``/readyz`` and ``/v1/score`` answer 503 with the reason, and the
  process stays up. One exception: a version the layered mode's embedding store lacks the rows of
  (``VersionNotStored``: no meta in Redis yet, or any more) is not the artifact's fault, and is tried again
  after 5 s, doubling up to every 300 s (``STORE_RETRY_S``, ``streamrec_serving_artifact_store_retries_total``)
  until it loads or fails for another reason, which is then a rejection like any other (not retried). Nor is a
  load that failed for want of a resource of this process (descriptors, memory: ``learner.deltas.transient``, in
  the failure's chain of causes), tried again at the same cadence (not counted as a store retry).
* **Deltas.** A damaged or malformed delta (``learner.deltas.DeltaError``) or one that does not fit the
  live model is rejected once (``streamrec_serving_rejected_total{kind="delta"}``) and skipped; the later
  ones still apply. "Later" is in ``seq`` order: deltas are absolute, so rows only the skipped delta
  carried keep their older value until a later delta touches them again or the next artifact arrives,
  and the dense weights are restored by the very next delta (each carries them whole).
  A delta whose read failed for want of a resource of this process is read again next round
  (``learner.deltas.TRANSIENT_TRIES``), and so is one whose application ran it out of memory (not a misfit): a new
  artifact waits for it (reloaded next round) rather than go live staler than the model it replaces.
* **Signatures** (``[serve] signing_key_file``, read once at start, passed here as ``signing_key``). An
  artifact whose manifest is unsigned or whose signature does not match, and a delta that is not signed
  with the key, are rejected like every bad artifact or delta (counted, remembered, the live model keeps
  serving); the artifact is refused before any file but its manifest is opened.
* **Paths.** ``CURRENT`` must hold a version name, and the version it names must resolve to a directory
  inside ``<root>/versions``; artifact files and delta files that are symlinks leaving their directory are
  refused (``learner/artifact_versions.py``, ``learner/deltas.py``).
* **Lineage.** A delta applies only if it is newer than the live artifact's source checkpoint (numbered
  past its ``delta_seq``; by ``samples_trained`` for a source that records none) and of its lineage (when
  both carry one); others are skipped and counted (``streamrec_serving_deltas_skipped_total{reason="lineage"}``).
* **Rollback.** While ``<root>/PINNED`` names the live version (``streamrec refresh --rollback``; see
  ``learner/artifact_versions.py``), no deltas are applied: they were all written by the learner that trained
  past the newer artifact, so applying them would bring the rolled-back model back.
  ``streamrec_serving_deltas_paused`` is 1 meanwhile; the next publish (an operator's ``streamrec refresh
  --now``: scheduled refreshes do not publish over a pin) clears the pin and deltas newer than that
  artifact apply again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from learner.artifact_versions import CURRENT, PIN, VERSIONS, ArtifactError, current_version, read_pin, version_path
from learner.delta_reader import DeltaReader
from learner.deltas import transient
from learner.tensorpack import SigningKey
from serving.embedding_store import VersionNotStored
from serving.features import FeatureEncoder
from serving.metrics import ServingMetrics
from serving.model import ScoringModel
from stream.files import describe_os_error

log = logging.getLogger("streamrec.serve")


def artifact_channel(prefix: str) -> str:
    return f"{prefix}:model-updates"


def delta_channel(prefix: str) -> str:
    return f"{prefix}:model-deltas"


_REMEMBER = 256  # rejected versions remembered (oldest forgotten first)
STORE_RETRY_S = (5.0, 300.0)  # a version Redis lacked the rows of: tried again after 5 s, doubling, at most 300 s


@dataclass(frozen=True)
class LiveModel:
    model: ScoringModel
    encoder: FeatureEncoder
    source_samples: int  # samples_trained of the artifact's source checkpoint: older deltas are in it
    lineage: str | None = None  # the source checkpoint's lineage: deltas of another one never apply


class ModelHolder:
    """The reference requests read. Assigning ``live`` is atomic in CPython."""

    def __init__(self) -> None:
        self.live: LiveModel | None = None
        self.problem: str | None = None  # why the current artifact is not the one answering (for /readyz)

    def model(self) -> ScoringModel | None:
        live = self.live
        return live.model if live is not None else None


def _live_model(model: ScoringModel) -> LiveModel:
    return LiveModel(model, FeatureEncoder(model), model.source_samples or 0, model.lineage)


def _stat_key(path: Path) -> tuple[Any, ...]:
    """What changes when ``path`` is rewritten or repaired: its ctime too, since a ``chmod`` that lets serving read a
    file it was refused changes nothing else."""
    try:
        st = path.stat()
    except OSError:
        return ("missing",)
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def _short_of_resources(exc: BaseException) -> bool:
    """Whether ``exc`` or any exception in its chain of causes is this process short of a resource (descriptors,
    memory: :func:`learner.deltas.transient`): the artifact loader wraps those in an ``ArtifactError`` (a file that
    "cannot be read"), which is not the artifact's fault."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if transient(cur):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def _dir_fingerprint(path: Path) -> tuple[Any, ...]:
    """What changes when a version directory or any file in it is rewritten (cheap: stat calls only)."""
    try:
        entries = sorted(path.iterdir())
    except OSError:
        return ("missing",)
    return (_stat_key(path), *((p.name, *_stat_key(p)) for p in entries))


class ModelUpdater:
    """Keeps ``holder.live`` on the current artifact plus the learner's newest deltas.

    ``signing_key`` (serving's ``signing_key_file``, loaded once): only artifacts and deltas signed with it
    are used. ``load`` replaces the artifact loader (tests); the default is ``ScoringModel.load`` with the key.
    """

    def __init__(self, holder: ModelHolder, metrics: ServingMetrics, publish_root: Path, deltas_dir: Path | None,
                 device: str = "cpu", poll_s: float = 0.5, redis_client: redis.Redis | None = None,
                 prefix: str = "streamrec", load: Callable[[Path, str], ScoringModel] | None = None,
                 signing_key: SigningKey | None = None, clock: Callable[[], float] = time.monotonic,
                 on_swap: Callable[[], None] = lambda: None) -> None:
        self.holder, self.metrics = holder, metrics
        self.on_swap = on_swap  # after each swap (serving/served_versions.py: the served version told to Redis)
        self.root = Path(publish_root)
        self.signing_key = signing_key
        self.deltas = (DeltaReader(deltas_dir, on_reject=self._delta_rejected, on_skip=self._delta_skipped,
                                   key=signing_key)
                       if deltas_dir is not None else None)
        metrics.deltas_configured.set(1.0 if self.deltas is not None else 0.0)
        self.device, self.poll_s = device, poll_s
        self.redis, self.prefix = redis_client, prefix
        self._load = load if load is not None else (
            lambda p, d: ScoringModel.load(p, device=d, signing_key=signing_key))
        self._rejected: dict[tuple[Any, ...], str] = {}  # fingerprint -> reason, insertion-ordered
        self._rejected_deltas: dict[tuple[Any, ...], None] = {}  # delta file versions counted, insertion-ordered
        # key of a load tried again later (VersionNotStored, a resource short) -> (due, tries, VersionNotStored?)
        self._store_retry: dict[tuple[Any, ...], tuple[float, int, bool]] = {}
        self._clock = clock
        self._pause_reason: str | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._read_deltas = False  # whether this check_now read the deltas already (one round of their retries)
        self._lock = threading.Lock()  # check_now may be called from tests while the thread runs
        self._threads: list[threading.Thread] = []
        self.last_error: str | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        try:
            self.check_now()  # load what is there before the first request, when there is something
        except Exception:  # noqa: BLE001 - serving starts (not ready) whatever the publish root holds
            log.exception("first model check failed; serving starts without a model and keeps polling")
        t = threading.Thread(target=self._loop, name="serve-updater", daemon=True)
        t.start()
        self._threads.append(t)
        if self.redis is not None:
            s = threading.Thread(target=self._subscribe, name="serve-pubsub", daemon=True)
            s.start()
            self._threads.append(s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the threads, waiting at most ``timeout_s`` for each. One still busy then (a long artifact load or
        delta) is left to finish on its own (a daemon thread, which may still swap its model in) and said so."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=timeout_s)
            if t.is_alive():
                log.warning("model updater thread %s still busy %.0f s after stop (a long artifact load or delta); "
                            "stopping without it", t.name, timeout_s)
        self._threads.clear()

    def wake(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.check_now()
            except Exception:  # noqa: BLE001 - the updater must outlive any one bad update
                log.exception("model update failed; the live model keeps serving")

    def _subscribe(self) -> None:
        assert self.redis is not None
        channels = (artifact_channel(self.prefix), delta_channel(self.prefix))
        while not self._stop.is_set():
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(*channels)
                try:
                    while not self._stop.is_set():
                        if pubsub.get_message(timeout=0.5) is not None:
                            self._wake.set()
                finally:
                    pubsub.close()
            except redis.RedisError as exc:
                log.warning("model update channel unavailable (%s); polling every %.1fs until it is back",
                            exc, self.poll_s)
                self._stop.wait(2.0)

    # -- one round ----------------------------------------------------------------------------------
    def check_now(self) -> None:
        """Swap in a new current artifact if there is one, then apply newer deltas. Idempotent."""
        with self._lock:
            self._read_deltas = False  # (this check's first read of the deltas begins its round)
            self._maybe_swap()
            live = self.holder.live
            if live is not None:
                self._apply_deltas(live)

    # -- rejections ------------------------------------------------------------------------------------
    def _reject(self, key: tuple[Any, ...], reason: str) -> None:
        """Count and log an artifact rejection once per ``key`` (a path and its files' fingerprint)."""
        if key in self._rejected:
            self.holder.problem = self._rejected[key]  # (again: CURRENT may have named another version meanwhile)
            return
        self._rejected[key] = reason
        while len(self._rejected) > _REMEMBER:
            self._rejected.pop(next(iter(self._rejected)))
        self.metrics.rejected.labels("artifact").inc()
        self.metrics.swap_rejected.inc()
        self.last_error = reason
        live = self.holder.live
        self.holder.problem = reason
        log.error("artifact rejected, %s keeps serving (%s): %s",
                  live.model.version if live else "no model (/readyz 503)",
                  "tried again later: not its files' fault" if key in self._store_retry
                  else "not retried until its files change", reason)

    def _reject_load(self, key: tuple[Any, ...], exc: ArtifactError, short: bool = False) -> None:
        """A version that failed to load: rejected once (:meth:`_reject`); one the embedding store lacked the rows of
        (:class:`VersionNotStored`), or whose load found this process ``short`` of descriptors or memory, is also
        tried again at a bounded cadence, since the rows may come (a refresh still writing them, Redis refilled) and
        the resources come back. A retry that fails for another reason is a rejection of its own."""
        retry = self._store_retry.pop(key, None)
        store = isinstance(exc, VersionNotStored)
        if not (store or short):
            if retry is not None:  # the rows came, something else is wrong: say it, and retry no more
                self._rejected.pop(key, None)
            self._reject(key, str(exc))
            return
        tries = retry[1] + 1 if retry is not None else 1
        delay = min(STORE_RETRY_S[0] * 2 ** (tries - 1), STORE_RETRY_S[1])
        self._store_retry[key] = (self._clock() + delay, tries, store)
        while len(self._store_retry) > _REMEMBER:
            self._store_retry.pop(next(iter(self._store_retry)))
        self._reject(key, f"{exc} (tried again in {delay:.0f}s)")
        if retry is not None:  # counted and logged as an error once; each retry that finds no rows still says so
            self._rejected[key] = self.holder.problem = f"{exc} (tried again in {delay:.0f}s)"
            log.warning("%s; tried again in %.0fs", exc, delay)

    def _store_retry_due(self, key: tuple[Any, ...]) -> bool:
        """A rejected version whose retry is due: loaded again (counted when it is a store retry)."""
        retry = self._store_retry.get(key)
        if retry is None or self._clock() < retry[0]:
            return False
        if retry[2]:
            self.metrics.artifact_store_retries.inc()
        return True

    def _delta_rejected(self, path: Path, reason: str) -> None:
        """Count and log a delta rejection once per file version (a misfit is retried after a swap, since it
        may fit the new artifact; failing again there is not counted twice)."""
        key = (str(path), *_stat_key(path))
        if key in self._rejected_deltas:
            log.info("delta %s does not fit this model either: %s", path.name, reason)
            return
        self._rejected_deltas[key] = None
        while len(self._rejected_deltas) > 16 * _REMEMBER:
            self._rejected_deltas.pop(next(iter(self._rejected_deltas)))
        self.metrics.rejected.labels("delta").inc()
        self.metrics.delta_errors.inc()
        self.last_error = reason
        log.error("delta %s rejected and skipped (the deltas after it still apply): %s", path.name, reason)

    def _delta_skipped(self, path: Path, reason: str) -> None:
        self.metrics.deltas_skipped.labels("lineage").inc()
        log.warning("delta %s skipped: %s", path.name, reason)

    # -- artifacts ---------------------------------------------------------------------------------------
    def _maybe_swap(self) -> None:
        try:
            name = current_version(self.root)
        except ArtifactError as exc:
            self._reject(("CURRENT", *_stat_key(self.root / CURRENT)), str(exc))
            return
        if name is None:
            return
        try:
            path = version_path(self.root, name)  # a version name, and no symlink out of <root>/versions
        except ArtifactError as exc:
            self._reject((str(self.root / VERSIONS / name), "outside", _dir_fingerprint(self.root / VERSIONS / name)),
                         str(exc))
            return
        live = self.holder.live
        if live is not None and live.model.version_dir.resolve() == path.resolve():
            self.holder.problem = None  # CURRENT names the model answering (again): no rejection is current
            return
        key = (str(path), _dir_fingerprint(path))
        if key in self._rejected and not self._store_retry_due(key):
            self.holder.problem = self._rejected[key]  # still what /readyz says after CURRENT named another version
            return
        try:
            is_dir = path.is_dir()  # (False for a path that is not there; an error for one serving may not stat)
        except OSError as exc:  # EACCES (versions/ without its search bit), EIO or ESTALE (NFS): out of check_now,
            # it was a traceback at every poll, nothing counted, no delta applied to the live model
            self._reject(key, f"{self.root / CURRENT} names {name}, whose directory {path} cannot be read "
                         f"({describe_os_error(exc)}); check the publish root's permissions and file system")
            return
        if not is_dir:
            self._reject(key, f"{self.root / CURRENT} names {name}, which is not in {self.root / VERSIONS}: "
                         "publish again with `streamrec refresh --now`")
            return
        t0 = time.monotonic()
        try:
            model = self._load(path, self.device)
        except Exception as exc:  # noqa: BLE001 - ArtifactError, or anything a custom loader raises: rejected once
            self._reject_load(key, exc if isinstance(exc, ArtifactError) else ArtifactError(f"{path}: {exc}"),
                              short=_short_of_resources(exc))
            return
        self._rejected.pop(key, None)  # loaded after a retry: a later swap back to it loads it at once
        self._store_retry.pop(key, None)
        new = _live_model(model)
        if self.deltas is not None:
            self.deltas.forget_unfit()  # a delta that did not fit the old model may fit this one
        held = None
        try:
            held = self._apply_deltas(new)  # before it answers: a swap never makes scores staler than the deltas
        except Exception as exc:  # noqa: BLE001 - the deltas directory failing must not keep the new artifact out
            log.error("deltas could not be applied to %s before it went live (%s); it serves without them",
                      model.version, exc)
        if self._stop.is_set():  # stopped while its deltas were applied: not caught up, it does not go live
            log.info("artifact %s not swapped in: serving is stopping", model.version)
            return
        if held is not None:  # a delta's read is retried next round (DeltaReader.retrying): not caught up either
            log.warning("artifact %s not swapped in yet: delta %s could not be read or applied now (a resource "
                        "short) and is retried next round; "
                        "the model serving keeps answering (it is not staler than the deltas)", model.version,
                        held.name)
            return
        if live is not None:  # before the swap: a scrape between the two finds the old model's lookups somewhere
            self.metrics.lookups.retire(live.model)
        self.holder.live = new
        self.holder.problem = None
        self.metrics.swaps.inc()
        self.on_swap()
        log.info("serving artifact %s (%s, delta %d) after %.2fs; was %s", model.version, model.format,
                 model.delta_seq, time.monotonic() - t0, live.model.version if live else "nothing")

    # -- deltas ------------------------------------------------------------------------------------------
    def _paused(self, live: LiveModel) -> str | None:
        """Why no deltas may be applied to ``live`` now (a rollback pin, no source sample count), or None."""
        m = live.model
        reason = None
        if m.source_samples is None:
            reason = f"artifact {m.version} does not say how far its source was trained (source.samples_trained)"
        else:
            pin = read_pin(self.root)
            if pin is not None and pin.holds(m.version):
                reason = pin.problem or (f"{m.version} is a rollback from {pin.rolled_back_from} "
                                         f"({self.root / PIN}); the learner's deltas belong to the newer model; "
                                         "they apply again after the next publish (`streamrec refresh --now`)")
        if reason != self._pause_reason:
            if reason is not None:
                log.warning("learner deltas paused: %s", reason)
            elif self._pause_reason is not None:
                log.info("learner deltas resume on %s", m.version)
            self._pause_reason = reason
        self.metrics.deltas_paused.set(1.0 if reason else 0.0)
        return reason

    def _apply_deltas(self, live: LiveModel) -> Path | None:
        """Apply the deltas ``live`` lacks; the delta a read shortage ended the round at (retried next round), or
        None."""
        if self.deltas is None or self._paused(live) is not None:
            return None
        gaps, rewinds, retries = self.deltas.gaps, self.deltas.rewinds, self.deltas.retries
        m = live.model
        after = m.delta_seq or m.source_delta_seq or 0  # a fresh model starts where its source checkpoint was
        # (a check reads them for a new artifact, then for the live model: one round of a failing read's retries)
        same_round, self._read_deltas = self._read_deltas, True
        held = None
        try:
            for d in self.deltas.newer(after, live.source_samples, live.lineage, applied_samples=m.delta_samples,
                                       same_round=same_round, applied_created=m.trained_at):
                if self._stop.is_set():  # a backlog ends at stop (each delta goes live whole: nothing half-applied)
                    break
                try:
                    m.apply_delta(d.rows, d.vectors, d.dense_state, d.seq, id_maps=d.id_maps,
                                  samples_trained=d.samples_trained, created=d.created)
                except Exception as exc:  # noqa: BLE001 - ValueError for a misfit; whatever else, never block
                    # (short of memory: applied again next round, counted in delta_retries, as a read that fails so)
                    if _short_of_resources(exc) and self.deltas.retry_apply(d.path, exc):
                        held = d.path  # (nothing later applies before it: values are absolute, in seq order)
                        break
                    self.deltas.mark_unfit(d.path)
                    self._delta_rejected(d.path, f"does not fit model {m.version}: {type(exc).__name__}: {exc}")
                    continue
                self.metrics.deltas_applied.inc()
        finally:  # what the reader counted, also when an exception ends the round: the next one starts from its
            # totals, so a count left out here was lost for good
            if self.deltas.gaps > gaps:
                self.metrics.delta_gaps.inc(self.deltas.gaps - gaps)
            if self.deltas.rewinds > rewinds:
                self.metrics.delta_rewinds.inc(self.deltas.rewinds - rewinds)
            if self.deltas.retries > retries:
                self.metrics.delta_retries.inc(self.deltas.retries - retries)
        return held or self.deltas.retrying

    def status(self) -> dict[str, Any]:
        m = self.holder.model()
        return {"model_version": m.version if m else None, "delta_seq": m.delta_seq if m else None,
                "publish_root": str(self.root), "last_error": self.last_error, "deltas_paused": self._pause_reason}
