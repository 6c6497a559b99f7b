"""What the learner measures about the samples it trains, beyond progressive AUC: cold and warm users' metrics, the
served quality, with their Prometheus gauges, checkpoint state and summary. One home for both daemons: the
single-process learner feeds it each trained batch, the distributed one (rank 0) each round's rows of every rank.

    cold_of(users, now, impressions)            before training: which rows come from a cold user (``cold_k``)
    record(ids, ts, kinds, labels, probs, ...)  after: the predictions made before learning, into the metrics

and the dynamic ids' metrics (:class:`IdMetrics`: lookups, admissions, evictions, occupancy, the bucket share, the
time to admission).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from learner.progressive import ProgressiveMetrics
from learner.row_mapper import ColdTracker, MapStats
from learner.served import ServedQuality

SERVED_AUC = Gauge("streamrec_learner_served_auc", "Window AUC of each impression's first prediction against "
                   "its final label (learner/served.py).")
SERVED_NE = Gauge("streamrec_learner_served_ne", "Window normalized entropy of the served predictions "
                  "(logloss over the base rate's entropy; >= 1 is no better than the base rate), over the same "
                  "samples as streamrec_learner_served_auc.")
SERVED_COLD_AUC = Gauge("streamrec_learner_served_cold_auc", "Window served AUC over cold users' impressions.")
COLD_AUC = Gauge("streamrec_learner_cold_auc", "Window AUC over cold users' samples (their first cold_k).")
WARM_AUC = Gauge("streamrec_learner_warm_auc", "Window AUC over warm users' samples.")
COLD_LOGLOSS = Gauge("streamrec_learner_cold_logloss", "Window logloss over cold users' samples.")
WARM_LOGLOSS = Gauge("streamrec_learner_warm_logloss", "Window logloss over warm users' samples.")
COLD_TRACKER_EVICTIONS = Counter("streamrec_learner_cold_tracker_evictions_total", "Warm users the cold tracker "
                                 "forgot to make room ([learner] cold_tracker_capacity full): each is counted cold "
                                 "again for its next cold_k impressions.")

# Dynamic ids (learner/row_mapper.py, learner/sharded_ids.py): IdMetrics publishes them for both daemons.
BUCKET_SHARE = Gauge("streamrec_learner_bucket_share", "Share of recent id lookups served by a hash bucket "
                     "(ids not admitted yet), per field.", ["field"])
ID_OCCUPANCY = Gauge("streamrec_learner_id_occupancy", "Share of a field's own rows in use.", ["field"])
ADMISSIONS = Counter("streamrec_learner_id_admissions_total", "Ids given their own row.", ["field"])
EVICTIONS = Counter("streamrec_learner_id_evictions_total", "Own rows returned to the free list.", ["field"])
# seconds to days: an id admitted within its first session, its first day, its first week, or later
TIME_TO_ADMISSION_BUCKETS = (1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 86400.0, 3 * 86400.0,
                             7 * 86400.0, 30 * 86400.0)


class AdmissionDelays:
    """``streamrec_learner_id_time_to_admission_seconds{field}``: event time (the samples' timestamps) from an id's
    first sight as a candidate to its admission to its own row (admit_after sightings); ids counted before a restore
    from a checkpoint without first-seen times are not observed. A Prometheus histogram counted with numpy (a
    cold-start burst admits thousands of ids a batch: ``Histogram.observe`` costs ~1 us each, under a lock) and
    exported through the client's collector API, the same text a ``Histogram`` with these buckets writes."""

    NAME = "streamrec_learner_id_time_to_admission_seconds"
    DOC = ("Event time (the samples' timestamps) from an id's first sight as a candidate to its admission to its own "
           "row (admit_after sightings), per field; ids counted before a restore from a checkpoint without first-seen "
           "times are not observed.")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = np.asarray(bounds, dtype=np.float64)  # (K,) upper bounds, ascending; +Inf after them
        self._lock = threading.Lock()
        self._counts: dict[str, np.ndarray] = {}  # field -> (K + 1,) int64 per bucket (not cumulated)
        self._sums: dict[str, float] = {}

    def observe(self, field: str, values: np.ndarray) -> None:
        """Each of ``values`` (N,) seconds in the first bucket whose bound it does not exceed (as ``observe``)."""
        values = np.asarray(values, dtype=np.float64)
        per_bucket = np.bincount(np.searchsorted(self.bounds, values, side="left"), minlength=len(self.bounds) + 1)
        with self._lock:
            self._counts[field] = self._counts.get(field, 0) + per_bucket
            self._sums[field] = self._sums.get(field, 0.0) + float(values.sum())

    def clear(self) -> None:
        with self._lock:
            self._counts, self._sums = {}, {}

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.NAME, self.DOC, labels=["field"])]

    def collect(self) -> list[HistogramMetricFamily]:
        fam = HistogramMetricFamily(self.NAME, self.DOC, labels=["field"])
        with self._lock:
            series = [(f, np.cumsum(c), self._sums[f]) for f, c in self._counts.items()]
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for f, cum, total in series:
            fam.add_metric([f], list(zip(les, cum.astype(float).tolist(), strict=True)), sum_value=total)
        return [fam]


TIME_TO_ADMISSION = AdmissionDelays(TIME_TO_ADMISSION_BUCKETS)
REGISTRY.register(TIME_TO_ADMISSION)
ID_LOOKUPS = Counter("streamrec_learner_id_lookups_total", "Id lookups of a dynamic field, per field (with "
                     "..._id_admissions_total: the share of lookups that admitted an id).", ["field"])

log = logging.getLogger("streamrec.train")

_PUBLISH_EVERY_S = 1.0  # window AUCs sort their window: gauges at most once a second
# NaN until their metrics have samples: a Gauge exports 0 from import, and a cold AUC of 0 next to a measured warm AUC
# fired cold_user_auc_gap (warm - cold > 0.1) on a learner that had no cold sample at all (cold_k = 0, or none yet).
# NaN compares false in every rule, and an expression over it is NaN.
_QUALITY_GAUGES = (SERVED_AUC, SERVED_NE, SERVED_COLD_AUC, COLD_AUC, WARM_AUC, COLD_LOGLOSS, WARM_LOGLOSS)


class IdMetrics:
    """The dynamic ids' metrics, one definition for both daemons: the single process feeds it each batch's
    ``MapStats``, the distributed one (rank 0) each round's counts of every rank, so the numbers mean the same on 1
    process and on N ranks. Lookups, admissions and evictions per field (counters), the time to admission of each
    admitted id (a histogram, event seconds from its first sight as a candidate), occupancy, and the bucket share:
    the share of the field's lookups answered by a hash bucket, exponentially weighted over about its last
    ``metrics_window // 10`` lookups (a batch of n lookups weighs n / that, at most 1). The bucket share is what the
    ``cold_start_share`` rule of ``monitor/default_rules.toml`` reads; the distributed daemon did not publish it, so
    that rule could never fire on N ranks.

    The bucket share is checkpoint state (:meth:`state_dict`, the checkpoint's ``id_metrics`` key, rank 0's on N
    ranks) and :meth:`load_state_dict` publishes it at once: held only in memory, a restarted learner exported no
    series until its first batch, so the monitor resolved a firing ``cold_start_share`` and fired it again a
    ``for_s`` later, a false resolution and a repeated notification for one unchanged condition. A checkpoint
    written before this state loads with none (no series until the first batch, as before)."""

    def __init__(self, metrics_window: int) -> None:
        self.span = max(1, metrics_window // 10)
        self.bucket_share: dict[str, float] = {}  # per field

    def observe(self, st: MapStats, occupancy: Mapping[str, float]) -> None:
        """One batch's (or round's) counts, and each field's occupancy after it (share of its own rows in use)."""
        for name, n in st.lookups.items():
            if n <= 0:  # no lookup is no reading of the share
                continue
            ID_LOOKUPS.labels(name).inc(n)
            share = st.bucket_lookups.get(name, 0) / n
            w = min(1.0, n / self.span)
            self.bucket_share[name] = (1 - w) * self.bucket_share.get(name, share) + w * share
            BUCKET_SHARE.labels(name).set(self.bucket_share[name])
        for name, k in st.admitted.items():
            ADMISSIONS.labels(name).inc(k)
        for name, k in st.evicted.items():
            EVICTIONS.labels(name).inc(k)
        for name, delays in st.time_to_admission.items():
            if len(delays):
                TIME_TO_ADMISSION.observe(name, delays)
        for name, o in occupancy.items():
            ID_OCCUPANCY.labels(name).set(o)

    def state_dict(self) -> dict[str, Any]:
        """The bucket share per field (plain floats: a weights-only load reads them)."""
        return {"bucket_share": dict(self.bucket_share)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """From :meth:`state_dict` (an empty or older state: no share yet), and publishes each field's share now,
        before the first batch (class docstring). A field the state lacks keeps no series."""
        shares = state.get("bucket_share", {})
        if not isinstance(shares, dict) or any(not isinstance(name, str) or isinstance(v, bool) or
                                               not isinstance(v, int | float) or not 0.0 <= v <= 1.0
                                               for name, v in shares.items()):
            raise ValueError(f'id metrics state: "bucket_share" is {str(shares)[:80]!r}, not a map of field -> share '
                             "in [0, 1]: the state is damaged")
        self.bucket_share = {name: float(v) for name, v in shares.items()}
        for name, v in self.bucket_share.items():
            BUCKET_SHARE.labels(name).set(v)


class TrainingQuality:
    """The cold and warm users' window metrics (``streamrec_learner_cold_auc`` and the rest, read by the
    ``cold_user_auc_gap`` rule) cover only the window's recent samples: those whose event time is within
    ``recent_s`` of the learner's event clock (``now_s`` of :meth:`record`), NaN (no data) while fewer than
    ``min_recent`` are (at most the window's size). The cold window holds the last ``metrics_window // 10`` cold
    samples however old: on a quiet night without new users it held the evening's, and a gap measured on them kept
    the alert firing (or resolved) for hours on a model that had trained on since. NaN neither fires nor resolves a
    rule (the monitor's no data). Event time, as the id maps' ages: a replay decides as live traffic did, and a
    learner that trains nothing (no samples at all) keeps its last reading, of the model it still has.

    The served windows (``streamrec_learner_served_auc``, ``..._served_cold_auc``) are bounded the same way, by
    :meth:`recent_metrics`, over the served samples whose label became known in the last ``recent_s``
    (``learner/served.py``): they kept the evening's served samples through a quiet night just the same. So is
    ``..._served_ne`` (:meth:`recent_ne`): cumulative since the start, after a week of good service a model gone bad
    took days to lift it to the ``served_worse_than_base_rate`` rule's 1; the cumulative NE stays in the summary.

    Which users are cold: a :class:`ColdTracker` of ``cold_capacity`` users (``[learner] cold_tracker_capacity``).
    The warm users it forgets when full are counted (``streamrec_learner_cold_tracker_evictions_total``) and the
    first time logged: each is counted cold again, its samples measured as a new user's."""

    def __init__(self, cold_k: int, metrics_window: int, attribution_window_s: float, recent_s: float,
                 min_recent: int, cold_capacity: int) -> None:
        for g in _QUALITY_GAUGES:  # no data yet (a restored state publishes its own at the first batch)
            g.set(float("nan"))
        self.cold_k = cold_k
        self.cold = ColdTracker(cold_k, cold_capacity)
        self._evictions_counted = 0  # of self.cold.evictions, in COLD_TRACKER_EVICTIONS (or before a restore)
        self._warned_full = False
        self.cold_metrics = ProgressiveMetrics(window=metrics_window // 10 or 1, timed=True)
        self.warm_metrics = ProgressiveMetrics(window=metrics_window, timed=True)
        self.recent_s, self.min_recent = recent_s, min_recent
        self.served = ServedQuality(int(attribution_window_s * 1000), metrics_window=metrics_window)
        self._cold_published = 0.0
        self._served_published = 0.0

    def cold_of(self, users: np.ndarray | None, now: float, impressions: np.ndarray | None) -> np.ndarray | None:
        """(B,) bool: the rows whose user is still cold (``ColdTracker.cold``); None without user keys."""
        if users is None:
            return None
        cold = self.cold.cold(users, now, impressions)
        forgotten = self.cold.evictions - self._evictions_counted
        if forgotten > 0:
            if not self._warned_full:  # once
                self._warned_full = True
                log.warning("the cold tracker is full ([learner] cold_tracker_capacity = %d users): it forgets the "
                            "least recently seen warm users, counted cold again for their next %d impressions "
                            "(streamrec_learner_cold_tracker_evictions_total); raise it (~217 bytes a user)",
                            self.cold.capacity, self.cold_k)
            COLD_TRACKER_EVICTIONS.inc(forgotten)
            self._evictions_counted = self.cold.evictions
        return cold

    def record(self, impression_ids: np.ndarray, ts: np.ndarray, kinds: np.ndarray | None, labels: np.ndarray,
               probs: np.ndarray, cold: np.ndarray | None, partitions: np.ndarray | None,
               label_delay_ms: np.ndarray | None, now_s: float, watermarks: Mapping[int, int] | None = None) -> None:
        """One trained batch's rows (all (B,)): ``probs`` predicted before they were learned; ``now_s`` the event
        clock after them (``learner/event_clock.py``: one far-off timestamp cannot age every sample at once);
        ``watermarks`` the joiner's per samples partition (``TensorBatch.watermarks``, ``learner/served.py``)."""
        if cold is not None:
            cold = self.served.impressions_cold(impression_ids, kinds, cold)  # a click: its impression's
            self._observe_cold(probs, labels, cold, ts, now_s)
        self.served.record(impression_ids, ts, kinds, labels, probs, cold, partitions, label_delay_ms, watermarks)
        if time.monotonic() - self._served_published >= _PUBLISH_EVERY_S:  # too few recent ones: NaN, no data
            SERVED_AUC.set(self.recent_metrics(self.served.all, now_s)[0])
            SERVED_COLD_AUC.set(self.recent_metrics(self.served.cold, now_s)[0])
            SERVED_NE.set(self.recent_ne(self.served.all, now_s))
            self._served_published = time.monotonic()

    def _observe_cold(self, probs: np.ndarray, labels: np.ndarray, cold: np.ndarray, ts: np.ndarray,
                      now_s: float) -> None:
        ok = np.isfinite(probs)
        publish = time.monotonic() - self._cold_published >= _PUBLISH_EVERY_S
        for m, sel, g_auc, g_loss in ((self.cold_metrics, cold & ok, COLD_AUC, COLD_LOGLOSS),
                                      (self.warm_metrics, ~cold & ok, WARM_AUC, WARM_LOGLOSS)):
            if sel.any():
                m.update(probs[sel], labels[sel], np.asarray(ts)[sel])
            if publish:  # too few recent samples (none yet) is no data, not an AUC of 0 (class docstring)
                w_auc, w_loss = self.recent_metrics(m, now_s)
                g_auc.set(w_auc)
                g_loss.set(w_loss)
        if publish:
            self._cold_published = time.monotonic()

    def recent_metrics(self, m: ProgressiveMetrics, now_s: float) -> tuple[float, float]:
        """(AUC, logloss) of the timed window ``m``'s samples of the last ``recent_s`` of event time before ``now_s``,
        NaN while fewer than ``min_recent`` (at most the window's size) are that recent (class docstring)."""
        return m.window_metrics((now_s - self.recent_s) * 1000.0, min(self.min_recent, m.window))

    def recent_ne(self, m: ProgressiveMetrics, now_s: float) -> float:
        """Normalized entropy of the samples :meth:`recent_metrics` measures (NaN as it is)."""
        return m.window_ne((now_s - self.recent_s) * 1000.0, min(self.min_recent, m.window))

    # -- checkpoint and summary (the single-process checkpoint's keys) -----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"cold_users": self.cold.state_dict(), "cold_metrics": self.cold_metrics.state_dict(),
                "warm_metrics": self.warm_metrics.state_dict(), "served": self.served.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """From a checkpoint's state (keys of :meth:`state_dict`; absent ones keep the fresh state)."""
        self.cold.load_state_dict(state.get("cold_users", {}))
        self._evictions_counted = self.cold.evictions  # counted by the process that saved them
        for name, m in (("cold_metrics", self.cold_metrics), ("warm_metrics", self.warm_metrics)):
            if name in state:
                m.load_state_dict(state[name])
        if "served" in state:
            self.served.load_state_dict(state["served"])

    def summary(self) -> dict[str, Any]:
        return {"cold_users": {"k": self.cold_k, "cold": self.cold_metrics.summary(),
                               "warm": self.warm_metrics.summary()},
                "served": self.served.summary()}
