"""Hot swap and freshness: which model answers, and how a new artifact or a learner delta reaches it.

    <root>/CURRENT (polled every poll_s)  --+
    PUBLISH <prefix>:model-updates <ver>  --+--> ModelUpdater thread --> load beside the live model
    PUBLISH <prefix>:model-deltas <seq>   --+        |                   apply the deltas it lacks
    <deltas_dir>/delta-*.pt (polled)      --+        |                   holder.live = new  (one assignment)
                                                     +--> apply newer deltas to the live model

One thread does every change, so a swap and a delta never race. A request reads ``holder.live`` once
and scores on that :class:`LiveModel` to the end: requests in flight finish on the model they started
with, and the old model is freed when the last of them drops its reference. A new artifact that fails
to load or verify (``ArtifactError``) is logged, counted and not retried for ``retry_rejected_s``; the
live model keeps serving. Pub/sub only wakes the thread early: a missed message costs one poll.
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

from learner.deltas import DeltaReader
from serving.features import FeatureEncoder
from serving.metrics import ServingMetrics
from streamrec.artifact import ArtifactError, ScoringModel, read_current

log = logging.getLogger("streamrec.serve")


def artifact_channel(prefix: str) -> str:
    return f"{prefix}:model-updates"


def delta_channel(prefix: str) -> str:
    return f"{prefix}:model-deltas"


@dataclass(frozen=True)
class LiveModel:
    model: ScoringModel
    encoder: FeatureEncoder
    source_samples: int  # samples_trained of the artifact's source checkpoint: older deltas are in it


class ModelHolder:
    """The reference requests read. Assigning ``live`` is atomic in CPython."""

    def __init__(self) -> None:
        self.live: LiveModel | None = None

    def model(self) -> ScoringModel | None:
        live = self.live
        return live.model if live is not None else None


def _source_samples(model: ScoringModel) -> int:
    value = (model.manifest.get("source") or {}).get("samples_trained")
    return int(value) if value is not None else 0


class ModelUpdater:
    """Keeps ``holder.live`` on the current artifact plus the learner's newest deltas."""

    def __init__(self, holder: ModelHolder, metrics: ServingMetrics, publish_root: Path, deltas_dir: Path | None,
                 device: str = "cpu", poll_s: float = 0.5, redis_client: redis.Redis | None = None,
                 prefix: str = "streamrec", retry_rejected_s: float = 60.0,
                 load: Callable[[Path, str], ScoringModel] = lambda p, d: ScoringModel.load(p, device=d)) -> None:
        self.holder, self.metrics = holder, metrics
        self.root = Path(publish_root)
        self.deltas = DeltaReader(deltas_dir) if deltas_dir is not None else None
        self.device, self.poll_s, self.retry_rejected_s = device, poll_s, retry_rejected_s
        self.redis, self.prefix = redis_client, prefix
        self._load = load
        self._rejected: dict[Path, float] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # check_now may be called from tests while the thread runs
        self._threads: list[threading.Thread] = []
        self.last_error: str | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self.check_now()  # load what is there before the first request, when there is something
        t = threading.Thread(target=self._loop, name="serve-updater", daemon=True)
        t.start()
        self._threads.append(t)
        if self.redis is not None:
            s = threading.Thread(target=self._subscribe, name="serve-pubsub", daemon=True)
            s.start()
            self._threads.append(s)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=5)
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
            self._maybe_swap()
            live = self.holder.live
            if live is not None:
                self._apply_deltas(live)

    def _maybe_swap(self) -> None:
        path = read_current(self.root)
        live = self.holder.live
        if path is None or (live is not None and live.model.version_dir.resolve() == path.resolve()):
            return
        rejected_at = self._rejected.get(path)
        if rejected_at is not None and time.monotonic() - rejected_at < self.retry_rejected_s:
            return
        t0 = time.monotonic()
        try:
            model = self._load(path, self.device)
        except ArtifactError as exc:
            self._rejected[path] = time.monotonic()
            self.metrics.swap_rejected.inc()
            self.last_error = str(exc)
            log.error("artifact %s rejected, %s keeps serving: %s", path.name,
                      live.model.version if live else "no model", exc)
            return
        new = LiveModel(model, FeatureEncoder(model), _source_samples(model))
        self._apply_deltas(new)  # before it answers: a swap never makes scores staler than the deltas
        self.holder.live = new
        self._rejected.pop(path, None)
        self.metrics.swaps.inc()
        if live is not None:
            self.metrics.lookups.retire(live.model)
        log.info("serving artifact %s (%s, delta %d) after %.2fs; was %s", model.version, model.format,
                 model.delta_seq, time.monotonic() - t0, live.model.version if live else "nothing")

    def _apply_deltas(self, live: LiveModel) -> None:
        if self.deltas is None:
            return
        gaps = self.deltas.gaps
        for d in self.deltas.newer(live.model.delta_seq, live.source_samples):
            try:
                live.model.apply_delta(d.rows, d.vectors, d.dense_state, d.seq)
                if d.id_maps:  # ids admitted since the artifact: rows first, then the map that points at them
                    live.model.replace_id_maps(d.id_maps)
            except (ValueError, RuntimeError) as exc:
                self.metrics.delta_errors.inc()
                self.deltas.mark_bad(d.path)
                log.error("delta %s does not fit model %s (%s); skipped", d.path.name, live.model.version, exc)
                continue
            self.metrics.deltas_applied.inc()
        if self.deltas.gaps > gaps:
            self.metrics.delta_gaps.inc(self.deltas.gaps - gaps)

    def status(self) -> dict[str, Any]:
        m = self.holder.model()
        return {"model_version": m.version if m else None, "delta_seq": m.delta_seq if m else None,
                "publish_root": str(self.root), "last_error": self.last_error}
