"""Served quality in the daemon: each impression's prediction when the learner first sees it, against the
label it ends with.

The first sample of an impression (``FINAL`` or ``OBSERVED``, ``stream/samples.py``) is predicted before the
learner trains on it: that prediction is what the model would have served, made before any of the
impression's own feedback. Under the ``fake_negative`` policy the joiner emits it at impression time, so it is
the model as it stood then; under ``es_dfm`` ``elapsed_s`` later; under ``wait`` and ``window`` when the label
is known (at the click or when the window closes), which flatters those policies by the model's progress in
between. ``streamrec evaluate --protocol delayed`` scores every impression at its own event time, for all
policies alike.

The label: a ``FINAL`` row's, an ``OBSERVED`` 1; an ``OBSERVED`` 0 waits for its ``DELAYED_POSITIVE`` (then 1)
until event time passes ``ts + window`` (then 0). At most ``max_pending`` wait; beyond that the oldest are
taken as 0 (counted in ``forced``). The pending ones are not in a checkpoint: after a restart their delayed
positives find nothing (counted in ``unmatched``).

AUC, logloss and NE (logloss over the entropy of the base rate) over everything served and over cold users'
impressions, cumulative, with a sliding window (``learner.progressive.ProgressiveMetrics``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from learner.progressive import ProgressiveMetrics
from stream.samples import DELAYED_POSITIVE, FINAL, OBSERVED


class ServedQuality:
    def __init__(self, window_ms: int, max_pending: int = 1_000_000, metrics_window: int = 100_000) -> None:
        self.window_ms, self.max_pending = window_ms, max_pending
        self.all = ProgressiveMetrics(window=metrics_window)
        self.cold = ProgressiveMetrics(window=max(1, metrics_window // 10))
        self._pending: OrderedDict[str, tuple[int, float, bool]] = OrderedDict()  # id -> (ts, prob, cold)
        self.forced = 0
        self.unmatched = 0

    def record(self, impression_ids: np.ndarray, ts: np.ndarray, kinds: np.ndarray | None, labels: np.ndarray,
               probs: np.ndarray, cold: np.ndarray | None) -> None:
        """One trained batch: its rows' predictions (made before training on them). Shapes ``(B,)``."""
        b = len(labels)
        kinds = np.zeros(b, np.int8) if kinds is None else kinds
        cold = np.zeros(b, bool) if cold is None else cold
        ok = np.isfinite(probs)
        now = int(ts.max()) if b else None
        final = ok & ((kinds == FINAL) | ((kinds == OBSERVED) & (labels > 0.5)))
        self._resolve(probs[final], labels[final], cold[final])
        wait = ok & (kinds == OBSERVED) & (labels <= 0.5)
        values = zip(ts[wait].tolist(), probs[wait].tolist(), cold[wait].tolist(), strict=True)
        self._pending.update(zip(impression_ids[wait].tolist(), values, strict=True))
        pop = self._pending.pop
        late = [pop(i, None) for i in impression_ids[kinds == DELAYED_POSITIVE].tolist()]
        self.unmatched += sum(1 for x in late if x is None)
        hit = [x for x in late if x is not None]
        if hit:
            self._resolve(np.array([x[1] for x in hit]), np.ones(len(hit)), np.array([x[2] for x in hit]))
        if now is not None:
            self.advance(now)

    def advance(self, now_ms: int) -> None:
        """Impressions whose window has closed by event time ``now_ms`` without a click are negatives."""
        expired: list[tuple[int, float, bool]] = []
        while self._pending:
            imp_id, first = next(iter(self._pending.items()))
            if first[0] + self.window_ms > now_ms and len(self._pending) <= self.max_pending:
                break
            if first[0] + self.window_ms > now_ms:
                self.forced += 1
            expired.append(self._pending.pop(imp_id))
        if expired:
            self._resolve(np.array([x[1] for x in expired]), np.zeros(len(expired)),
                          np.array([x[2] for x in expired]))

    def _resolve(self, probs: np.ndarray, labels: np.ndarray, cold: np.ndarray) -> None:
        if len(probs):
            self.all.update(probs, labels)
            if cold.any():
                self.cold.update(probs[cold], labels[cold])

    @property
    def pending(self) -> int:
        return len(self._pending)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, m in (("all", self.all), ("cold", self.cold)):
            w_auc, w_loss = m.window_metrics()
            out[name] = {"impressions": m.count, "auc": m.auc, "logloss": m.logloss, "ne": m.ne,
                         "window_auc": w_auc, "window_logloss": w_loss}
        out.update(pending=self.pending, forced=self.forced, unmatched=self.unmatched)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"all": self.all.state_dict(), "cold": self.cold.state_dict(), "forced": self.forced,
                "unmatched": self.unmatched}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.all.load_state_dict(d["all"])
        self.cold.load_state_dict(d["cold"])
        self.forced, self.unmatched = int(d.get("forced", 0)), int(d.get("unmatched", 0))
