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
``S = 0`` (no click ever comes late) gives weights of 1.

The prediction in the weights is capped at ``max_p`` (0.95). FNW's ``w-`` vanishes as ``p -> 1``: once a model
predicts 1 everywhere (one step of 256 delayed positives on the demo's ML-1M stream did it), its observed zeros
weigh ~1e-6 and nothing pulls it back (the demo's daemon served 1.000 to every impression for 15 k samples, and
its whole-run NE went above 1). Capped, an observed 0 weighs at least ``(1 - 0.95)(1 + 0.95) ~ 0.1``; the
correction is off only where the true click rate is above 0.95.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stream.samples import DELAYED_POSITIVE, FINAL


class DelayedFeedbackWeights:
    """Per-sample loss weights for a batch of kinds, labels and the model's (detached) click probabilities."""

    def __init__(self, prior_late_share: float = 0.5, prior_weight: float = 20.0, max_p: float = 0.95) -> None:
        self.prior_late_share, self.prior_weight = prior_late_share, prior_weight
        self.max_p = max_p  # the prediction in the weights is capped here (module docstring)
        self.positives = 0  # positives seen among OBSERVED and DELAYED_POSITIVE rows ...
        self.delayed = 0  # ... and how many of them came as DELAYED_POSITIVE

    @property
    def late_share(self) -> float:
        """S: the estimated share of clicks that arrive after the elapsed time."""
        return ((self.delayed + self.prior_late_share * self.prior_weight)
                / (self.positives + self.prior_weight))

    def observe(self, kinds: np.ndarray, labels: np.ndarray) -> None:
        """Count the positives of a batch (before its weights are computed: the estimate is causal)."""
        corrected = kinds != FINAL
        self.positives += int((labels[corrected] > 0.5).sum())
        self.delayed += int((kinds == DELAYED_POSITIVE).sum())

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
        return {"positives": self.positives, "delayed": self.delayed}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.positives, self.delayed = int(d.get("positives", 0)), int(d.get("delayed", 0))


class BaseRateBias:
    """A fresh model's ``bias`` starts at ``prior_rate`` and is then held, after each batch, at the logit of the
    click rate seen so far, until ``min_positives`` clicks
    make that rate a good estimate; training owns it after that.

    One batch is too few at a low click rate: at 0.4% a first batch of 256 impressions holds one click or
    none, and a bias set from it alone (floored at 0.1%) costs NE 1.09 by itself. The running rate is
    ``(clicks + 0.5) / (impressions + 1)`` over the batches so far (a ``DELAYED_POSITIVE`` is an impression
    already counted by its ``OBSERVED`` row).
    """

    def __init__(self, min_positives: int = 50, prior_rate: float = 0.05) -> None:
        self.min_positives, self.prior_rate = min_positives, prior_rate
        self.impressions = 0
        self.positives = 0

    def start(self, model: torch.nn.Module) -> None:
        """Before any label: the bias at the logit of ``prior_rate`` (a model at 0.5 would cost the first
        batch's predictions ln 2 each: NE +9% on a 100 k-impression stream at 0.4%)."""
        with torch.no_grad():
            model.get_parameter("bias").fill_(float(np.log(self.prior_rate / (1 - self.prior_rate))))

    @property
    def done(self) -> bool:
        return self.positives >= self.min_positives

    def update(self, model: torch.nn.Module, labels: np.ndarray, kinds: np.ndarray | None) -> float | None:
        """Count a batch just trained (its predictions were made before) and set the bias from the running
        rate; None once done."""
        if self.done:
            return None
        kinds = np.zeros(len(labels), np.int8) if kinds is None else kinds
        self.impressions += int((kinds != DELAYED_POSITIVE).sum())
        self.positives += int((labels > 0.5).sum())
        rate = (self.positives + 0.5) / (self.impressions + 1)
        logit = float(np.log(rate / (1 - rate)))
        with torch.no_grad():
            model.get_parameter("bias").fill_(logit)
        return logit

    def state_dict(self) -> dict[str, Any]:
        return {"impressions": self.impressions, "positives": self.positives}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.impressions, self.positives = int(d.get("impressions", 0)), int(d.get("positives", 0))
