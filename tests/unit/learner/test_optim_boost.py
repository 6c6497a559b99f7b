"""RowWiseAdagrad's learning-rate boost for young rows (cold start): off by default, decays, survives a checkpoint."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from learner.optim import RowWiseAdagrad


def _table(seed: int = 0) -> nn.EmbeddingBag:
    torch.manual_seed(seed)
    return nn.EmbeddingBag(20, 4, mode="sum", sparse=True)


def _step(emb: nn.EmbeddingBag, opt: RowWiseAdagrad, idx: list[int], target: float = 1.0) -> None:
    opt.zero_grad()
    out = emb(torch.tensor(idx), torch.tensor([0]))  # (1, D)
    ((out - target) ** 2).sum().backward()
    opt.step()


def test_default_is_bit_identical_to_the_plain_update() -> None:
    emb = _table()
    opt = RowWiseAdagrad(emb.parameters(), lr=0.1)
    w = emb.weight.detach().clone()
    acc = torch.zeros(20)
    for idx in ([1, 2, 2], [2, 3], [1, 7, 7, 7]):
        opt.zero_grad()
        out = emb(torch.tensor(idx), torch.tensor([0]))
        ((out - 1.0) ** 2).sum().backward()
        g_rows = emb.weight.grad.coalesce()
        rows, g = g_rows.indices()[0], g_rows.values()  # (U,), (U, D)
        opt.step()
        acc.index_add_(0, rows, g.pow(2).mean(dim=1))  # the reference: the docstring's two lines
        w.index_add_(0, rows, -g * (0.1 / (acc[rows].sqrt() + 1e-8)).unsqueeze(1))
        assert torch.equal(emb.weight.detach(), w)
    assert set(opt.state[emb.weight]) == {"sum"}  # no update counts kept without a boost


def test_boosted_rows_move_more_at_first_and_the_boost_decays() -> None:
    emb = _table()
    opt = RowWiseAdagrad(emb.parameters(), lr=0.1, boost=3.0, boost_half_life=2.0)
    acc = torch.zeros(20)
    ratios = []
    for _ in range(8):
        opt.zero_grad()
        ((emb(torch.tensor([5]), torch.tensor([0])) - 1.0) ** 2).sum().backward()
        g = emb.weight.grad.coalesce().values()[0]  # (D,) row 5's gradient
        before = emb.weight.detach()[5].clone()
        opt.step()
        acc[5] += g.pow(2).mean()
        plain = 0.1 * g / (acc[5].sqrt() + 1e-8)  # the unboosted step from the same state
        ratios.append(float((before - emb.weight.detach()[5]).norm() / plain.norm()))
    expected = [1 + 3 * 2 ** (-k / 2) for k in range(8)]  # step k is scaled by 1 + boost * 2 ** (-k / half_life)
    assert ratios == pytest.approx(expected, rel=1e-4)
    assert ratios[0] > 3.9 and ratios[-1] < 1.4
    assert int(opt.state[emb.weight]["updates"][5]) == 8
    assert int(opt.state[emb.weight]["updates"][6]) == 0  # untouched rows stay young


def test_reset_rows_makes_a_row_young_again() -> None:
    emb = _table()
    opt = RowWiseAdagrad(emb.parameters(), lr=0.1, boost=1.0, boost_half_life=1.0)
    for _ in range(5):
        _step(emb, opt, [3, 4])
    opt.reset_rows(emb.weight, torch.tensor([3]))
    assert opt.state[emb.weight]["updates"].tolist()[3:5] == [0, 5]
    assert float(opt.state[emb.weight]["sum"][3]) == 0.0


def test_state_dict_round_trip_keeps_the_counts() -> None:
    a, b = _table(), _table()
    oa = RowWiseAdagrad(a.parameters(), lr=0.1, boost=2.0, boost_half_life=4.0)
    for _ in range(3):
        _step(a, oa, [1, 9])
    buf = io.BytesIO()
    torch.save({"w": a.state_dict(), "opt": oa.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    b.load_state_dict(saved["w"])
    ob = RowWiseAdagrad(b.parameters(), lr=0.1, boost=2.0, boost_half_life=4.0)
    ob.load_state_dict(saved["opt"])
    assert torch.equal(ob.state[b.weight]["updates"], oa.state[a.weight]["updates"])
    _step(a, oa, [1, 2])
    _step(b, ob, [1, 2])
    assert torch.equal(a.weight, b.weight)


def test_boost_needs_a_half_life() -> None:
    with pytest.raises(ValueError, match="boost_half_life"):
        RowWiseAdagrad(_table().parameters(), boost=1.0)


@pytest.mark.parametrize(("boost", "half_life"), [(float("nan"), 2.0), (float("inf"), 2.0), (3.0, float("nan")),
                                                   (3.0, float("inf"))])
def test_a_boost_or_half_life_that_is_not_finite_is_refused_rather_than_poisoning_or_silently_dropping_it(
        boost: float, half_life: float) -> None:
    # NaN passed both `< 0` and `<= 0`: a NaN boost was silently no boost, a NaN half-life made every boosted step
    # NaN, an infinite boost an infinite step (the table's young rows NaN/inf after one update)
    with pytest.raises(ValueError, match="finite"):
        RowWiseAdagrad(_table().parameters(), lr=0.1, boost=boost, boost_half_life=half_life)
