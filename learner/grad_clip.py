"""Adaptive clipping of the dense gradient: one outlier batch must not freeze Adam for thousands of steps.

A dense feature value that is finite but far out of scale (1e18 passes every bound the samples decode keeps: it
rounds to a float32) makes the dense gradient of its batch ~1e18 times the usual one. Adam's step is bounded by its
learning rate whatever the gradient, but its second moment ``v`` takes the outlier's square and decays by
``beta2 = 0.999`` per step: with a normal ``v`` near 1e-4 and the outlier's near 1e31, ``ln(1e35) / 0.001`` ~ 80 k
steps pass before the model's dense part learns at its normal rate again. Nothing fails, the loss looks fine; the
model silently stops adapting.

The threshold follows AutoClip (P. Seetharaman, G. Wichern, B. Pardo, J. Le Roux, "AutoClip: Adaptive Gradient
Clipping for Source Separation Networks", IEEE MLSP 2020, arXiv:2007.14469): the gradient's total L2 norm is clipped
to a quantile of the history of the norms seen during training, so no absolute threshold has to be chosen for a
model and a feature scale nobody knows ahead. AutoClip uses a low quantile (the 10th percentile) as a regulariser;
here the aim is outlier protection that leaves normal steps alone, so the threshold is ``factor`` x the median of
the last ``history`` steps (``[learner] dense_grad_clip``, 10 by default; 0 turns it off), and the history records
each norm after clipping, so a run of outliers cannot raise its own threshold faster than ``factor`` per
``history / 2`` steps (a real shift of the gradients' scale is followed at that pace). Before ``min_history``
norms have been seen nothing is clipped; the history is checkpointed, so a restart does not reopen that window.

Typical figures (bench/learner.py's workload, 200 steps on the CPU): median norm 0.011, 99th percentile 0.058, the
largest 0.35 (the first step), so a factor of 10 leaves normal steps alone.

What it bounds and what not (tests/unit/learner/test_grad_clip.py, a 1e18 price after 60 normal batches): the
largest second moment stays below the threshold's square (a normal batch's scale), where it rose 1e35-fold
without. The clip is of the total norm, though, and the outlier's gradient concentrates on the few weights of its
column and of the units it drives: those weights' second moments still rose up to ~460-fold (back within 4x of
their scale after ~4.7 k steps, against ~80 k unclipped). A per-weight bound (each gradient element against its
own second moment) would close that; not done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from learner.checkpoint_format import state_counts


class AdaptiveClip:
    """The clipping threshold of the dense gradient's total norm, from the norms of the last ``history`` steps."""

    def __init__(self, factor: float = 10.0, history: int = 1000, min_history: int = 20) -> None:
        if not factor >= 0 or factor == float("inf"):
            raise ValueError(f"factor must be a finite number >= 0 (0: off), got {factor!r}")
        self.factor = float(factor)
        self.min_history = min_history
        self._norms = np.zeros(history, np.float64)  # a ring: the last ``history`` norms as applied
        self._count = 0  # norms recorded so far (the ring holds min(count, history) of them)
        self.clipped = 0  # steps whose dense gradient was scaled down

    @property
    def threshold(self) -> float | None:
        """The norm above which the next gradient is scaled down; None while off or still learning the scale."""
        n = min(self._count, len(self._norms))
        if self.factor == 0 or n < self.min_history:
            return None
        return self.factor * float(np.median(self._norms[:n]))  # ~15 us for 1,000

    def clip_(self, grads: Sequence[torch.Tensor], total: float) -> float:
        """Scale ``grads`` in place to the threshold when their total L2 norm ``total`` (finite) is above it, record
        the norm as applied and return the factor used (1.0: left alone)."""
        limit = self.threshold
        scale = 1.0
        if limit is not None and total > limit > 0:
            scale = limit / total
            torch._foreach_mul_(list(grads), scale)
            self.clipped += 1
        if self.factor:
            self._norms[self._count % len(self._norms)] = total * scale
            self._count += 1
        return scale

    def state_dict(self) -> dict[str, Any]:
        n = min(self._count, len(self._norms))
        order = np.roll(self._norms[:n], -(self._count % len(self._norms))) if self._count > n else self._norms[:n]
        return {"norms": order.tolist(), "clipped": self.clipped}  # oldest first

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """From :meth:`state_dict`; None or {} (a checkpoint from before clipping): an empty history."""
        state = state or {}
        state_counts("dense gradient clip state (dense_clip)", {"clipped": state.get("clipped", 0)})  # (no bool)
        norms = [float(x) for x in _norms(state.get("norms", ())) if np.isfinite(x) and x >= 0][-len(self._norms):]
        self._norms[:len(norms)] = norms
        self._count = len(norms)
        self.clipped = state.get("clipped", 0)


def _norms(norms: Any) -> list[Any]:
    """A state's ``norms``: a list of numbers (a non-finite or negative one is dropped by the load), else a ValueError
    naming the field: text raised a bare TypeError from ``np.isfinite`` and ``true`` was read as a norm of 1.0."""
    if not isinstance(norms, list | tuple) or \
            any(isinstance(x, bool) or not isinstance(x, int | float | np.integer | np.floating) for x in norms):
        raise ValueError(f'dense gradient clip state (dense_clip): "norms" is {str(norms)[:80]!r}, not a list of '
                         "numbers: the state is damaged")
    return list(norms)
