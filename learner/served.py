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
(``unmatched``). At most ``max_pending`` wait (all partitions together); beyond that the oldest of the fullest
partition are taken as 0 (counted in ``forced``). The pending ones (id, time, prediction, cold flag, in arrival order
per partition) and each partition's clock are checkpoint state (``pending``, ``clock``), so an impression pending at a
checkpoint is still scored after a restart, its delayed positive matched; a state saved before them loads with none
pending (their delayed positives count as ``unmatched``, as they did). In the sharded daemon rank 0 holds every
partition's (``learner/sharded_daemon.py``), so a restore on another world size has them all on rank 0 again.

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

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from learner.checkpoint_format import state_counts
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
        self.unscored = 0  # resolved impressions whose served prediction was not finite (left out of the metrics)

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
        final = (kinds == FINAL) | ((kinds == OBSERVED) & (labels > 0.5))
        self._resolve(probs[final], labels[final], cold[final], known[final])
        wait = (kinds == OBSERVED) & (labels <= 0.5)  # a non-finite prediction too: its click is its own, not unmatched
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

    def impressions_cold(self, impression_ids: np.ndarray, kinds: np.ndarray | None, cold: np.ndarray) -> np.ndarray:
        """(B,) ``cold`` with each delayed positive's flag its impression's (pending here, or an observed row of the
        same batch), call before :meth:`record`: a click read the user's state when it came, after the user's later
        impressions, and a new user's first clicks counted warm. A click whose impression is not known keeps it."""
        late = np.flatnonzero(kinds == DELAYED_POSITIVE) if kinds is not None else np.empty(0, np.int64)
        if not late.size:
            return cold
        observed = np.flatnonzero(kinds == OBSERVED)
        in_batch = dict(zip(impression_ids[observed].tolist(), cold[observed].tolist(), strict=True))
        out = cold.copy()
        for j, i in zip(late.tolist(), impression_ids[late].tolist(), strict=True):
            part = self._where.get(i)
            c = self._pending[part][i][2] if part is not None else in_batch.get(i)
            if c is not None:
                out[j] = c
        return out

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
        """Served predictions with their final labels, ``known_ms`` the event time each label became known. A
        non-finite prediction (NaN, inf) is left out: it ranks nothing and has no logloss; counted in ``unscored``
        (the metrics left them out without a word: a model serving NaN to a third of its impressions read as sound)."""
        ok = np.isfinite(probs)
        self.unscored += int(len(ok) - ok.sum())
        probs, labels, cold, known_ms = probs[ok], labels[ok], cold[ok], known_ms[ok]
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
        out.update(pending=self.pending, forced=self.forced, unmatched=self.unmatched, unscored=self.unscored)
        return out

    def state_dict(self) -> dict[str, Any]:
        """``pending``: the partitions in the order they came (every one, empty or not: it breaks :meth:`_expire`'s
        ties), each one's count, and the impressions of all, partition after partition, in arrival order; the
        arrays only when one is pending (an empty array pickles as bytes, which safe loads refuse). ``clock``:
        ``[partition, ms]`` pairs (plain ints: a watermark of int64 max closes at one past it)."""
        rows = [(i, *v) for q in self._pending.values() for i, v in q.items()]
        pending: dict[str, Any] = {"partitions": list(self._pending), "sizes": [len(q) for q in self._pending.values()]}
        if rows:
            pending.update(ids=[r[0] for r in rows], ts=np.array([r[1] for r in rows], np.int64),
                           probs=np.array([r[2] for r in rows], np.float64), cold=np.array([r[3] for r in rows], bool))
        return {"all": self.all.state_dict(), "cold": self.cold.state_dict(), "forced": self.forced,
                "unmatched": self.unmatched, "unscored": self.unscored, "pending": pending,
                "clock": [[p, t] for p, t in self._clock.items()]}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """A state of :meth:`state_dict`; one saved before ``pending`` and ``clock`` starts with none (before
        ``unscored``: 0). A state that
        does not add up (counts against ids, an id twice) is a ValueError: a damaged checkpoint."""
        self.all.load_state_dict(d["all"])
        self.cold.load_state_dict(d["cold"])
        p = d.get("pending", {"partitions": [], "sizes": []})
        state_counts("served quality state", {"forced": d.get("forced", 0), "unmatched": d.get("unmatched", 0),
                                              "unscored": d.get("unscored", 0),
                                              **{f"pending partitions[{i}]": x for i, x in enumerate(p["partitions"])},
                                              **{f"pending sizes[{i}]": n for i, n in enumerate(p["sizes"])},
                                              **{f"clock[{i}][{j}]": x for i, pair in enumerate(d.get("clock", []))
                                                 for j, x in enumerate(pair)}})
        self.forced, self.unmatched, self.unscored = d.get("forced", 0), d.get("unmatched", 0), d.get("unscored", 0)
        parts, sizes = [int(x) for x in p["partitions"]], [int(n) for n in p["sizes"]]
        ids = [str(i) for i in p.get("ids", [])]
        cols = [np.asarray(p[k]).reshape(-1).tolist() for k in ("ts", "probs", "cold")] if ids else [[], [], []]
        if len(parts) != len(sizes) or min(sizes, default=0) < 0 or sum(sizes) != len(ids) or \
                any(len(c) != len(ids) for c in cols) or len(set(ids)) != len(ids) or len(set(parts)) != len(parts):
            raise ValueError(f"served quality state: {len(parts)} partitions, sizes {sum(sizes)} in all, {len(ids)} "
                             f"ids ({len(set(ids))} distinct), columns of {[len(c) for c in cols]}: it does not add up")
        _check_pending(cols)
        # a finite prediction outside [0, 1] made a negative histogram bin, and the batch that resolved it raised
        # (its messages struck); a non-finite one is a prediction as served, left out when resolved (:meth:`_resolve`)
        if (bad := [x for x in cols[1] if math.isfinite(x) and not 0.0 <= x <= 1.0]):
            raise ValueError(f"served quality state: pending probs hold {bad[0]!r}, not a probability in [0, 1]")
        rows = iter(zip(ids, *cols, strict=True))
        self._pending, self._where = {}, {}
        for part, n in zip(parts, sizes, strict=True):
            queue = self._pending[part] = OrderedDict()
            for _ in range(n):
                i, t, prob, c = next(rows)
                queue[i] = (int(t), float(prob), bool(c))
                self._where[i] = part
        self._clock = {int(part): int(t) for part, t in d.get("clock", [])}
        self._expire()  # (a no-op for a state this class saved: it expired all it could before)


# The pending columns' value types (tolist() of the saved int64, float64 and bool arrays: int, float and bool)
_PENDING = (("ts", (int,), "a time in integer ms"), ("probs", (int, float), "a number"), ("cold", (bool,), "a bool"))


def _check_pending(cols: list[list[Any]]) -> None:
    """A ValueError naming the pending column (``ts``, ``probs``, ``cold``) and its first value of another type:
    ``int()`` read a damaged checkpoint's ``true`` or ``"42"`` as a time, ``bool()`` its ``"false"`` as cold."""
    for (name, kinds, what), col in zip(_PENDING, cols, strict=True):
        if (bad := [x for x in col if type(x) not in kinds]):
            raise ValueError(f"served quality state: pending {name} hold {bad[0]!r:.80}, not {what}")
