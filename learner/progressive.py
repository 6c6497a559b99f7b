"""Progressive validation (test-then-train) metrics: AUC and logloss, cumulative and windowed.

Every prediction is recorded *before* the model learns from its sample (river's
``progressive_val_score``). Cumulative AUC uses a fixed histogram of predicted probabilities
(``bins`` buckets; error well below 1e-3 at 10 k bins) so memory stays constant over an endless
stream; the sliding-window AUC over the last ``window`` samples is exact.

The state (:meth:`ProgressiveMetrics.state_dict`, in every checkpoint) holds the histogram, the loss sum
and the window's last ``window`` samples (two float64 arrays, ``window_probs``/``window_labels``, left out
while the window is empty), so a resumed learner's window metrics cover the samples before the restart too.
A state without them (also one saved before they were kept) loads with an empty window, which then fills
from the resume on.

A timed window (``timed=True``: the learner's cold, warm and served windows, ``learner/quality.py``) also keeps each
sample's event time (``window_ts``, ms; state key of the same name), and :meth:`ProgressiveMetrics.window_metrics`
can be asked for the window's samples since an event time, NaN (no data) when fewer than ``min_samples`` are that
recent: a window of old samples is not a reading of the model as it is now. A timed state without ``window_ts``
(saved before the times were kept) loads its samples with unknown times, never recent.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

_EPS = 1e-7


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Exact ROC AUC with ties averaged (rank formulation); nan without both classes."""
    labels = labels.astype(bool)
    n_pos = int(labels.sum())
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s), np.float64)
    # average ranks over ties
    boundaries = np.flatnonzero(np.diff(s)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [len(s)]])
    avg = (starts + ends + 1) / 2.0  # 1-based average rank of each tie group
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def logloss(probs: np.ndarray, labels: np.ndarray) -> float:
    p = np.clip(probs, _EPS, 1 - _EPS)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def entropy(rate: float) -> float:
    """Logloss of always predicting ``rate`` on labels whose base rate it is; nan outside (0, 1)."""
    if not 0 < rate < 1:
        return float("nan")
    return float(-(rate * np.log(rate) + (1 - rate) * np.log(1 - rate)))


def normalized_entropy(probs: np.ndarray, labels: np.ndarray) -> float:
    """Logloss over the entropy of the labels' base rate (He et al., ADKDD 2014): below 1 beats predicting the
    base rate; nan without both classes."""
    labels = np.asarray(labels, np.float64)
    return logloss(probs, labels) / entropy(float(labels.mean())) if len(labels) else float("nan")


class ProgressiveMetrics:
    def __init__(self, window: int = 100_000, bins: int = 10_000, timed: bool = False) -> None:
        self.bins = bins
        self.timed = timed  # the window keeps each sample's event time (module docstring)
        self.pos = np.zeros(bins, np.int64)
        self.neg = np.zeros(bins, np.int64)
        self.loss_sum = 0.0
        self.count = 0
        self.window = window
        self._recent: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self._recent_ts: deque[np.ndarray] = deque()  # (B,) event times (ms) of each _recent chunk, when timed
        self._recent_n = 0

    def update(self, probs: np.ndarray, labels: np.ndarray, ts_ms: np.ndarray | None = None) -> None:
        """Record predictions made before training on these samples. Shapes (B,); ``ts_ms`` (the samples' event
        times) is required by a timed window and ignored by another."""
        probs = np.asarray(probs, np.float64)
        labels = np.asarray(labels, np.float64)
        if self.timed:
            if ts_ms is None or len(ts_ms) != len(labels):
                raise ValueError(f"a timed window needs one event time per sample: {len(labels)} samples, "
                                 f"{None if ts_ms is None else len(ts_ms)} times")
            self._recent_ts.append(np.asarray(ts_ms, np.float64))
        idx = np.minimum((probs * self.bins).astype(np.int64), self.bins - 1)
        self.pos += np.bincount(idx[labels > 0.5], minlength=self.bins)
        self.neg += np.bincount(idx[labels <= 0.5], minlength=self.bins)
        p = np.clip(probs, _EPS, 1 - _EPS)
        self.loss_sum += float(-(labels * np.log(p) + (1 - labels) * np.log(1 - p)).sum())
        self.count += len(labels)
        self._recent.append((probs, labels))
        self._recent_n += len(labels)
        while self._recent and self._recent_n - len(self._recent[0][1]) >= self.window:
            self._recent_n -= len(self._recent.popleft()[1])
            if self.timed:
                self._recent_ts.popleft()

    @property
    def auc(self) -> float:
        """Cumulative AUC from the histogram: P(score_pos > score_neg) + 0.5 P(same bin)."""
        n_pos, n_neg = self.pos.sum(), self.neg.sum()
        if n_pos == 0 or n_neg == 0:
            return float("nan")
        neg_below = np.cumsum(self.neg) - self.neg
        return float(((self.pos * neg_below).sum() + 0.5 * (self.pos * self.neg).sum()) / (n_pos * n_neg))

    @property
    def logloss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")

    @property
    def ne(self) -> float:
        """Normalized entropy of everything recorded (:func:`normalized_entropy`)."""
        return self.logloss / entropy(float(self.pos.sum()) / self.count) if self.count else float("nan")

    def window_metrics(self, since_ms: float | None = None, min_samples: int = 1) -> tuple[float, float]:
        """(AUC, logloss) of the window; NaN for an empty one. ``since_ms`` (a timed window only): of its samples
        whose event time is at least that, NaN when fewer than ``min_samples``."""
        got = self._window_since(since_ms, min_samples)
        return (auc(*got), logloss(*got)) if got else (float("nan"), float("nan"))

    def window_ne(self, since_ms: float | None = None, min_samples: int = 1) -> float:
        """Normalized entropy of the same samples as :meth:`window_metrics` (NaN as it is, and without both
        classes): the cumulative :attr:`ne` of a long run barely moves when the model goes bad."""
        got = self._window_since(since_ms, min_samples)
        return normalized_entropy(*got) if got else float("nan")

    def _window_since(self, since_ms: float | None, min_samples: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(probs, labels) of the window's samples with event time >= ``since_ms`` (all of them for None); None for
        an empty window or fewer than ``min_samples`` recent ones."""
        if not self._recent:
            return None
        probs, labels = self._window_arrays()
        if since_ms is not None:
            if not self.timed:
                raise ValueError("window_metrics(since_ms=...) needs a timed window (ProgressiveMetrics(timed=True))")
            recent = self._window_ts() >= since_ms
            if int(recent.sum()) < max(1, min_samples):
                return None
            probs, labels = probs[recent], labels[recent]
        return probs, labels

    def summary(self) -> dict[str, Any]:
        w_auc, w_loss = self.window_metrics()
        return {"samples": self.count, "auc": self.auc, "logloss": self.logloss,
                "window": self.window, "window_auc": w_auc, "window_logloss": w_loss}

    def _window_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(probs, labels) of the last ``window`` samples, oldest first (float64, copies)."""
        if not self._recent:
            return np.zeros(0, np.float64), np.zeros(0, np.float64)
        probs = np.concatenate([p for p, _ in self._recent])[-self.window:]
        labels = np.concatenate([lab for _, lab in self._recent])[-self.window:]
        return probs, labels

    def _window_ts(self) -> np.ndarray:
        """(n,) event times (ms) of the samples of :meth:`_window_arrays` (a timed window), oldest first."""
        if not self._recent_ts:
            return np.zeros(0, np.float64)
        return np.concatenate(list(self._recent_ts))[-self.window:]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"pos": self.pos.copy(), "neg": self.neg.copy(), "loss_sum": self.loss_sum,
                                 "count": self.count}
        probs, labels = self._window_arrays()
        if len(probs):  # an empty window is left out: an empty array pickles as bytes(), which safe loads refuse
            state["window_probs"], state["window_labels"] = probs, labels
            if self.timed:
                state["window_ts"] = self._window_ts()
        return state

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """A ValueError naming the value when the histogram or sums are none that :meth:`update` makes (a damaged
        or edited checkpoint: the restore uses the previous one). A histogram of another length than ``bins`` was
        loaded, and every later batch's update raised (numpy cannot add ``bins`` counts to it): each batch's
        messages were struck for a fault of the checkpoint."""
        pos, neg = np.asarray(d["pos"]), np.asarray(d["neg"])
        for name, h in (("pos", pos), ("neg", neg)):
            if h.shape != (self.bins,) or h.dtype.kind not in "iu" or (h < 0).any():
                raise ValueError(f"progressive metrics state: {name} is a {h.dtype} histogram of shape {h.shape}"
                                 f"{' with negative counts' if h.dtype.kind in 'iuf' and (h < 0).any() else ''}, "
                                 f"not {self.bins} counts >= 0: the state is damaged")
        loss_sum, count = float(d["loss_sum"]), d["count"]
        if not (np.isfinite(loss_sum) and loss_sum >= 0 and isinstance(count, int | np.integer)
                and not isinstance(count, bool) and count >= 0):  # (a bool is an int: ``true`` was 1 sample)
            raise ValueError(f"progressive metrics state: loss_sum {loss_sum!r}, count {count!r}: not a finite sum "
                             ">= 0 and an integer count >= 0: the state is damaged")
        self.pos, self.neg = pos.astype(np.int64), neg.astype(np.int64)
        self.loss_sum, self.count = loss_sum, int(count)
        self._recent, self._recent_ts, self._recent_n = deque(), deque(), 0
        if "window_probs" in d:  # older states have no window: it starts empty
            probs = np.array(d["window_probs"], np.float64).reshape(-1)
            labels = np.array(d["window_labels"], np.float64).reshape(-1)
            if len(probs) != len(labels):
                raise ValueError(f"progressive metrics state: window_probs has {len(probs)} samples, "
                                 f"window_labels {len(labels)}")
            # a timed window from a state without times: unknown event times, never recent (module docstring)
            ts = (np.array(d["window_ts"], np.float64).reshape(-1) if "window_ts" in d
                  else np.full(len(probs), -np.inf))
            if len(ts) != len(probs):
                raise ValueError(f"progressive metrics state: window_probs has {len(probs)} samples, "
                                 f"window_ts {len(ts)}")
            probs, labels = probs[-self.window:], labels[-self.window:]  # a smaller window now: its last samples
            if len(probs):
                self._recent.append((probs, labels))
                self._recent_n = len(probs)
                if self.timed:
                    self._recent_ts.append(ts[-self.window:])
