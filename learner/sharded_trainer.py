"""The distributed mode's training step: test-then-train on a DMP-wrapped ``ShardedDeepFM``. No I/O.

Every rank calls :meth:`ShardedTrainer.test_then_train` once per step of a round (``learner/distributed.py``,
``LockStep``), with its chunk of the round's rows (maybe none) padded to the step's size: the sharded lookup
and DDP's gradient all-reduce are collectives every rank must enter. The loss is the mean over the rank's real
rows (padding has weight 0; a rank without rows contributes a zero loss, still through the whole graph, so its
DDP hooks fire); DDP averages the dense gradients over the ranks, and the table's rows get every rank's gradient
for them averaged over the ranks too (TorchRec's comm ops divide by the world size,
``torchrec.distributed.comm_ops.GRADIENT_DIVISION``; measured: tests/unit/learner/test_sharded_health.py), applied
by the fused row-wise Adagrad in the backward.

As in ``learner/trainer.py``: one forward serves both halves (its outputs are recorded as progressive
validation before the backward learns from them), a non-finite loss skips the update on every rank together
(all ranks agree on it, since the dense all-reduce must be entered by all or none), and rows that are not
``FINAL`` are weighted by ``learner/delayed.py``. With ``calibration`` (the served Platt ``(a, b)``, which the
distributed daemon fits on rank 0 and sends to every rank each round) the predictions recorded and returned are
the calibrated ones, what is served; ``last_logits`` keeps the raw ones for the fit. With ``boost``
(``learner/sharded_boost.py``) young rows' steps are boosted after the fused update. Not here: fp16 loss scaling
(gradient accumulation is a larger step: ``learner.sharded_daemon.rows_per_step``).

Gradient norms (``grad_norms``, ``learner/health.py``'s ``GradNorms``, drained by the daemon): the dense norm of
every step, of the all-reduced gradient (the same on every rank, before clipping, as one process's). fbgemm applies
the table's gradient inside the backward and keeps none, so the table's is read from what its row-wise Adagrad
added to each row's sum, ``|g_row|^2 / W`` (``learner/sharded_model.py``): on a sampled step (at most one a
``sample_every_s``, the ranks agreeing in the step's existing all-reduce of its loss being finite) each rank copies
its shard's sums before the backward and gives the growth, as one column ``sqrt(W * growth)`` per touched row, to
``GradNorms`` (the table's norm and its per-field split); the daemon combines the ranks' shards. Other steps'
table norm is NaN (not measured, not observed). Exact up to the float32 sums' rounding of the growth, which
is all of it for a row whose sum is ~2^24 times its step's ``|g|^2 / W`` (updated at nearly every step for ~16 M
steps: a context field's rows): such a row reads 0, so a busy field's norm fades on long runs (fbgemm keeps no
gradient, and the weights' change would need a copy of the touched rows).

Update norms (``update_norms``, ``learner/health.py``'s ``UpdateNorms``, drained by the daemon on the rounds with a
sampled step): on the same sampled steps, what the step changed. The embedding part: before the backward, every
rank's step rows are all-gathered and this rank's copy of those it holds kept (``learner/sharded_model.py``
``touched_rows``, the boost's own copy when it is on: one collective and one copy either way); after the backward
and the boost, the change of those rows (this rank's shard: the daemon combines the ranks' as sqrt(sum of
squares)). The dense part: a copy of the dense parameters before ``dense_opt.step()``, the norm of their change
after it (DDP's replicas: the same on every rank). Other steps copy nothing.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from learner.batch import TensorBatch
from learner.calibration import calibrated
from learner.delayed import DelayedFeedbackWeights
from learner.grad_clip import AdaptiveClip
from learner.health import GradNorms, UpdateNorms
from learner.model import held_out_logits
from learner.progressive import ProgressiveMetrics
from learner.sharded_boost import ShardedBoost
from learner.sharded_model import TouchedRows, fused_state, local_pieces, padded_inputs, table_weight, touched_rows
from learner.trainer import MAX_DENSE_GRAD_NORM


class ShardedTrainer:
    def __init__(self, model: nn.Module, dense_opt: torch.optim.Optimizer, keys: list[str],
                 device: torch.device, metrics: ProgressiveMetrics, dense_grad_clip: float = 10.0) -> None:
        self.model, self.dense_opt, self.keys, self.device = model, dense_opt, keys, device
        self.metrics = metrics
        self.delayed = DelayedFeedbackWeights()
        self.steps = 0
        self.samples = 0  # this rank's
        self.nan_losses = 0
        self.overflow_steps = 0  # steps whose dense update was skipped (learner/trainer.py, MAX_DENSE_GRAD_NORM)
        self.dense_clip = AdaptiveClip(dense_grad_clip)  # the same on every rank: the norms are of all-reduced grads
        self.last_loss = float("nan")
        self.calibration: torch.Tensor | None = None  # (2,) served (a, b); None: raw logits served
        self.last_logits = np.zeros(0, np.float32)  # (B,) raw logits of the last call's real rows
        self.boost: ShardedBoost | None = None  # the boost of young rows (learner/sharded_boost.py), if on
        self.grad_norms = GradNorms()  # per step (module docstring); the daemon gives it the field blocks
        self.sample_every_s = 1.0  # the table's gradient norm of one step this often, at most
        self.sampled_steps = 0  # steps whose table gradient was measured
        self.update_norms = UpdateNorms()  # driven by the sampled steps (module docstring), not by its own clock
        self._sampled_at = -math.inf

    def test_then_train(self, batch: TensorBatch, rows: int) -> np.ndarray:
        """Predict ``batch``'s rows (recorded in ``metrics``), then learn; ``rows`` >= len(batch) is the step's
        size on every rank. Returns the predictions of the real rows, shape (B,)."""
        b = len(batch)
        self.model.train()
        kjt, dense, labels, mask = padded_inputs(batch, rows, self.keys, self.device)
        held = held_out_logits(self.model, kjt, dense)  # with dropout: what serving would score (learner/trainer.py)
        logits = self.model(kjt, dense)  # (rows,) raw
        p_t = torch.sigmoid(logits.detach()).float()  # (rows,)
        raw = (logits.detach() if held is None else held).float()  # (rows,) the served model's raw logits
        self.last_logits = raw[:b].cpu().numpy()
        served = torch.sigmoid(raw) if self.calibration is None else torch.sigmoid(
            calibrated(raw, self.calibration.to(logits.device)))  # (rows,)
        probs = served[:b].cpu().numpy()
        weight = mask
        if batch.kinds is not None and b:
            self.delayed.observe(batch.kinds, batch.labels.numpy(), batch.label_delay_ms)
            w = self.delayed.weights(batch.kinds, labels[:b], p_t[:b])
            if w is not None:
                weight = torch.cat([w.to(mask.dtype), mask[b:]])
        per_row = F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="none")  # (rows,)
        loss = (per_row * weight).sum() / max(b, 1)
        local = float(loss.item())
        wants_sample = time.monotonic() - self._sampled_at >= self.sample_every_s
        # (finite, not sampled): the minimum over ranks skips the step if any loss is not finite, samples if any wants
        agreed = torch.tensor([1 if np.isfinite(local) else 0, 0 if wants_sample else 1], dtype=torch.int64)
        if dist.is_initialized():
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        self.last_loss = local
        if not bool(agreed[0].item()):  # some rank's loss is not finite: every rank skips this step's update
            self.nan_losses += 1
            return probs
        sums_before = self._table_sums() if not agreed[1].item() else None  # sampled: the shard's Adagrad sums
        if b:
            self.metrics.update(probs, batch.labels.numpy())
        touched = self._touched_before(batch.values, sampled=sums_before is not None)
        loss.backward()  # the table's rows are updated in here (fused); the dense grads are all-reduced
        if self.boost is not None:
            self.boost.after()
        if sums_before is not None:
            self._measure_table(sums_before)
            self.update_norms.rows_changed([(rows, idx, w0) for _, rows, idx, w0 in touched])  # boosted: after it
        grads = [p.grad for g in self.dense_opt.param_groups for p in g["params"] if p.grad is not None]
        dense_norms = torch._foreach_norm(grads) if grads else []  # one per tensor (grad_norms combines them)
        self.grad_norms.end_step(dense_norms, table_measured=sums_before is not None)
        self.grad_norms.sample_blocks = False
        if grads:  # all-reduced: every rank decides alike (a gradient that would make Adam's state inf for good)
            total = float(torch.linalg.vector_norm(torch.stack(list(dense_norms))))
            if not np.isfinite(total) or total >= MAX_DENSE_GRAD_NORM:
                self.dense_opt.zero_grad(set_to_none=True)
                self.overflow_steps += 1
            else:
                self.dense_clip.clip_(grads, total)  # learner/grad_clip.py
        params = [p for g in self.dense_opt.param_groups for p in g["params"]]
        self.update_norms.dense_before(params)  # sampled steps only: a copy of the dense part
        self.dense_opt.step()
        self.update_norms.dense_after(params)
        self.update_norms.sampling = False
        self.dense_opt.zero_grad(set_to_none=True)
        self.samples += b
        self.steps += 1
        return probs

    def _touched_before(self, values: torch.Tensor, sampled: bool) -> TouchedRows:
        """Collective with the boost or on a sampled step (every rank alike): the step's rows this rank holds and
        their copy before the update (the boost's own copy when it is on); else none (nothing copied)."""
        if self.boost is not None:
            touched = self.boost.before(values)
        elif sampled:
            touched = touched_rows(self.model, values)
        else:
            return []
        if sampled:
            self.update_norms.begin()
        return touched

    def _table_sums(self) -> list[tuple[int, torch.Tensor]]:
        """(first row, a copy of its row-wise Adagrad sums (R,)) of each local shard of the table."""
        self._sampled_at = time.monotonic()
        self.sampled_steps += 1
        self.grad_norms.sample_blocks = True
        return [(start, t.clone()) for start, t in local_pieces(fused_state(self.model)["momentum1"])]

    def _measure_table(self, before: list[tuple[int, torch.Tensor]]) -> None:
        """This rank's shard's gradient of the step, from its sums' growth ``|g_row|^2 / W``, into ``grad_norms``."""
        width = next(t.shape[1] for _, t in local_pieces(table_weight(self.model)))  # W
        after = dict(local_pieces(fused_state(self.model)["momentum1"]))
        for start, sums in before:
            growth = after[start] - sums  # (R,)
            touched = growth.nonzero().flatten()  # (U,) local rows
            norms = (growth[touched].float().clamp(min=0) * width).sqrt()  # (U,) each row's gradient norm
            self.grad_norms.embedding(touched + start, norms.unsqueeze(1))  # (U,), (U, 1)
