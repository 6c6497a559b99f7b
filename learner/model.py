"""DeepFM (Guo et al., IJCAI 2017) assembled from small parts, torchrec-style.

    SparseArch     one fused ``nn.EmbeddingBag`` (sparse=True, mean pooling) for every field; each
                   row holds ``D`` embedding values plus 1 first-order weight, so one gather serves
                   both the linear and the interaction terms; while a trainer sets ``fused_optimizer``
                   (``learner/fused_update.py``) its training lookups apply row-wise Adagrad in their
                   backward instead of leaving a sparse gradient
    FMInteraction  0.5 * ((sum_f v_f)^2 - sum_f v_f^2), summed over D
    DenseArch      MLP over [field embeddings, dense features]
    DeepFM         bias + first order + FM + MLP -> one logit per sample; in eval mode the logit is calibrated
                   by the ``calibration`` buffer ``(a, b)``: ``a * logit + b`` (``learner/calibration.py``;
                   the identity ``(1, 0)`` until a learner fits it)

Shapes: B samples, F fields, D embedding dim, Dd dense features.
The dense part (FM, MLP) may run under autocast (bf16 on CPU); lookups stay fp32.

Initialisation is deterministic from ``seed`` alone: the table is drawn N(0, 0.01) (first-order weights 0)
from a generator seeded with it, and the MLP takes torch's default ``nn.Linear`` init from torch's global
generator seeded with it, inside ``torch.random.fork_rng`` (the caller's global generator is left as it
was; building a model on another thread meanwhile may see the seeded state). The values are those the
model had when its caller ran ``torch.manual_seed(seed)`` right before building it (``streamrec evaluate``
does), so figures measured that way still hold.
"""

from __future__ import annotations

import torch
from torch import nn

from learner.calibration import add_calibration, calibrated
from learner.config import Amp
from learner.features import FeatureConfig
from learner.fused_update import batch_major, fused_lookup
from learner.optim import RowWiseAdagrad


class SparseArch(nn.Module):
    def __init__(self, num_rows: int, dim: int, num_fields: int, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.num_fields, self.dim = num_fields, dim
        self.bag = nn.EmbeddingBag(num_rows, dim + 1, mode="mean", sparse=True, include_last_offset=True)
        with torch.no_grad():
            self.bag.weight.normal_(0.0, 0.01, generator=generator)
            self.bag.weight[:, dim].zero_()  # first-order weights start at 0
        self.fused_optimizer: RowWiseAdagrad | None = None  # set only inside learner.fused_update.fused_lookups

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = (offsets.numel() - 1) // self.num_fields
        if self.fused_optimizer is not None and self.training and torch.is_grad_enabled():
            bm_values, bm_offsets = batch_major(values, offsets, self.num_fields)  # the same bags, batch-major
            pooled = fused_lookup(self.bag.weight, bm_values, bm_offsets, self.fused_optimizer)  # (B * F, D + 1)
            pooled = pooled.view(b, self.num_fields, self.dim + 1)  # (B, F, D + 1)
        else:
            pooled = self.bag(values, offsets)  # (F * B, D + 1), field-major bags
            pooled = pooled.view(self.num_fields, b, self.dim + 1).transpose(0, 1)  # (B, F, D + 1)
        # split, not two slices: its backward is one cat, not two zero-filled (B, F, D + 1) tensors and a sum
        emb, first = pooled.split([self.dim, 1], dim=2)  # (B, F, D), (B, F, 1)
        return emb, first.squeeze(2)  # (B, F, D), (B, F)


class _FMTrain(torch.autograd.Function):
    """The FM term with its gradient written out: d fm_b / d v_bf = s_b - v_bf (s_b = sum_f v_bf), one (B, F, D)
    expression, where autograd's own backward of the two squares builds several (B, F, D) temporaries (each pow's
    2 * v * grad, the sum's expanded gradient, their sum): ~0.5 ms of a 4096 x 26 x 16 step (bench/README.md,
    learner, fourteenth session). Same values (the forward is the same formula; the gradient equal in tests)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, emb: torch.Tensor) -> torch.Tensor:  # (B, F, D) -> (B,)
        s = emb.sum(dim=1)  # (B, D)
        ctx.save_for_backward(emb, s)
        return 0.5 * (s.pow(2) - emb.pow(2).sum(dim=1)).sum(dim=1)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:  # (B,) -> (B, F, D)
        emb, s = ctx.saved_tensors  # type: ignore[attr-defined]
        out = s.unsqueeze(1) - emb  # (B, F, D)
        return out.mul_(grad.view(-1, 1, 1).to(out.dtype))


class FMInteraction(nn.Module):
    def forward(self, emb: torch.Tensor) -> torch.Tensor:  # (B, F, D) -> (B,)
        if not torch.jit.is_scripting() and emb.requires_grad and torch.is_grad_enabled():
            return _fm_train(emb)  # training (a scripted scorer never trains: the branch is not compiled)
        square_of_sum = emb.sum(dim=1).pow(2)  # (B, D)
        sum_of_square = emb.pow(2).sum(dim=1)  # (B, D)
        return 0.5 * (square_of_sum - sum_of_square).sum(dim=1)


def _fm_train(emb: torch.Tensor) -> torch.Tensor:  # (B, F, D) -> (B,)
    out = _FMTrain.apply(emb)
    assert isinstance(out, torch.Tensor)
    return out


class DenseArch(nn.Module):
    def __init__(self, in_features: int, hidden: tuple[int, ...], dropout: float) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for h in hidden:
            layers += [nn.Linear(in_features, h), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            in_features = h
        layers.append(nn.Linear(in_features, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in) -> (B,)
        return self.mlp(x).squeeze(-1)


def held_out_logits(model: nn.Module, *inputs: torch.Tensor) -> torch.Tensor | None:
    """The raw logits (B,) ``model`` (in train mode) gives ``inputs`` with its dropout off and no gradient, as
    serving's eval mode computes them; None when no dropout of it is active (the training forward's logits are
    those). Test-then-train records these, not the training forward's: with ``[learner] dropout`` at 0.5 those
    differed from what serving scores by up to 0.05 on a fresh model, and the progressive and served metrics and
    the calibration's fit read the noise of one dropout draw as the model's prediction."""
    drops = [m for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0 and m.training]
    if not drops:
        return None
    try:
        for m in drops:
            m.eval()
        with torch.no_grad():
            out = model(*inputs)
    finally:
        for m in drops:
            m.train()
    assert isinstance(out, torch.Tensor)
    return out


def native_cpu_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX, as oneDNN reports it)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def autocast_dtype(amp: Amp, device: torch.device) -> torch.dtype | None:
    """The dense part's autocast dtype that ``amp`` means on ``device`` (None: fp32); see :class:`Amp`."""
    name = Amp.of(amp, "amp").dtype_name(device.type, native_cpu_bf16() if device.type == "cpu" else False)
    return None if name is None else getattr(torch, name)


class DeepFM(nn.Module):
    def __init__(self, cfg: FeatureConfig, mlp: tuple[int, ...] = (400, 400, 400), dropout: float = 0.0,
                 seed: int = 0, autocast_dtype: torch.dtype | None = torch.bfloat16) -> None:
        super().__init__()
        self.cfg = cfg
        with torch.random.fork_rng(devices=[]):  # every draw below from ``seed``; the global generator untouched
            # the MLP (nn.Linear's own init) and EmbeddingBag's default init draw from it; the CPU's alone (forked):
            # torch.manual_seed also reseeded the caller's CUDA generators, which fork_rng(devices=[]) does not restore
            torch.default_generator.manual_seed(seed)
            g = torch.Generator().manual_seed(seed)
            self.sparse = SparseArch(cfg.num_rows, cfg.embedding_dim, cfg.num_fields, generator=g)
            self.fm = FMInteraction()
            self.dense_arch = DenseArch(cfg.num_fields * cfg.embedding_dim + len(cfg.dense), mlp, dropout)
        self.bias = nn.Parameter(torch.zeros(1))
        add_calibration(self)  # the (2,) buffer of Platt's (a, b), served in eval mode
        self.autocast_dtype = autocast_dtype

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """(B,) logits: raw in train mode (what the loss sees), calibrated in eval mode (what is served)."""
        emb, first = self.sparse(values, offsets)  # (B, F, D), (B, F)
        device_type = emb.device.type
        with torch.autocast(device_type, dtype=self.autocast_dtype or torch.float32,
                            enabled=self.autocast_dtype is not None):
            # (B, F*D + Dd); without dense features the flattened copy alone (a cat would copy it once more)
            x = torch.cat([emb.flatten(1), dense], dim=1) if dense.shape[1] else emb.flatten(1)
            deep = self.dense_arch(x)  # (B,)
            fm = self.fm(emb)  # (B,)
        logits = self.bias + first.sum(dim=1) + fm.float() + deep.float()  # (B,)
        return logits if self.training else self.calibrate(logits)

    def calibrate(self, logits: torch.Tensor) -> torch.Tensor:
        """Raw logits (B,) -> served logits (B,): ``a * logits + b``."""
        cal = self.calibration
        assert isinstance(cal, torch.Tensor)  # a buffer (for mypy)
        return calibrated(logits, cal)

    def dense_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if not n.startswith("sparse.")]

    def sparse_parameters(self) -> list[nn.Parameter]:
        return list(self.sparse.parameters())
