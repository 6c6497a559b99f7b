"""The FM term's training path (``learner.model._FMTrain``: the gradient written out) is the formula's own value and
gradient; inference (no gradient, a scripted scorer) keeps the plain formula."""

from __future__ import annotations

import torch

from learner.model import FMInteraction


def formula(emb: torch.Tensor) -> torch.Tensor:  # (B, F, D) -> (B,)
    return 0.5 * (emb.sum(dim=1).pow(2) - emb.pow(2).sum(dim=1)).sum(dim=1)


def test_training_uses_the_written_out_gradient_and_it_is_the_formulas() -> None:
    g = torch.Generator().manual_seed(0)
    pooled = torch.randn(7, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)  # (B, F, D + 1)
    emb, _ = pooled.split([3, 1], dim=2)  # a strided view, as SparseArch hands it over
    out = FMInteraction()(emb)
    assert out.grad_fn is not None and "_FMTrain" in out.grad_fn.name()
    weights = torch.randn(7, generator=g, dtype=torch.float64)
    (out * weights).sum().backward()
    want = emb.detach().clone().requires_grad_()
    (formula(want) * weights).sum().backward()
    assert torch.allclose(out, formula(want), rtol=0, atol=1e-12)
    assert pooled.grad is not None and want.grad is not None
    assert torch.allclose(pooled.grad[..., :3], want.grad, rtol=0, atol=1e-12)
    assert torch.equal(pooled.grad[..., 3], torch.zeros(7, 5, dtype=torch.float64))
    assert torch.autograd.gradcheck(FMInteraction(), (emb.detach().clone().requires_grad_(),))


def test_inference_and_scripted_scorers_take_the_plain_formula() -> None:
    emb = torch.randn(4, 6, 3)
    with torch.no_grad():
        assert torch.equal(FMInteraction()(emb), formula(emb))
    scripted = torch.jit.script(FMInteraction())
    assert torch.equal(scripted(emb), formula(emb))
    assert FMInteraction()(emb).grad_fn is None  # no gradient asked for: no autograd node
