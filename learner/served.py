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
until its window has closed on the joiner's side (then 0). The joiner says when: every samples message carries
the watermark of the join partition it comes from (samples partition p is join partition p) after the batch that
made it (``stream/samples.py``, ``WATERMARK_HEADER``; the earlier messages of a batch carry the watermark before
it), passed here per partition by ``record(watermarks=...)``. The engine closes an impression when ``ts + window
<= watermark`` and takes a click on a closed impression as late (``stream/joiner/engine.py``), so once a message
says so, the impression's delayed positive, if it has one, came in that message or an earlier one of its
partition. Nothing the daemon sees itself is that exact: the engine joins a batch's events in event time, takes
clicks out of order within ``allowed_lateness``, and its watermark is a quorum that ignores one far-ahead event. The
newest click time delivered (the *click clock*, this module's rule before the header) closed a window at 0 ms by a
click at 1300 ms while the engine still joined the impression's own click at 900 ms, a batch later (lateness 500
ms); and one impression an hour ahead, with its click, served every pending impression of its partition as a 0.
Messages without the header (a joiner from before it) still close windows by their partition's
click clock: the newest ``ts + label_delay_ms`` of a positive delivered, passed (not reached: the window is
inclusive). The rows' own event time is neither: reading a backlog, the joiner can put out a whole fetched batch of
impressions (days of MovieLens' sparse years) before the clicks of the impressions just before it, and a clock of
the newest impression time took 56,578 of the demo's delayed positives for negatives before they arrived
(``unmatched``). At most ``max_pending`` wait; beyond that the oldest are taken as 0 (counted in ``forced``).
The pending ones are not in a checkpoint: after a restart their delayed positives find nothing (counted in
``unmatched``).

AUC, logloss and NE (logloss over the entropy of the base rate) over everything served and over cold users'
impressions, cumulative, with a sliding window (``learner.progressive.ProgressiveMetrics``). The windows are timed
(``timed=True``, as the learner's cold and warm ones): each served sample carries the event time its label became
known, its click (``ts + label_delay_ms`` of the row that brought the label: a ``FINAL`` row's, an ``OBSERVED`` 1's,
a ``DELAYED_POSITIVE``'s) or the close of its window (``ts`` + the attribution window, for a negative that waited,
also one ``forced``), so ``learner/quality.py`` publishes only the samples resolved in the last ``[learner]
quality_recent_s``. Not the impression's own time: a negative resolves an attribution window after it was served,
and with ``quality_recent_s`` at most that window (a day's window) the recent part of the window would hold
positives only. The times are checkpoint state (``window_ts``; a state saved before them loads as never recent).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from learner.progressive import ProgressiveMetrics
from stream.samples import DELAYED_POSITIVE, FINAL, OBSERVED


class ServedQuality:
    def __init__(self, window_ms: int, max_pending: int = 1_000_000, metrics_window: int = 100_000) -> None:
        self.window_ms, self.max_pending = window_ms, max_pending
        self.all = ProgressiveMetrics(window=metrics_window, timed=True)
        self.cold = ProgressiveMetrics(window=max(1, metrics_window // 10), timed=True)
        # partition -> impression id -> (ts, prob, cold), in arrival order (the joiner's impression order)
        self._pending: dict[int, OrderedDict[str, tuple[int, float, bool]]] = {}
        self._where: dict[str, int] = {}  # pending impression id -> its partition
        self._clock: dict[int, int] = {}  # partition -> windows closed where ts + window < this (ms)
        self.forced = 0
        self.unmatched = 0

    def record(self, impression_ids: np.ndarray, ts: np.ndarray, kinds: np.ndarray | None, labels: np.ndarray,
               probs: np.ndarray, cold: np.ndarray | None, partitions: np.ndarray | None = None,
               label_delay_ms: np.ndarray | None = None, watermarks: Mapping[int, int] | None = None) -> None:
        """One trained batch: its rows' predictions (made before training on them), the samples partition each
        row came from (None: one partition) and its ``label_delay_ms`` (None: 0). Shapes ``(B,)``. ``watermarks``:
        samples partition -> the newest joiner watermark its messages in the batch carry (all of each message's
        rows are in the batch); a partition without one in this batch goes by its click clock."""
        b = len(labels)
        kinds = np.zeros(b, np.int8) if kinds is None else kinds
        cold = np.zeros(b, bool) if cold is None else cold
        parts = np.zeros(b, np.int64) if partitions is None else np.asarray(partitions, np.int64)
        known = np.asarray(ts, np.int64) + (0 if label_delay_ms is None else np.asarray(label_delay_ms, np.int64))
        ok = np.isfinite(probs)
        final = ok & ((kinds == FINAL) | ((kinds == OBSERVED) & (labels > 0.5)))
        self._resolve(probs[final], labels[final], cold[final], known[final])
        wait = ok & (kinds == OBSERVED) & (labels <= 0.5)
        for i, t, prob, c, part in zip(impression_ids[wait].tolist(), ts[wait].tolist(), probs[wait].tolist(),
                                       cold[wait].tolist(), parts[wait].tolist(), strict=True):
            if i in self._where:  # the same id again (past the daemon's dedup window, or on another partition):
                continue  # the first prediction is the one served; a second entry left one queue without its id
            self._pending.setdefault(part, OrderedDict())[i] = (t, prob, c)
            self._where[i] = part
        hit: list[tuple[float, bool, int]] = []  # (prob served, cold, click time)
        late = kinds == DELAYED_POSITIVE
        for i, click in zip(impression_ids[late].tolist(), known[late].tolist(), strict=True):
            part = self._where.pop(i, None)
            if part is None:
                self.unmatched += 1
            else:
                _, prob, c = self._pending[part].pop(i)
                hit.append((prob, c, click))
        if hit:
            self._resolve(np.array([x[0] for x in hit]), np.ones(len(hit)), np.array([x[1] for x in hit]),
                          np.array([x[2] for x in hit]))
        # click clocks: the partitions whose messages here carry no watermark (an older joiner's), in this batch: a
        # partition marked for good took no click clock after a rollback to such a joiner, and never closed again
        clicked = (labels > 0.5) & ~np.isin(parts, list(watermarks or ()))
        click_ms, click_parts = known[clicked], parts[clicked]
        newest = {p: int(click_ms[click_parts == p].max()) for p in np.unique(click_parts).tolist()}
        newest.update({p: wm + 1 for p, wm in (watermarks or {}).items()})  # closes ts + window <= wm, as the engine
        for part, t in newest.items():
            self._clock[part] = max(self._clock.get(part, t), t)
        self._expire()

    def advance(self, now_ms: int) -> None:
        """Every partition's window has closed up to event time ``now_ms`` (the end of a stream, a test)."""
        for part in self._pending:  # no click at or before now_ms can still come: a clock just past it
            self._clock[part] = max(self._clock.get(part, now_ms + 1), now_ms + 1)
        self._expire()

    def _expire(self) -> None:
        """Pending impressions whose window closed by their partition's click clock are negatives; past
        ``max_pending``, the oldest of the fullest partition go too (``forced``)."""
        expired: list[tuple[int, float, bool]] = []
        for part, queue in self._pending.items():
            clock = self._clock.get(part)
            while queue and clock is not None:
                imp_id, first = next(iter(queue.items()))
                if first[0] + self.window_ms >= clock:  # a click at ts + window still joins (the joiner's window is
                    break  # inclusive, stream/joiner/engine.py), and another click of that ms may come before it
                expired.append(queue.pop(imp_id))
                del self._where[imp_id]
        while len(self._where) > self.max_pending:
            queue = max(self._pending.values(), key=len)
            imp_id, first = queue.popitem(last=False)
            del self._where[imp_id]
            self.forced += 1
            expired.append(first)
        if expired:  # known at the close of their window
            self._resolve(np.array([x[1] for x in expired]), np.zeros(len(expired)),
                          np.array([x[2] for x in expired]), np.array([x[0] + self.window_ms for x in expired]))

    def _resolve(self, probs: np.ndarray, labels: np.ndarray, cold: np.ndarray, known_ms: np.ndarray) -> None:
        """Served predictions with their final labels, ``known_ms`` the event time each label became known."""
        if len(probs):
            self.all.update(probs, labels, known_ms)
            if cold.any():
                self.cold.update(probs[cold], labels[cold], known_ms[cold])

    @property
    def pending(self) -> int:
        return len(self._where)

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
