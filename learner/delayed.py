"""The learner's side of delayed feedback: importance weights for the joiner's emission policies.

The joiner (``stream/joiner/engine.py``) says with each sample's ``kind`` (``stream/samples.py``) how final its
label is. ``FINAL`` samples (policies ``wait`` and ``window``) are trained as they are. ``OBSERVED`` samples and
their ``DELAYED_POSITIVE`` duplicates (policies ``fake_negative`` and ``es_dfm``) come from a biased
distribution ``q``: every clicked impression that was not clicked by the time it was observed is in it twice,
once as a 0 and once as a 1. Training with per-sample weights ``p(y|x) / q(y|x)`` makes the loss an unbiased
estimate of the loss on the true distribution ``p`` (importance sampling).

Elapsed-time sampling (ES-DFM: Yang, Li, Han, Zhang, Wu, Zhuang, Zhou, "Capturing Delayed Feedback in
Conversion Rate Prediction via Elapsed-Time Sampling", AAAI 2021, eqs. 6-9): with ``p_dp(x)`` the probability
that ``x`` is a delayed positive (clicked, but after the elapsed time),

    q(y=1 | x) = p(y=1 | x) / (1 + p_dp(x))
    q(y=0 | x) = (p(y=0 | x) + p_dp(x)) / (1 + p_dp(x))

    w+ = p(y=1|x) / q(y=1|x) = 1 + p_dp(x)
    w- = p(y=0|x) / q(y=0|x) = (1 + p_dp(x)) * p(y=0|x) / (p(y=0|x) + p_dp(x))

With no wait at all (``fake_negative``) every positive is a delayed one, ``p_dp = p(y=1|x)``, and the weights
become the fake-negative weighting of Ktena, Tejani, Theis, Myana, Dilipkumar, Huszar, Yoo, Shi, "Addressing
Delayed Feedback for Continuous Training with Neural Networks in CTR prediction", RecSys 2019 (FNW, eq. 9):
``w+ = 1 + p``, ``w- = (1 - p)(1 + p)``.

``p(y=1|x)`` is the model's own prediction, taken as a constant (no gradient through the weights), as in both
papers. ``p_dp(x)`` is where this differs from the ES-DFM paper, which learns it with an auxiliary classifier:
here ``p_dp(x) = p(y=1|x) * S``, where ``S`` is the share of clicks that come after the elapsed time, counted on
the stream itself (delayed positives over all positives, with a prior of ``prior_late_share`` worth
``prior_weight`` positives). That assumes the click delay does not depend on ``x``, which holds for the replay's
delay model and is the approximation to revisit if real delays depend on the item. ``S = 1`` is exactly FNW;
``S = 0`` (no click ever comes late) gives weights of 1. Where the ``OBSERVED`` 0s went out at once (their
``label_delay_ms`` is the elapsed time: 0 under ``fake_negative``) every click comes after its observation and ``S`` is
1 by construction, not counted: the prior (0.5, worth 20 clicks) held the first batches' weights halfway between FNW's
and none (a delayed positive at ``p = 0.5`` weighed 1.26 instead of 1.5) until hundreds of clicks had come.

The prediction in the weights is capped at ``max_p`` (0.95). FNW's ``w-`` vanishes as ``p -> 1``: once a model
predicts 1 everywhere (one step of 256 delayed positives on the demo's ML-1M stream did it), its observed zeros
weigh ~1e-6 and nothing pulls it back (the demo's daemon served 1.000 to every impression for 15 k samples, and
its whole-run NE went above 1). Capped, an observed 0 weighs at least ``(1 - 0.95)(1 + 0.95) ~ 0.1``; the
correction is off only where the true click rate is above 0.95.

A change of the ``OBSERVED`` 0s' elapsed time starts the late share's counts again, the prior taking over: counted in
``streamrec_learner_elapsed_changes_total`` and logged (a WARNING at most once a minute, with the changes since the
last one). Now and then it is a joiner restarted under another policy; changing all the time, joiners with different
policies writing one samples topic, which holds ``S`` at its prior.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from itertools import repeat
from typing import Any

import numpy as np
import torch
from prometheus_client import Counter

from learner.checkpoint_format import state_counts
from learner.event_clock import EventClock, FirstTime, load_times
from stream.samples import DELAYED_POSITIVE, FINAL, OBSERVED

log = logging.getLogger("streamrec.train")

ELAPSED_CHANGES = Counter("streamrec_learner_elapsed_changes_total", "Batches whose OBSERVED 0s waited another elapsed "
                          "time than the last ones (a joiner's [joiner] emission or elapsed_s changed, or joiners of "
                          "two policies write one samples topic): each starts the late share's counts again, per "
                          "process (a sharded learner's ranks each count their own rows).")


def observed_wait(kinds: np.ndarray, labels: np.ndarray, label_delay_ms: np.ndarray) -> int | None:
    """The elapsed time a batch's ``OBSERVED`` 0s waited (their ``label_delay_ms``, shapes ``(B,)``), the bulk's: the
    most common one (the longer of a tie), never one row's (a single stray row, taken as the max, started the late
    share's counts again twice); None without an ``OBSERVED`` 0."""
    waited = np.asarray(label_delay_ms, np.int64)[(kinds == OBSERVED) & (labels <= 0.5)]
    if not len(waited):
        return None
    values, counts = np.unique(waited, return_counts=True)
    return int(values[counts == counts.max()].max())


class DelayedFeedbackWeights:
    """Per-sample loss weights for a batch of kinds, labels and the model's (detached) click probabilities."""

    def __init__(self, prior_late_share: float = 0.5, prior_weight: float = 20.0, max_p: float = 0.95,
                 clock: Callable[[], float] = time.monotonic, log_every_s: float = 60.0) -> None:
        self.prior_late_share, self.prior_weight = prior_late_share, prior_weight
        self.max_p = max_p  # the prediction in the weights is capped here (module docstring)
        self.positives = 0  # positives seen among OBSERVED and DELAYED_POSITIVE rows ...
        self.delayed = 0  # ... and how many of them came as DELAYED_POSITIVE
        self.elapsed_ms: int | None = None  # the wait of the OBSERVED 0s (their label_delay_ms) of late; None: none
        self.unknown_elapsed = False  # the counts came from a state that did not say their elapsed time
        self.elapsed_changes = 0  # batches whose elapsed time was another than the last one's (module docstring)
        self.clock, self.log_every_s = clock, log_every_s  # the change warning: at most one per log_every_s
        self._unlogged = 0  # changes since the last warning
        self._logged_at: float | None = None

    @property
    def late_share(self) -> float:
        """S: the estimated share of clicks that arrive after the elapsed time (1 when that is 0: module docstring)."""
        if self.elapsed_ms == 0:
            return 1.0
        return ((self.delayed + self.prior_late_share * self.prior_weight)
                / (self.positives + self.prior_weight))

    def observe(self, kinds: np.ndarray, labels: np.ndarray, label_delay_ms: np.ndarray | None = None) -> None:
        """Count the positives of a batch (before its weights are computed: the estimate is causal), and the elapsed
        time of its ``OBSERVED`` 0s (:func:`observed_wait`; shapes ``(B,)``; ``label_delay_ms`` None: not read, the
        share is counted). An elapsed time other than the last one starts the counts again (the prior takes over)."""
        wait = None if label_delay_ms is None else observed_wait(kinds, labels, label_delay_ms)
        if wait is not None:
            if self.unknown_elapsed or (self.elapsed_ms is not None and wait != self.elapsed_ms):
                # Another elapsed time (a restart under another policy or elapsed_s): the share counted was of the
                # old one. Kept, a run restored from es_dfm weighed fake_negative's clicks by its S = 0.25, not 1.
                self.positives = self.delayed = 0
            if self.elapsed_ms is not None and wait != self.elapsed_ms:
                self._changed(self.elapsed_ms, wait)
            self.elapsed_ms, self.unknown_elapsed = wait, False
        corrected = kinds != FINAL
        self.positives += int((labels[corrected] > 0.5).sum())
        self.delayed += int((kinds == DELAYED_POSITIVE).sum())

    def _changed(self, old_ms: int, new_ms: int) -> None:
        """Count a change of elapsed time, and warn of it unless a warning went out in the last ``log_every_s``
        (alternating policies change it at every other batch: one line a minute, with how many since the last)."""
        self.elapsed_changes += 1
        self._unlogged += 1
        ELAPSED_CHANGES.inc()
        now = self.clock()
        if self._logged_at is not None and now - self._logged_at < self.log_every_s:
            return
        log.warning("the OBSERVED samples' elapsed time changed from %d ms to %d ms (%d change(s) since the last "
                    "warning, %d in all): the late share of delayed clicks starts again from its prior at each. A "
                    "joiner restarted under another [joiner] emission or elapsed_s? Changing all the time: joiners of "
                    "different policies write one samples topic, and S stays at its prior", old_ms, new_ms,
                    self._unlogged, self.elapsed_changes)
        self._logged_at, self._unlogged = now, 0

    def weights(self, kinds: np.ndarray, labels: torch.Tensor, probs: torch.Tensor) -> torch.Tensor | None:
        """``(B,)`` float32 weights, or None when every row is FINAL (no correction: plain mean loss)."""
        if not (kinds != FINAL).any():
            return None
        kind_t = torch.from_numpy(np.asarray(kinds, np.int64)).to(labels.device)
        p = probs.detach().float().clamp(1e-6, self.max_p)  # capped: see the module docstring
        dp = p * self.late_share  # p_dp(x)
        w_pos = 1.0 + dp
        w_neg = (1.0 + dp) * (1.0 - p) / (1.0 - p + dp)
        w = torch.where(labels > 0.5, w_pos, w_neg)
        return torch.where(kind_t == FINAL, torch.ones_like(w), w)  # (B,)

    def state_dict(self) -> dict[str, Any]:
        """The counts, and ``elapsed_ms`` once an ``OBSERVED`` 0 was seen (a state without it counts the share)."""
        elapsed = {} if self.elapsed_ms is None else {"elapsed_ms": self.elapsed_ms}
        return {"positives": self.positives, "delayed": self.delayed, **elapsed}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Counts of a state without ``elapsed_ms`` (saved before it was kept, or before any ``OBSERVED`` 0) are of an
        unknown elapsed time: the first ``OBSERVED`` 0 starts them again, as a change of elapsed time does (a
        fake_negative run's counts, every click late, held a resumed es_dfm stream's share at ~1).

        Counts that no stream counts (:func:`~learner.checkpoint_format.state_counts`) are a ValueError naming the
        value: a damaged checkpoint (the restore uses the previous one). Loaded, ``positives = -prior_weight`` divided
        by zero in :attr:`late_share` on every batch, and each batch's messages were struck for it."""
        c = {"positives": 0, "delayed": 0,
             **{k: d[k] for k in ("positives", "delayed", "elapsed_ms") if d.get(k) is not None}}
        state_counts("delayed feedback state (delayed_weights)", c)
        if c["delayed"] > c["positives"]:  # every delayed positive is one of the positives counted
            raise ValueError(f"delayed feedback state (delayed_weights): delayed {c['delayed']} > positives "
                             f"{c['positives']}: no stream counts more delayed positives than positives")
        self.positives, self.delayed = c["positives"], c["delayed"]
        self.elapsed_ms = c.get("elapsed_ms")
        self.unknown_elapsed = self.elapsed_ms is None and self.positives > 0

    @staticmethod
    def merged(states: list[dict[str, Any]]) -> dict[str, Any]:
        """The :meth:`state_dict` of counters over disjoint rows (the ranks' own rows) as one: the counts of one
        counter over all of them (the longest elapsed time of any)."""
        out = {k: sum(int(d.get(k, 0)) for d in states) for k in ("positives", "delayed")}
        waits = [int(d["elapsed_ms"]) for d in states if d.get("elapsed_ms") is not None]
        return {**out, "elapsed_ms": max(waits)} if waits else out

    @staticmethod
    def share(states: list[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
        """Rank ``rank``'s part of the :meth:`merged` counts on ``world_size`` ranks (a restore on another number of
        ranks): each count split as evenly as integers allow, so the ranks' parts sum to the merged counts exactly
        (every rank given the whole sum, N ranks' next checkpoint held N times it) and each rank's late share is the
        merged one up to rounding; the elapsed time is each rank's whole)."""
        return {k: n if k == "elapsed_ms" else n // world_size + (rank < n % world_size)
                for k, n in DelayedFeedbackWeights.merged(states).items()}


class BaseRateBias:
    """A fresh model's intercept, held at the click rate until that rate is known; training owns it after.

    **Start.** Before any label the ``bias`` is the logit of ``prior_rate`` (a model at 0.5 would cost the
    first batch's predictions ln 2 each: NE +9% on a 100 k-impression stream at 0.4%).

    **The rate, with the clicks still to come.** Under the corrected policies (``fake_negative``, ``es_dfm``) an
    impression goes out at once as an ``OBSERVED`` 0 and its click a delay later, so on a fresh stream the rows seen
    hold every impression but only the clicks that have had time to arrive: on the synthetic feed (lognormal delays
    of median 30 s) the running rate was 0.015 at its 50th click, where the truth was 0.10, and the model started
    1.9 logits low. Reading the rate only over impressions older than the delays seen does not mend it on a young
    stream: only short delays can have been seen yet. The estimate here is the delayed feedback model of Chapelle,
    "Modeling Delayed Feedback in Display Advertising" (KDD 2014), without features: an impression is clicked with
    probability ``r``, after an exponential delay of rate ``lam``; a click seen after ``d`` contributes ``r * lam *
    exp(-lam * d)`` to the likelihood, an impression of age ``a`` not clicked yet ``1 - r + r * exp(-lam * a)``.
    ``(r, lam)`` are fitted by the paper's EM (``fit_delayed_rate``) over impressions counted in one-second bins of
    impression time, with a prior of one click at ``prior_rate``, ``prior_delay_s`` (60) after its impression. Under
    the ``FINAL`` policies (``wait``, ``window``) an impression is not seen before its sample (a negative comes at
    window close), so the rate is the running one over the rows seen (biased high by ``wait``'s positives-first
    order; not mended here).

    **es_dfm's wait.** Under ``es_dfm`` an impression is seen at its click if that comes within the elapsed time
    (an ``OBSERVED`` 1), else ``elapsed`` after it (an ``OBSERVED`` 0): a second younger than ``elapsed`` holds its
    clicked impressions only. Fitted with them, the first minute of a 60 s stream at CTR 0.1 read a rate of 0.93
    (every row seen a click) and the rule ended at 0.12. So the fit reads only the seconds whose impressions are all
    out (``elapsed``, the ``OBSERVED`` 0s' ``label_delay_ms``, after the second's end; at 0, under
    ``fake_negative``, every second), with those seconds' own click delays, and nothing before an ``OBSERVED`` 0
    has said the elapsed time (the rate stays at the prior).

    **Done** once ``min_positives`` clicks are counted and (corrected policies) the stream has run
    ``mature_delays`` mean delays (``5 / lam``), so that most clicks of its early impressions have come.
    Memory: one pair of counts per second of event time, only until done; a stream that runs ``max_bins``
    seconds of event time before then ends the rule there.
    """

    def __init__(self, min_positives: int = 50, prior_rate: float = 0.05, prior_delay_s: float = 60.0,
                 mature_delays: float = 5.0, max_bins: int = 200_000) -> None:
        if not 0 < prior_rate < 1 or mature_delays <= 0:
            raise ValueError(f"BaseRateBias needs 0 < prior_rate < 1 and mature_delays > 0, got {prior_rate}, "
                             f"{mature_delays}")
        self.min_positives, self.prior_rate, self.prior_delay_s = min_positives, prior_rate, prior_delay_s
        self.mature_delays, self.max_bins = mature_delays, max_bins
        self.impressions = 0  # rows that are an impression's first (all but DELAYED_POSITIVE) ...
        self.positives = 0  # ... and clicks, over everything seen
        self.bins: dict[int, list[int]] = {}  # corrected rows: impression second -> [impressions, clicks]
        self.click_delay_s = 0.0  # the sum of the corrected clicks' delays (s)
        self.bin_delay_s: dict[int, float] = {}  # ... per impression second (es_dfm fits only the seconds all out)
        self.clock = EventClock()  # event time of the emissions seen (ts + label_delay_ms): learner/event_clock.py
        self.first_times = FirstTime()  # the stream's first corrected rows' times (learner/event_clock.py)
        self.corrected = False  # rows of a corrected policy seen: the delayed feedback model is fitted
        self.stopped = False  # max_bins reached
        self.rate = prior_rate
        self.delay_rate = 0.0  # lam (1/s); 0 before a corrected click is seen
        self.elapsed_ms: int | None = None  # the wait of the OBSERVED 0s (es_dfm's elapsed; 0: at once); None: not seen

    def start(self, model: torch.nn.Module) -> None:
        """Before any label: the bias at the logit of ``prior_rate``."""
        with torch.no_grad():
            model.get_parameter("bias").fill_(_logit(self.prior_rate))

    @property
    def now_ms(self) -> int | None:
        return self.clock.now_ms

    @property
    def first_ms(self) -> int | None:
        return self.first_times.first_ms

    @property
    def done(self) -> bool:
        if self.stopped:
            return True
        if self.positives < self.min_positives:
            return False
        if not self.corrected:
            return True
        span_s = 0.0 if self.now_ms is None or self.first_ms is None else (self.now_ms - self.first_ms) / 1000
        return self.delay_rate > 0 and span_s * self.delay_rate >= self.mature_delays

    def observe(self, labels: np.ndarray, kinds: np.ndarray | None, ts_ms: np.ndarray | None = None,
                label_delay_ms: np.ndarray | None = None) -> None:
        """Count a batch's rows and refit the rate (shapes ``(B,)``; ``kinds`` None: all FINAL; ``ts_ms`` None:
        no time known, so corrected rows are counted as the FINAL ones are)."""
        kinds = np.zeros(len(labels), np.int8) if kinds is None else kinds
        first = kinds != DELAYED_POSITIVE
        clicked = labels > 0.5
        self.impressions += int(first.sum())
        self.positives += int(clicked.sum())
        corrected = kinds != FINAL
        if ts_ms is None or not (corrected.any() or self.corrected):
            self.rate = (self.positives + 1.0) / (self.impressions + 1.0 / self.prior_rate)
            return
        self.corrected = True
        ts = np.asarray(ts_ms, np.int64)[corrected]
        delay = (np.zeros(len(ts), np.int64) if label_delay_ms is None
                 else np.maximum(np.asarray(label_delay_ms, np.int64)[corrected], 0))  # decode refuses < 0
        if len(ts):
            self.clock.advance(ts + delay)  # a quorum of rows, never one, nor ahead of the wall clock
            self.first_times.advance(ts)  # the quorum-th smallest: one row stamped 1970 does not end the warm-up
        click = clicked[corrected]
        self.click_delay_s += float(delay[click].sum()) / 1000.0
        secs = ts // 1000
        for arr, what in ((secs[first[corrected]], 0), (secs[click], 1)):
            keys, n = np.unique(arr, return_counts=True)
            for k, c in zip(keys.tolist(), n.tolist(), strict=True):
                self.bins.setdefault(k, [0, 0])[what] += c
        keys, where = np.unique(secs[click], return_inverse=True)
        for k, d in zip(keys.tolist(), np.bincount(where, delay[click] / 1000.0).tolist(), strict=True):
            self.bin_delay_s[k] = self.bin_delay_s.get(k, 0.0) + d
        if len(self.bins) > self.max_bins:
            self.stopped = True
        wait = observed_wait(kinds[corrected], labels[corrected], delay)
        self.elapsed_ms = self.elapsed_ms if wait is None else wait
        if self.now_ms is not None and self.bins and self.elapsed_ms is not None:
            counts = np.array(list(self.bins.values()), np.float64)  # (bins, 2)
            secs_f = np.fromiter(self.bins, np.float64)  # (bins,)
            delay_s = self.click_delay_s
            if self.elapsed_ms:  # es_dfm: only the seconds whose every impression is out (class docstring)
                seen = (secs_f + 1.0) * 1000.0 + self.elapsed_ms <= self.now_ms
                counts, secs_f = counts[seen], secs_f[seen]
                delays = np.fromiter(map(self.bin_delay_s.get, self.bins, repeat(0.0)), np.float64, len(seen))
                delay_s = sum(delays[seen].tolist())  # (bins,) looked up in C, summed in the seconds' order
            if not len(secs_f):
                return
            age_s = np.maximum(self.now_ms / 1000.0 - secs_f - 0.5, 0.0)
            self.rate, self.delay_rate = fit_delayed_rate(counts[:, 0], counts[:, 1], age_s, delay_s,
                                                          self.prior_rate, self.prior_delay_s,
                                                          start=(self.rate, self.delay_rate))

    def update(self, model: torch.nn.Module, labels: np.ndarray, kinds: np.ndarray | None,
               ts_ms: np.ndarray | None = None, label_delay_ms: np.ndarray | None = None) -> float | None:
        """Count a batch just trained and set the bias to the logit of the estimated rate; returns it, or None
        once done (the bias is then left to training)."""
        if self.done:
            return None
        self.observe(labels, kinds, ts_ms, label_delay_ms)
        if self.done:  # the fit is over: its per-second counts go (class docstring, Memory; done stays done)
            self.bins, self.bin_delay_s = {}, {}
        logit = _logit(self.rate)
        if not math.isfinite(logit):  # never a NaN or inf bias: it would be checkpointed and served
            return None
        with torch.no_grad():
            model.get_parameter("bias").fill_(logit)
        return logit

    def summary(self) -> dict[str, Any]:
        """What a run's summary shows: the rate the bias follows (or followed, once done) and the counts behind it."""
        return {"done": self.done, "rate": self.rate, "bias": _logit(self.rate), "impressions": self.impressions,
                "positives": self.positives}

    def state_dict(self) -> dict[str, Any]:
        """Kept in every checkpoint of a model it started, done or not: restored done, it stays done (a restart does
        not set the bias again) and the summary still shows the rate it followed. Once done, without the bins (only
        the fit reads them)."""
        return {"impressions": self.impressions, "positives": self.positives, "corrected": self.corrected,
                "now_ms": self.now_ms, "clock": self.clock.state(), "first_ms": self.first_times.state(),
                "stopped": self.stopped,
                "click_delay_s": self.click_delay_s, "rate": self.rate, "delay_rate": self.delay_rate,
                "bins": [] if self.done else [[s, c[0], c[1]] for s, c in self.bins.items()],
                "bin_delay_s": [] if self.done else [[s, d] for s, d in self.bin_delay_s.items()],
                "elapsed_ms": self.elapsed_ms}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """A state of :meth:`state_dict`. Values no stream makes (:meth:`_check_state`) are a ValueError naming the
        value: a damaged or edited checkpoint, which the restore passes over for the previous one."""
        self._check_state(d)
        load_times("base-rate bias state (base_rate_bias)", self.clock, self.first_times, d)
        self.impressions, self.positives = int(d.get("impressions", 0)), int(d.get("positives", 0))
        self.corrected, self.stopped = d.get("corrected", False), d.get("stopped", False)
        self.click_delay_s = float(d.get("click_delay_s", 0.0))
        self.rate = float(d.get("rate", (self.positives + 1.0) / (self.impressions + 1.0 / self.prior_rate)))
        self.delay_rate = float(d.get("delay_rate", 0.0))
        self.bins = {int(s): [int(i), int(c)] for s, i, c in d.get("bins", [])}
        self.bin_delay_s = {int(s): float(x) for s, x in d.get("bin_delay_s", [])}
        clicks = sum(c for _, c in self.bins.values())
        if "bin_delay_s" not in d and clicks:  # a state from before them: the delays spread over the seconds by clicks
            self.bin_delay_s = {s: self.click_delay_s * c / clicks for s, (_, c) in self.bins.items() if c}
        self.elapsed_ms = None if d.get("elapsed_ms") is None else int(d["elapsed_ms"])

    @staticmethod
    def _check_state(d: dict[str, Any]) -> None:
        """Raise a ValueError naming the first value of ``d`` no stream makes. Loaded, each broke every batch until
        training owned the bias: ``impressions = -20`` divided the running rate by zero, a ``rate`` of 1 the logit
        (each batch's messages struck), and a negative count or delay sum set the bias from a rate that is none."""
        state = "base-rate bias state (base_rate_bias)"
        bins, delays = d.get("bins", []), d.get("bin_delay_s", [])
        state_counts(state, {k: d[k] for k in ("impressions", "positives", "elapsed_ms") if d.get(k) is not None})
        state_counts(state, {f"bins[{s}][{i}]": n for s, *counts in bins for i, n in enumerate(counts)})
        for name in ("corrected", "stopped"):  # ``bool("false")`` was True: a bias stopped for good
            if not isinstance(d.get(name, False), bool):
                raise ValueError(f"{state}: {name} {str(d[name])[:80]!r} is not true or false")
        if "rate" in d and not (isinstance(d["rate"], float | int) and not isinstance(d["rate"], bool)
                                and 0.0 < d["rate"] < 1.0):  # (NaN too; a text was read as a number)
            raise ValueError(f"{state}: rate {d['rate']!r:.80} is not a click rate in (0, 1)")
        for s in [s for s, *_ in bins] + [s for s, _ in delays]:  # (int() read the text "3" as a second)
            if isinstance(s, bool) or not isinstance(s, int):
                raise ValueError(f"{state}: bins second {s!r:.80} is not an integer second")
        for name, v in [("delay_rate", d.get("delay_rate", 0.0)), ("click_delay_s", d.get("click_delay_s", 0.0)),
                        *((f"bin_delay_s[{s}]", x) for s, x in delays)]:  # (float() read "0.1" and true as numbers)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"{state}: {name} {v!r:.80} is not a finite number >= 0")


def fit_delayed_rate(impressions: np.ndarray, clicks: np.ndarray, age_s: np.ndarray, click_delay_s: float,
                     prior_rate: float, prior_delay_s: float = 60.0, start: tuple[float, float] | None = None,
                     iters: int = 500) -> tuple[float, float]:
    """``(r, lam)``: the click rate and the exponential delay rate of Chapelle's delayed feedback model (KDD
    2014, section 4) without features, fitted by its EM. Per group of impressions (shapes ``(G,)``): how many,
    how many were clicked so far, and their age; ``click_delay_s`` the sum of the seen clicks' delays.

    The prior is one pseudo-click, ``prior_delay_s`` after its impression, in ``1 / prior_rate`` impressions.
    Before any click is seen nothing tells a low rate from long delays; with the prior, a stream younger than
    ``prior_delay_s`` stays near ``prior_rate`` and an older one without clicks goes down from it.

    E-step: an impression of age ``a`` not clicked yet will be clicked with probability
    ``q = r e^{-lam a} / (1 - r + r e^{-lam a})``. M-step: ``r = (C + 1 + sum q) / (N + 1 / prior_rate)``,
    ``lam = (C + 1) / (sum of seen delays + prior_delay_s + sum q a)`` (a click to come contributes its survival
    ``e^{-lam a}``, not a delay). EM creeps where most impressions are young (each step moves ``r`` by a share
    of the distance left): ``start`` (the last fit) lets a stream's successive fits go on from there.
    """
    n_total, c_total = float(impressions.sum()), float(clicks.sum()) + 1.0  # + the prior's click
    # Delays and ages are >= 0 (SampleBatch.decode refuses negative ones); clamped all the same, since a negative
    # delay sum makes lam negative, e^{-lam a} overflow and r NaN: a fit that is not sound never leaves here.
    delays_s = max(float(click_delay_s), 0.0) + prior_delay_s
    age_s = np.maximum(np.asarray(age_s, np.float64), 0.0)
    waiting = np.maximum(impressions - clicks, 0)
    fresh = (c_total / (n_total + 1.0 / prior_rate), c_total / delays_s)
    r, lam = start if start is not None and _sound(*start) else fresh
    r = min(r, 1.0 - 1e-6)
    with np.errstate(all="ignore"):
        for _ in range(iters):
            tail = r * np.exp(-lam * age_s)  # (G,) the chance a waiting impression is clicked later
            q = waiting * tail / (1.0 - r + tail)
            r_new = min((c_total + float(q.sum())) / (n_total + 1.0 / prior_rate), 1.0 - 1e-6)
            lam_new = c_total / (delays_s + float((q * age_s).sum()))
            if not _sound(r_new, lam_new):
                break  # keep the last sound step
            converged = abs(r_new - r) < 1e-7 * r and abs(lam_new - lam) < 1e-7 * lam
            r, lam = r_new, lam_new
            if converged:
                break
    return (float(r), float(lam)) if _sound(r, lam) else fresh


def _sound(r: float, lam: float) -> bool:
    """A rate in (0, 1) and a delay rate > 0, both finite: what the bias may be set from."""
    return math.isfinite(r) and math.isfinite(lam) and 0.0 < r < 1.0 and lam > 0.0


def _logit(p: float) -> float:
    return float(np.log(p / (1 - p)))
