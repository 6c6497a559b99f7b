"""Online calibration: Platt scaling of the model's logit, fitted on served predictions and their final labels.

A model trained online on a stream of mostly rare ids is often right in its ranking and overconfident in its
probabilities: its logits spread wider than its knowledge. Measured on the synthetic feed (300 k impressions,
CTR 0.1, most users unseen): served AUC 0.59, but NE 1.02 over the last 20% (worse than always predicting the
click rate), and the same predictions with their logits shrunk halfway toward the base rate's read NE 0.997.
The remedy is the calibration step of He et al. ("Practical Lessons from Predicting Clicks on Ads at Facebook",
ADKDD 2014) in Platt's form (Platt, "Probabilistic Outputs for Support Vector Machines", 1999): the served
probability is ``sigmoid(a * z + b)`` for the model's logit ``z``.

**What is fitted.** Pairs of a served prediction and its final label. Under ``fake_negative`` and ``es_dfm`` an
impression's ``OBSERVED`` row is predicted when it arrives, before it is learned (as served), and its label may
still change: the prediction waits until the impression is ``maturity_s`` old (event time; 300 s, ten times
the replay's median click delay) and is then paired with a 1 if its ``DELAYED_POSITIVE`` came, else a 0.
Not fitted:

* ``FINAL`` rows (``wait``, ``window``): they are predicted when they go out, up to a window after their
  impression and in an order that depends on their label (``wait``'s positives first: a fit to them on 10 k
  ML-1M ratings took ``a`` to 0 and served AUC to 0.49); under those policies the model is served as it is;
* a fresh stream's first ``maturity_s``: on a young stream the fake negatives come before their clicks and
  the model of then runs low (the synthetic feed's first tenth: 0.07 for a rate of 0.10), so a calibration
  fitted to it, a maturity later, pushed a model that had since recovered to 0.15;
* the training rows with their delayed-feedback weights: the weights come from the model's own prediction,
  so an overconfident model's weights confirm it (on the stream above such a fit kept ``a`` at 0.97 where 0.6
  was right).

Impressions wait in the batches they came in (a batch matures when its newest impression does: no per-row
Python on the learner's path but a set insert). At most ``max_pending`` wait; while that many do, newer ones
are not taken (a sample of the stream, never a pair fitted before it matured).

**The fit.** Recursive Newton with forgetting (the Laplace approximation of online Bayesian logistic
regression, as in Chapelle and Li, "An Empirical Evaluation of Thompson Sampling", NIPS 2011, Algorithm 3, here
over two parameters with a forgetting factor): per group of ``n`` matured pairs, with ``x_i = (z_i, 1)``,

    P = gamma^n H + (1 - gamma^n) H_0                                          gamma = 2 ** (-1 / half_life_rows)
    (a, b) <- argmin  sum_i logloss(sigmoid(a z_i + b), y_i) + 1/2 ((a, b) - (a, b)_old)^T P ((a, b) - (a, b)_old)
    H <- P + sum_i s_i (1 - s_i) x_i x_i^T                                     s_i = sigmoid(a z_i + b), new (a, b)

The mode is found by Newton's method damped so that no step increases it (``_mode``): a single undamped step from
the old ``(a, b)`` overshot where the rows sit in the sigmoid's flat tails (a model 10 nats off: ``b`` to -166).

``H`` starts at ``H_0``, ``prior_rows`` rows' worth of curvature around the identity ``(1, 0)``, so a fresh model
is served as it is until evidence builds up, and ``H``'s forgetting lets ``(a, b)`` follow a model that changes.
It forgets toward ``H_0``, not toward 0, so ``H`` never falls below it: rows that carry no curvature (a stretch of
one class, where the fit drives the served probability toward 0 or 1 and ``s (1 - s)`` vanishes) cannot forget it
to nothing. Forgetting toward 0, a million rows without a click (a click outage of minutes at production rates)
left ``H`` at ~1e-4; the first batch with clicks then stepped ``b`` to +1e6, which served 1.0 to every impression
from then on (``H`` near singular stayed so, and was checkpointed); at the floor a stream recovers in a few
thousand rows. In steady state the floor is ``prior_rows`` against the ~``1.44 half_life_rows`` rows the
forgetting keeps: a damping of a few percent.
``a`` stays in ``[min_scale, max_scale]`` (0.05 to 4): calibration may shrink or stretch the logits, never
invert or erase the ranking; where ``a`` is held at a bound, ``b`` takes the step that is best for that ``a``.

**Where it applies.** Calibration changes what is served, never what the model learns: the loss, its
gradients and the delayed-feedback weights all use the raw logit. ``DeepFM`` keeps ``(a, b)`` in its
``calibration`` buffer and applies it in eval mode, and the scorer (``learner/scorer.py``) applies the same
buffer, so the artifact and serving's deltas carry it with the dense weights.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch
from torch import nn

from learner.checkpoint_format import state_counts
from learner.event_clock import EventClock, FirstTime, integer_times, load_times
from stream.errors import shown
from stream.samples import DELAYED_POSITIVE, FINAL, OBSERVED

# The logits a fit reads: those of probabilities in [1e-7, 1 - 1e-7], the range learner/evaluation/calibration.py fits
# too. A row's pull on ``a`` is its residual times its logit, and a saturated row has no curvature to hold it back:
# unclipped, one confidently wrong row at 1e4 (or float16's limit, from a diverging model under AMP) took ``a`` to its
# floor, and one at bfloat16's limit put 4e42 into ``H``, freezing ``a`` for millions of rows.
MAX_FIT_LOGIT = float(np.log((1 - 1e-7) / 1e-7))  # ~16.1
MAX_NEWTON_STEPS = 30  # per group of matured pairs; a group of 256 typically takes 2-4


STATE = "calibration state (calibration)"  # how a ValueError of a checkpoint's calibration state names it


def _column(d: dict[str, Any], name: str, dtype: type) -> np.ndarray:
    """``d[name]`` (a tensor, an array or a list of numbers) as a flat array of ``dtype``, else a ValueError naming the
    field: absent or of another kind (text, a map), it raised a bare KeyError or TypeError, or was read as numbers."""
    v = d.get(name)
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu().numpy()
    try:
        arr = np.asarray(v) if isinstance(v, np.ndarray | list | tuple) else None
    except ValueError:  # (a ragged list)
        arr = None
    if arr is None or (arr.size and arr.dtype.kind not in "iuf"):
        raise ValueError(f"{STATE}: {name} is {'missing' if v is None else shown(v, 80)}, not a list of numbers: the "
                         "state is damaged or of an older streamrec; the restore uses the previous checkpoint")
    return arr.astype(dtype).reshape(-1)


def _listed(d: dict[str, Any], name: str, default: list[Any]) -> list[Any]:
    """``d[name]`` (``default`` when absent) if it is a list, else a ValueError naming the field (a text was read one
    character per item)."""
    v = d.get(name, default)
    if not isinstance(v, list | tuple):
        raise ValueError(f"{STATE}: {name} is {shown(v, 80)}, not a list: the state is damaged")
    return list(v)


def _real(d: dict[str, Any], name: str, default: float) -> float:
    """``d[name]`` (``default`` when absent) if it is a number (no bool, no text), else a ValueError naming it."""
    v = d.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int | float | np.integer | np.floating):
        raise ValueError(f"{STATE}: {name} is {shown(v, 80)}, not a number: the state is damaged")
    return float(v)


def _sigmoid(t: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(t, -40.0, 40.0)))


def _curvature(theta: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The logloss's Hessian (2, 2) at ``theta = (a, b)`` over rows ``x`` (2, n): ``sum_i s_i (1 - s_i) x_i x_i^T``."""
    s = _sigmoid(theta @ x)
    return (x * (s * (1.0 - s))) @ x.T


def identity() -> torch.Tensor:
    """``(a, b) = (1, 0)``, shape ``(2,)``: the raw logit served as it is (a model or artifact from before
    calibration, or with it turned off)."""
    return torch.tensor([1.0, 0.0])


def add_calibration(module: nn.Module) -> None:
    """Give ``module`` (``DeepFM``, the scorer) its ``calibration`` buffer, shape ``(2,)``, at the identity; a
    state written before calibration existed (it served raw logits) loads as the identity."""
    module.register_buffer("calibration", identity())
    module.register_load_state_dict_pre_hook(_identity_if_missing)


def _identity_if_missing(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    state_dict.setdefault(prefix + "calibration", identity())


def calibrated(logits: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Served logits ``a * z + b`` for raw logits ``z`` (B,) and ``params = (a, b)`` (2,)."""
    return logits * params[0] + params[1]


class OnlineCalibration:
    """Platt scaling ``sigmoid(a * z + b)`` of the logit ``z``, fitted online (module docstring)."""

    def __init__(self, half_life_rows: float = 20_000.0, prior_rows: float = 1_000.0, maturity_s: float = 300.0,
                 max_pending: int = 200_000, min_scale: float = 0.05, max_scale: float = 4.0) -> None:
        if min(half_life_rows, prior_rows, maturity_s, max_pending, min_scale) <= 0 or max_scale < min_scale:
            raise ValueError(f"OnlineCalibration needs half_life_rows, prior_rows, maturity_s, max_pending and "
                             f"min_scale > 0 and max_scale >= min_scale, got {half_life_rows}, {prior_rows}, "
                             f"{maturity_s}, {max_pending}, {min_scale}, {max_scale}")
        self.half_life_rows, self.prior_rows = half_life_rows, prior_rows
        self.min_scale, self.max_scale = min_scale, max_scale
        self.maturity_ms, self.max_pending = int(maturity_s * 1000), max_pending
        self.a, self.b = 1.0, 0.0
        # a prior of prior_rows rows at p = 0.1 (curvature 0.09 each), logits of unit spread
        self.h0 = np.eye(2) * prior_rows * 0.09
        self.h = self.h0.copy()
        self.rows = 0  # pairs fitted
        # observed impressions waiting to mature, one chunk per batch: (ids (n,) object, raw logits (n,) float64,
        # impression ts (n,) int64 ms, label when observed (n,) float64); their ids, and those clicked since
        self.chunks: deque[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = deque()
        self.waiting: set[str] = set()
        self.clicked: set[str] = set()
        self.clock = EventClock()  # event time of the emissions (ts + label_delay_ms): what matures
        self.first_times = FirstTime()  # the stream's first impression times: its warm-up is not fitted

    @property
    def now_ms(self) -> int | None:
        return self.clock.now_ms

    @property
    def first_ms(self) -> int | None:
        return self.first_times.first_ms

    @property
    def pending(self) -> int:
        """Observed impressions waiting to mature."""
        return len(self.waiting)

    def observe(self, ids: np.ndarray, kinds: np.ndarray | None, labels: np.ndarray, logits: np.ndarray,
                ts_ms: np.ndarray, label_delay_ms: np.ndarray | None) -> None:
        """A batch's held-out raw logits with what its rows say of their labels (shapes ``(B,)``; ``kinds`` None:
        all FINAL, not fitted): observed impressions are fitted when mature."""
        if kinds is None or not (kinds != FINAL).any():
            return
        ts = np.asarray(ts_ms, np.int64)
        emitted = ts if label_delay_ms is None else ts + np.asarray(label_delay_ms, np.int64)
        if len(emitted):  # a quorum of rows, never one, nor the wall clock's future (learner/event_clock.py): one
            self.clock.advance(emitted)  # row's far-future time would mature every pending impression, fitted as a 0
            self.first_times.advance(ts)  # the quorum-th smallest: one row stamped 1970 does not end the warm-up
        warm_up_end = (self.first_ms or 0) + self.maturity_ms
        take = np.flatnonzero((kinds == OBSERVED) & (ts >= warm_up_end))[:max(self.max_pending - self.pending, 0)]
        if len(take):
            chunk_ids = np.asarray(ids, object)[take].astype(str).astype(object)
            self.chunks.append((chunk_ids, np.asarray(logits, np.float64)[take], ts[take],
                                np.asarray(labels, np.float64)[take]))
            self.waiting.update(chunk_ids.tolist())
        clicks = np.asarray(ids, object)[kinds == DELAYED_POSITIVE]
        if len(clicks):  # a click whose observation matured already (or was not taken) is not kept
            self.clicked.update(i for i in map(str, clicks.tolist()) if i in self.waiting)
        self._mature()

    def _mature(self) -> None:
        cutoff = -np.inf if self.now_ms is None else self.now_ms - self.maturity_ms
        zs, ys = [], []
        while self.chunks and self.chunks[0][2].max() <= cutoff:
            chunk_ids, z, _, y = self.chunks.popleft()
            names = chunk_ids.tolist()
            came = np.fromiter((i in self.clicked for i in names), bool, len(names))
            zs.append(z)
            ys.append(np.maximum(y, came))
            self.waiting.difference_update(names)
            self.clicked.difference_update(names)
        if zs:
            self.fit(np.concatenate(zs), np.concatenate(ys))

    def fit(self, logits: np.ndarray, labels: np.ndarray) -> None:
        """One recursive Newton step on held-out raw logits and their final labels, shapes ``(n,)`` (non-finite
        logits skipped, the others read within ``MAX_FIT_LOGIT``)."""
        z, y = np.asarray(logits, np.float64), np.asarray(labels, np.float64)
        ok = np.isfinite(z)
        z, y = np.clip(z[ok], -MAX_FIT_LOGIT, MAX_FIT_LOGIT), y[ok]
        if not len(z):
            return
        x = np.stack([z, np.ones_like(z)])  # (2, n): each row's (z_i, 1)
        keep = 2.0 ** (-len(z) / self.half_life_rows)
        h_prior = self.h * keep + self.h0 * (1.0 - keep)  # forgets toward the prior (module docstring)
        theta = self._mode(np.array([self.a, self.b]), h_prior, x, y)
        self.h = h_prior + _curvature(theta, x)
        self.a, self.b = float(theta[0]), float(theta[1])
        self.rows += len(z)

    def _mode(self, theta0: np.ndarray, h_prior: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``(a, b)`` (2,) minimising the group's logloss plus the prior ``1/2 (theta - theta0)^T h_prior (theta -
        theta0)``: Newton's method, damped so that no step increases it, ``a`` kept in its bounds. One undamped step
        (what was done) overshoots where the rows sit in the sigmoid's flat tails: logits 10 nats too high, 20 k rows
        took ``b`` from 0 to -166 (every score served as 0), and smaller groups swung ``a`` from bound to bound."""

        def objective(theta: np.ndarray) -> float:
            t, d = theta @ x, theta - theta0  # (n,) fitted logits; (2,) distance from the prior's mean
            return float((np.logaddexp(0.0, t) - y * t).sum() + 0.5 * d @ h_prior @ d)

        theta, cur = theta0.copy(), objective(theta0)
        for _ in range(MAX_NEWTON_STEPS):
            grad = x @ (_sigmoid(theta @ x) - y) + h_prior @ (theta - theta0)
            h = h_prior + _curvature(theta, x)
            a = float(np.clip(theta[0] - np.linalg.solve(h, grad)[0], self.min_scale, self.max_scale))
            # b's best step for that a (the quadratic model's minimum in b given a): the joint step's own when a is
            # inside its bounds; when a is held at one, the joint step's b assumed an a beyond it (below min_scale: a
            # backwards ranking's b, which took a 22% click rate to 5% served, and lower with every fit)
            step = np.array([a - theta[0], -(grad[1] + h[1, 0] * (a - theta[0])) / h[1, 1]])
            t = 1.0
            while (new := objective(theta + t * step)) > cur:
                t *= 0.5
                if t < 1e-6:  # no step decreases it: the mode, as far as float64 tells
                    return theta
            theta = theta + t * step
            if cur - new <= 1e-9 * max(cur, 1.0):
                break
            cur = new
        return theta

    @property
    def params(self) -> torch.Tensor:
        """``(a, b)`` as the model's ``calibration`` buffer holds them, shape ``(2,)``."""
        return torch.tensor([self.a, self.b], dtype=torch.float32)

    def summary(self) -> dict[str, Any]:
        """What a run's summary shows: the served ``(a, b)``, the pairs fitted so far and those waiting to mature."""
        return {"a": self.a, "b": self.b, "pairs_fitted": self.rows, "pending": self.pending}

    def state_dict(self) -> dict[str, Any]:
        cols = list(zip(*self.chunks, strict=True)) or [[np.zeros(0, object)], [np.zeros(0)], [np.zeros(0, np.int64)],
                                                         [np.zeros(0)]]
        return {"a": self.a, "b": self.b, "h": self.h.tolist(), "rows": self.rows, "now_ms": self.now_ms,
                "clock": self.clock.state(), "first_ms": self.first_times.state(),
                "pending_ids": np.concatenate(cols[0]).tolist(),
                "pending_logits": torch.from_numpy(np.concatenate(cols[1]).astype(np.float64)),
                "pending_ts": torch.from_numpy(np.concatenate(cols[2]).astype(np.int64)),
                "pending_labels": torch.from_numpy(np.concatenate(cols[3]).astype(np.float64)),
                "pending_chunks": [len(c[0]) for c in self.chunks],
                "clicked": sorted(self.clicked)}

    @staticmethod
    def _upgraded(d: dict[str, Any]) -> dict[str, Any]:
        """``d`` in the current layout, else a ValueError naming the field. The first one (until 7085d2c, 2026-12-02)
        kept the pending pairs as ``pending``, rows ``(n, 3)`` of (logit, ts ms, label with its click already in), each
        maturing on its own: each becomes a batch of one, so it matures when it did then (its clicks are in its label:
        none is in ``clicked``). Loaded as it was, it raised a bare ``KeyError: 'pending_logits'``."""
        if "pending" not in d:
            return d
        rows = _column(d, "pending", np.float64)
        if len(rows) % 3 or any(k in d for k in ("pending_logits", "pending_ts", "pending_labels")):
            raise ValueError(f"{STATE}: pending holds {len(rows)} values, not the (n, 3) rows of the first layout, "
                             "or comes with the pending columns of the current one: the state is damaged")
        rows = rows.reshape(-1, 3)  # (n, 3): logit, ts, label
        if not np.isfinite(rows[:, 1]).all():
            raise ValueError(f"{STATE}: pending holds an impression time that is not finite: the state is damaged")
        return {**d, "pending_logits": rows[:, 0], "pending_ts": rows[:, 1].astype(np.int64),
                "pending_labels": rows[:, 2], "pending_chunks": [1] * len(rows), "clicked": []}

    @staticmethod
    def _pending_of(d: dict[str, Any], ids: np.ndarray) -> tuple[tuple[np.ndarray, ...], list[int]]:
        """The pending pairs' columns (ids, logits, ts, labels), each ``(n,)``, and the sizes of the batches they came
        in, else a ValueError naming the value: an empty batch matured on ``max()`` of no times and a column shorter
        than the ids paired logits with other rows' labels, each raising at every batch (its messages struck), a label
        outside [0, 1] or NaN fitted ``(a, b)`` to NaN, served from then on, and a time that is no integer (NaN was
        INT64_MIN through ``astype``) matured its pair at once."""
        state = STATE
        logits = _column(d, "pending_logits", np.float64)
        ts = integer_times(f"{state}: pending_ts", _column(d, "pending_ts", object))  # (read as Python numbers)
        cols = (ids, logits, ts, _column(d, "pending_labels", np.float64))
        sizes = _listed(d, "pending_chunks", [len(ids)] if len(ids) else [])
        state_counts(state, {f"pending_chunks[{i}]": n for i, n in enumerate(sizes)})
        if any(n < 1 for n in sizes) or sum(sizes) != len(ids):
            raise ValueError(f"{state}: pending_chunks {sizes[:8]}... are not batch sizes >= 1 adding up to the "
                             f"{len(ids)} pending ids")
        for name, col in zip(("logits", "ts", "labels"), cols[1:], strict=True):
            if len(col) != len(ids):
                raise ValueError(f"{state}: pending_{name} holds {len(col)} values for {len(ids)} pending ids")
        if not ((cols[3] >= 0) & (cols[3] <= 1)).all():  # (NaN too)
            raise ValueError(f"{state}: pending_labels holds {cols[3][~((cols[3] >= 0) & (cols[3] <= 1))][0]}, "
                             "not a label in [0, 1]")
        return cols, sizes

    def max_curvature(self) -> float:
        """The largest ``H[0, 0]`` fits of rows read within ``MAX_FIT_LOGIT`` can build: each row adds at most
        ``0.25 * MAX_FIT_LOGIT^2`` and forgetting holds at most ``half_life_rows / ln 2`` rows' worth plus one group
        (at most ``max_pending`` rows)."""
        return float(self.h0[0, 0] + 0.25 * MAX_FIT_LOGIT ** 2 * (self.half_life_rows / np.log(2) + self.max_pending))

    def _restored(self, a: float, b: float, h: np.ndarray | None) -> tuple[float, float, np.ndarray]:
        """``(a, b, H)`` of a saved state, or what replaces a part no fit of this code could have made: a
        non-finite ``(a, b)`` serves the identity, ``a`` is held in its bounds, and an ``H`` that is not finite,
        not positive definite or beyond :meth:`max_curvature` restarts from the prior. Such an ``H`` came from a
        checkpoint of a version without the logit clip (a bfloat16-limit logit put 4e42 there): kept, it froze
        ``a`` for good after the upgrade, since each fit moves ``(a, b)`` by ``H``'s inverse."""
        if not (np.isfinite(a) and np.isfinite(b)):
            a, b = 1.0, 0.0
        a = float(np.clip(a, self.min_scale, self.max_scale))
        if h is None:
            return a, b, self.h0.copy()
        sane = (np.isfinite(h).all() and h[0, 0] > 0 and h[1, 1] > 0 and np.linalg.det(h) > 0
                and abs(h[0, 1] - h[1, 0]) <= 1e-6 * max(abs(h[0, 1]), 1.0)
                and h[0, 0] <= self.max_curvature() and h[1, 1] <= self.max_curvature())
        return a, b, (h if sane else self.h0.copy())

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """A state of :meth:`state_dict` (or of the first layout, :meth:`_upgraded`): ``(a, b, H)`` as :meth:`_restored`
        makes them sound; pending pairs that no batch makes (:meth:`_pending_of`) and a field missing or of another type
        are a ValueError naming the field, a damaged or edited checkpoint (the restore uses the previous one)."""
        d = self._upgraded(d)
        h = _column(d, "h", np.float64) if "h" in d else None
        if h is not None and h.size != 4:
            raise ValueError(f"{STATE}: h holds {h.size} values, not the 2 x 2 curvature: the state is damaged")
        ids = np.asarray([str(i) for i in _listed(d, "pending_ids", [])], object)
        pending = any(k in d for k in ("pending_logits", "pending_ts", "pending_labels", "pending_chunks"))
        cols, sizes = self._pending_of(d, ids) if len(ids) or pending else ((), [])
        state_counts(STATE, {"rows": d.get("rows", 0)})
        self.a, self.b, self.h = self._restored(_real(d, "a", 1.0), _real(d, "b", 0.0),
                                                None if h is None else h.reshape(2, 2))
        self.rows = int(d.get("rows", 0))
        load_times(STATE, self.clock, self.first_times, d)
        self.chunks = deque()
        bounds = np.cumsum([0, *sizes])
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):  # the batches they came in: each matures whole
            self.chunks.append(tuple(c[lo:hi] for c in cols))  # type: ignore[arg-type]
        self.waiting = set(ids.tolist())
        self.clicked = {str(i) for i in _listed(d, "clicked", [])} & self.waiting
