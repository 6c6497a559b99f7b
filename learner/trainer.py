"""The training step: test-then-train with gradient accumulation and mixed precision. No I/O.

One forward pass serves both halves of test-then-train: its outputs are the model's predictions
*before* it learns from the batch (the update comes after), so they are recorded as progressive
validation, then the same graph is back-propagated. With ``dropout`` the predictions come from a second forward
without it and without a gradient (``learner.model.held_out_logits``): what serving's eval mode scores, not one
dropout draw. Gradients accumulate over ``accumulation`` micro-batches with the loss divided by that number, and
both optimizers step and zero on the same cadence, so N accumulated micro-batches make the same update as one
batch N times as large.

Rows that are not ``FINAL`` (the joiner's ``fake_negative`` and ``es_dfm`` policies) are weighted by
``learner/delayed.py``'s importance weights; a batch of ``FINAL`` rows keeps the plain mean loss.

The table's row-wise Adagrad runs inside the backward of the lookup (``learner/fused_update.py``, fbgemm's fused
``EXACT_ROWWISE_ADAGRAD``) when ``fused_sparse_update`` allows it and it is the same update: one micro-batch per
step and no fp16 loss scaling (checked at every batch, so a scaler set later turns it off); :meth:`step` then
finds no gradient on the table. ``auto`` leaves it off on CUDA: on an H200 it saved 6-15% of the device's time
per step but lost 2-15% of the wall time, a step there being bound by the host (its dynamic-size ops wait on the
device); ``on`` still runs it there. ``sparse_update`` names the path the last batch took (``fused``/``unfused``).

With a ``calibration`` (``learner/calibration.py``), the predictions recorded and returned are the calibrated
ones (what is served), and each batch's raw logits go to the calibration, which fits them as their labels
become final; the loss and the weights use the raw logits.

The dense gradient's total norm is clipped to ``dense_grad_clip`` x the median of the recent steps' norms
(``learner/grad_clip.py``, AutoClip's history-based threshold), so one batch with an out-of-scale dense value moves
Adam's second moment no more than a normal batch; a norm that is not finite, or >= ``MAX_DENSE_GRAD_NORM``, skips
the dense update (``overflow_steps``).

Health (``learner/health.py``): every step's gradient L2 norms, dense and embedding, go to ``grad_norms`` as device
tensors (the embedding's from the per-row sums the fused backward already has, or from the coalesced sparse
gradient the optimizer would coalesce anyway); ``update_norms`` samples, at most once a second, how much a step
changed the weights, and that step's embedding norm is also split per field block. The daemon drains both when it
publishes its metrics.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from learner.batch import TensorBatch
from learner.calibration import OnlineCalibration, calibrated
from learner.config import FusedSparseUpdate
from learner.delayed import DelayedFeedbackWeights
from learner.fused_update import fused_applies, fused_lookups
from learner.grad_clip import AdaptiveClip
from learner.health import GradNorms, UpdateNorms
from learner.model import SparseArch, held_out_logits
from learner.optim import RowWiseAdagrad
from learner.progressive import ProgressiveMetrics
from stream.errors import ConfigError

# A dense gradient this large squares past float32's range in Adam's second moment (2**128), which then stays inf
# and its weight never moves again; a step with one is not applied to the dense weights (2**63: rounding margin).
MAX_DENSE_GRAD_NORM = float(2**63)


class Trainer:
    def __init__(self, model: nn.Module, sparse_opt: torch.optim.Optimizer, dense_opt: torch.optim.Optimizer,
                 accumulation: int = 1, device: torch.device | str = "cpu",
                 metrics: ProgressiveMetrics | None = None, calibration: OnlineCalibration | None = None,
                 fused_sparse_update: FusedSparseUpdate | str = FusedSparseUpdate.AUTO,
                 dense_grad_clip: float = 10.0) -> None:
        if accumulation < 1:
            raise ValueError(f"accumulation must be >= 1, got {accumulation}")
        self.fused_sparse_update = FusedSparseUpdate.of(fused_sparse_update, "fused_sparse_update")
        self.model, self.sparse_opt, self.dense_opt = model, sparse_opt, dense_opt
        self.accumulation = accumulation
        self.device = torch.device(device)
        self.metrics = metrics or ProgressiveMetrics()
        self.delayed = DelayedFeedbackWeights()
        self.calibration = calibration
        self._micro = 0
        self.steps = 0
        self.samples = 0
        self.last_loss = float("nan")
        self.nan_losses = 0  # batches skipped because their loss was not finite
        self.overflow_steps = 0  # steps whose dense update was skipped: a gradient too large (MAX_DENSE_GRAD_NORM)
        self.dense_clip = AdaptiveClip(dense_grad_clip)  # dense gradients of outlier batches scaled down
        self.grad_norms = GradNorms.of(model)  # per step, drained by the daemon (learner/health.py)
        self.update_norms = UpdateNorms()  # sampled at most once a second
        # fp16 on CUDA needs loss scaling; bf16 (the CPU default) does not.
        amp_dtype = getattr(model, "autocast_dtype", None)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.device.type == "cuda" and amp_dtype == torch.float16)
        why = self._not_fused()
        self.sparse_update = "unfused" if why else "fused"  # the path the last trained batch's table update took
        if self.fused_sparse_update is FusedSparseUpdate.ON and why is not None:
            raise ConfigError(f"fused_sparse_update = on, but the fused row-wise Adagrad would not be the same "
                              f"update here: {why}; set it to auto or off")

    def _not_fused(self) -> str | None:
        """None when this batch's table update runs fused into the backward, else why not."""
        if self.fused_sparse_update is FusedSparseUpdate.OFF:
            return "fused_sparse_update = off"
        if not isinstance(getattr(self.model, "sparse", None), SparseArch):
            return "the model has no SparseArch lookup"
        if self.fused_sparse_update is FusedSparseUpdate.AUTO and self.device.type == "cuda":
            return "auto on CUDA: the unfused step measured faster there (bench/README.md, GPU)"
        return fused_applies(self.sparse_opt, self.accumulation, self.scaler.is_enabled())

    @torch.no_grad()
    def predict(self, batch: TensorBatch) -> np.ndarray:
        self.model.eval()
        b = batch.to(self.device)
        return torch.sigmoid(self.model(b.values, b.offsets, b.dense)).float().cpu().numpy()

    def test_then_train(self, batch: TensorBatch) -> np.ndarray:
        """Predict (recorded in ``metrics``), then learn. Returns the predictions, shape (B,)."""
        if not len(batch):  # nothing to predict or learn; its mean loss, NaN, would count it as a poison batch
            return np.zeros(0, np.float32)
        self.model.train()
        b = batch.to(self.device)
        fused = self._not_fused() is None
        held = held_out_logits(self.model, b.values, b.offsets, b.dense)  # with dropout: what serving would score
        if fused:
            assert isinstance(self.sparse_opt, RowWiseAdagrad)
            with fused_lookups(self.model, self.sparse_opt, self._observe_rows):  # the backward updates the table
                logits = self.model(b.values, b.offsets, b.dense)  # (B,) raw
            self.sparse_update = "fused"
        else:
            logits = self.model(b.values, b.offsets, b.dense)  # (B,) raw
            self.sparse_update = "unfused"
        p_t = torch.sigmoid(logits.detach()).float()
        raw = logits.detach() if held is None else held  # (B,) the served model's raw logits
        served = (torch.sigmoid(raw).float() if self.calibration is None else
                  torch.sigmoid(calibrated(raw, self.model.get_buffer("calibration"))).float())
        probs = served.cpu().numpy()
        weight = None
        if batch.kinds is not None:
            self.delayed.observe(batch.kinds, batch.labels.numpy(), batch.label_delay_ms)
            weight = self.delayed.weights(batch.kinds, b.labels, p_t)
        if weight is None:
            loss = F.binary_cross_entropy_with_logits(logits.float(), b.labels)
        else:  # importance-weighted (learner/delayed.py); normalised by rows, not by weights, as in both papers
            loss = (F.binary_cross_entropy_with_logits(logits.float(), b.labels, reduction="none") * weight).mean()
        self.last_loss = float(loss.item())
        if not np.isfinite(self.last_loss):
            # One poison batch (an inf feature) must not kill the daemon or poison the weights: skip its
            # update and count it (streamrec_learner_nan_losses_total; the monitor alerts on it).
            self.nan_losses += 1
            return probs
        self.metrics.update(probs, batch.labels.numpy())
        if self.calibration is not None:  # fitted on held-out predictions as their labels become final
            self.calibration.observe(batch.impression_ids, batch.kinds, batch.labels.numpy(),
                                     raw.float().cpu().numpy(), batch.ts, batch.label_delay_ms)
            cal = self.model.get_buffer("calibration")
            cal.copy_(self.calibration.params.to(cal.device))
        sampled = self._micro == 0 and self.update_norms.start()  # this step's changes are measured
        if self._micro == 0:
            self.grad_norms.sample_blocks = sampled  # and its table gradient split per field
        self.scaler.scale(loss / self.accumulation).backward()
        if sampled and fused:
            self.update_norms.rows_after(self._table())
        self._micro += 1
        self.samples += len(batch)
        if self._micro == self.accumulation:
            self.step()
        return probs

    def _observe_rows(self, weight: torch.Tensor, rows: torch.Tensor, sums: torch.Tensor) -> None:
        """The table's unique ``rows`` (U,) and their summed gradients (U, D + 1), before the update."""
        self.grad_norms.embedding(rows, sums)
        self.update_norms.rows_before(weight, rows)

    def _table(self) -> torch.Tensor:
        return next(p for g in self.sparse_opt.param_groups for p in g["params"])

    def step(self) -> None:
        """Apply accumulated gradients (also called at a checkpoint so no gradient is left pending)."""
        if self._micro == 0:
            return
        # The loss scale multiplies every gradient, the sparse embedding ones too: both optimizers step
        # through the scaler, which unscales them and skips the step when any gradient overflowed.
        if self.scaler.is_enabled():  # the norms below are of the true gradients (step() does not unscale twice)
            self.scaler.unscale_(self.dense_opt)
            self.scaler.unscale_(self.sparse_opt)
        dense_params = [p for g in self.dense_opt.param_groups for p in g["params"]]
        grads = [p.grad for p in dense_params if p.grad is not None]
        dense_norms = torch._foreach_norm(grads) if grads else []  # one per tensor; combined when drained
        sampled = self.update_norms.sampling
        for p in (p for g in self.sparse_opt.param_groups for p in g["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                p.grad = p.grad.coalesce()  # what the optimizer does first; coalesced, it is not done twice
                rows, sums = p.grad.indices()[0], p.grad.values()
            else:
                rows, sums = RowWiseAdagrad.touched_rows(p.grad)
            self._observe_rows(p, rows, sums)
        if dense_norms:
            total = float(torch.linalg.vector_norm(torch.stack(list(dense_norms))))  # the step's one sync
            if not np.isfinite(total) or total >= MAX_DENSE_GRAD_NORM:
                if not self.scaler.is_enabled():  # (the scaler skips a step that overflowed itself)
                    self.dense_opt.zero_grad(set_to_none=True)  # Adam leaves parameters without a gradient alone
                    self.overflow_steps += 1
            else:
                self.dense_clip.clip_(grads, total)  # an outlier batch scaled to the recent norms (grad_clip.py)
        if sampled:
            self.update_norms.dense_before(dense_params)
        self.scaler.step(self.dense_opt)
        self.scaler.step(self.sparse_opt)
        self.scaler.update()
        if sampled:
            self.update_norms.dense_after(dense_params)
            self.update_norms.finish(self._table())
        self.grad_norms.end_step(dense_norms)
        self.sparse_opt.zero_grad(set_to_none=True)
        self.dense_opt.zero_grad(set_to_none=True)
        self._micro = 0
        self.steps += 1
