"""learner/calibration.py: Platt scaling fitted online on served predictions paired with their final labels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.calibration import OnlineCalibration
from learner.progressive import normalized_entropy
from stream.samples import DELAYED_POSITIVE, FINAL, OBSERVED

SECOND = 1000


def stream(n: int, scale: float, shift: float = 0.0, seconds: int = 2000, seed: int = 0, delay_s: float = 30.0):
    """A fake_negative stream of ``n`` impressions over ``seconds``, in batches of 256 rows in emission order:
    each impression's OBSERVED row at its time, its click (true logit t: Bernoulli(sigmoid(t))) as a
    DELAYED_POSITIVE an exponential delay later. The model's raw logit is ``scale * t + shift``. Yields
    (ids, kinds, labels, logits, ts, label_delay_ms) and returns the (true logits, labels, model logits)."""
    rng = np.random.default_rng(seed)
    t = rng.normal(-2.0, 1.0, n)
    y = (rng.random(n) < 1 / (1 + np.exp(-t))).astype(np.float32)
    ts = np.sort(rng.uniform(0, seconds * SECOND, n)).astype(np.int64)
    delay = np.where(y > 0, rng.exponential(delay_s * SECOND, n), 0).astype(np.int64)
    z = scale * t + shift
    ids = np.array([f"i{k}" for k in range(n)], object)
    clicked = np.flatnonzero(y > 0)
    rows_ids = np.concatenate([ids, ids[clicked]])
    rows_kind = np.concatenate([np.full(n, OBSERVED), np.full(len(clicked), DELAYED_POSITIVE)]).astype(np.int8)
    rows_y = np.concatenate([np.zeros(n), np.ones(len(clicked))]).astype(np.float32)
    rows_z = np.concatenate([z, z[clicked]])
    rows_ts = np.concatenate([ts, ts[clicked]])
    rows_delay = np.concatenate([np.zeros(n, np.int64), delay[clicked]])
    order = np.argsort(rows_ts + rows_delay, kind="stable")
    batches = [tuple(col[order][i:i + 256] for col in (rows_ids, rows_kind, rows_y, rows_z, rows_ts, rows_delay))
               for i in range(0, len(order), 256)]
    return batches, (t, y, z, ts)


def run(cal: OnlineCalibration, batches) -> None:
    for ids, kinds, labels, logits, ts, delays in batches:
        cal.observe(ids, kinds, labels, logits, ts, delays)


def test_one_row_stamped_a_day_early_does_not_end_a_streams_warm_up() -> None:
    """The warm-up is measured from the stream's start, taken as the quorum-th smallest impression time: as the
    smallest, one row stamped a day early (a client's clock) made the whole warm-up count as mature and be fitted."""
    day = 1_700_000_000_000
    batches, _ = stream(3_000, scale=3.0, seconds=290)  # the whole stream is its own warm-up ...
    batches = [(ids, kinds, labels, logits, ts + day, delays) for ids, kinds, labels, logits, ts, delays in batches]
    ids, kinds, labels, logits, ts, delays = batches[0]
    ts = ts.copy()
    ts[0] = day - 86_400 * SECOND  # ... but for one row
    batches[0] = (ids, kinds, labels, logits, ts, delays)
    warm = OnlineCalibration(maturity_s=300)
    run(warm, batches)
    assert warm.rows == 0 and not warm.pending and (warm.a, warm.b) == (1.0, 0.0)
    assert warm.first_ms is not None and warm.first_ms >= day
    again = OnlineCalibration(maturity_s=300)
    again.load_state_dict(warm.state_dict())
    assert again.first_ms == warm.first_ms
    again.load_state_dict({"first_ms": day})  # a checkpoint from before the quorum: its one time, as one row
    assert again.first_ms == day


def test_an_overconfident_model_is_shrunk_to_the_true_probabilities() -> None:
    batches, (t, y, z, _) = stream(60_000, scale=3.0, shift=4.0)  # logits 3x too spread, centred wrong
    cal = OnlineCalibration()
    run(cal, batches)
    assert cal.a == pytest.approx(1 / 3, rel=0.15) and cal.b == pytest.approx(-4 / 3, abs=0.3)
    late = slice(40_000, None)
    raw_ne = normalized_entropy(1 / (1 + np.exp(-z[late])), y[late])
    cal_ne = normalized_entropy(1 / (1 + np.exp(-(cal.a * z[late] + cal.b))), y[late])
    assert raw_ne > 1.2 and cal_ne < 0.97


def test_an_observed_zero_is_paired_with_its_click_when_it_matures_not_before() -> None:
    """A calibrated model stays calibrated: every click (30 s delays, well inside the 300 s maturity) counts.
    Fitting an observed 0 as it arrives would take the clicks for misses and pull b down."""
    batches, _ = stream(60_000, scale=1.0)
    cal = OnlineCalibration()
    run(cal, batches)
    assert cal.rows > 40_000  # all but the first and the last 300 s
    assert cal.a == pytest.approx(1.0, abs=0.1) and cal.b == pytest.approx(0.0, abs=0.15)
    eager = OnlineCalibration(maturity_s=1.0)  # pairs fitted before most clicks came: biased low
    run(eager, batches)
    assert eager.b < cal.b - 0.3


def test_final_rows_and_a_streams_warm_up_are_not_fitted() -> None:
    cal = OnlineCalibration()
    rng = np.random.default_rng(1)
    z = rng.normal(0, 3, 1000)
    cal.observe(np.arange(1000).astype(str).astype(object), np.full(1000, FINAL, np.int8), np.ones(1000), z,
                np.arange(1000) * SECOND, np.zeros(1000, np.int64))
    cal.observe(np.arange(1000).astype(str).astype(object), None, np.ones(1000), z, np.arange(1000) * SECOND, None)
    assert (cal.a, cal.b, cal.rows, cal.pending) == (1.0, 0.0, 0, 0)
    warm = OnlineCalibration(maturity_s=300)
    batches, _ = stream(3_000, scale=3.0, seconds=290)  # the whole stream is its own warm-up
    run(warm, batches)
    assert warm.rows == 0 and not warm.pending and (warm.a, warm.b) == (1.0, 0.0)


def test_a_model_that_knows_nothing_keeps_its_ranking() -> None:
    batches, _ = stream(30_000, scale=0.0)  # logits carry no information: Platt would take a to 0
    rng = np.random.default_rng(2)
    noisy = [(i, k, y, z + rng.normal(0, 1, len(z)), ts, d) for i, k, y, z, ts, d in batches]
    cal = OnlineCalibration()
    run(cal, noisy)
    # shrunk as far as it goes (up to the last rows, not matured yet: the clock lags the newest by 15 rows), the
    # ranking kept
    assert cal.a == pytest.approx(cal.min_scale, abs=1e-3)


def test_pending_impressions_are_bounded_and_the_state_round_trips() -> None:
    batches, _ = stream(20_000, scale=2.0)
    cal = OnlineCalibration(max_pending=500)
    half = len(batches) // 2
    run(cal, batches[:half])
    assert cal.pending <= 500
    copy = OnlineCalibration(max_pending=500)
    copy.load_state_dict(cal.state_dict())
    run(cal, batches[half:])
    run(copy, batches[half:])
    assert (copy.a, copy.b, copy.rows) == (cal.a, cal.b, cal.rows)


def test_a_row_ahead_of_the_wall_clock_does_not_mature_the_pending_impressions_early() -> None:
    """The calibration clock was the newest ts + label_delay_ms ever seen: after one row an hour ahead, every
    observed impression matured at once and was fitted as a 0 before its delayed click came."""
    import time

    now = int(time.time() * 1000)
    cal = OnlineCalibration(maturity_s=300)
    obs = np.array([OBSERVED], np.int8)
    old = np.array([f"old{k}" for k in range(16)], object)  # a stream that began an hour ago (a quorum of rows)
    cal.observe(old, np.full(16, OBSERVED, np.int8), np.zeros(16), np.zeros(16), np.full(16, now - 3_600_000), None)
    cal.observe(np.array(["ahead"], object), obs, np.ones(1), np.zeros(1), np.array([now - 60_000]),
                np.array([2 * 3_600_000]))  # a click reported two hours after its impression, an hour from now
    ids = np.array([f"i{k}" for k in range(20)], object)
    cal.observe(ids, np.full(20, OBSERVED, np.int8), np.zeros(20), np.zeros(20), np.full(20, now - 30_000), None)
    assert cal.rows == 0 and cal.pending == 21  # a minute old at most: none is mature yet


def test_a_stretch_without_clicks_does_not_leave_the_calibration_serving_one_to_everything() -> None:
    """A million matured rows without a click (a click outage: minutes at production rates) fit b down and their
    curvature away; forgetting toward 0 left H near singular, and the first batch with clicks stepped b to +1e6:
    every impression served 1.0 from then on. H forgets toward its prior, so the fit comes back to the clicks."""
    rng = np.random.default_rng(3)

    def rows(n: int, clicks: bool) -> tuple[np.ndarray, np.ndarray]:
        z = rng.normal(-2.2, 1.0, n)  # a calibrated model: clicks at sigmoid(z)
        return z, (rng.random(n) < 1 / (1 + np.exp(-z))).astype(np.float64) * clicks

    cal = OnlineCalibration()
    for _ in range(100):
        cal.fit(*rows(1000, clicks=True))
    for _ in range(1000):
        cal.fit(*rows(1000, clicks=False))
    assert np.linalg.eigvalsh(cal.h).min() > 1.0  # its curvature not forgotten to nothing (the prior: 90)
    for _ in range(30):
        cal.fit(*rows(1000, clicks=True))
    z, y = rows(50_000, clicks=True)
    served = 1 / (1 + np.exp(-np.clip(cal.a * z + cal.b, -40, 40)))
    assert np.isfinite(cal.b) and abs(cal.b) < 5
    assert normalized_entropy(np.clip(served, 1e-7, 1 - 1e-7), y) < 0.95


def test_a_scale_held_at_its_floor_leaves_the_shift_at_the_click_rate() -> None:
    """Logits that rank backwards want ``a < 0``; ``a`` stops at ``min_scale``, and ``b`` took the step of the joint
    Newton solve, which assumed ``a`` went negative: on a stream clicked at 22% the served mean fell to 5% and kept
    falling fit after fit. With ``a`` held, ``b`` takes the best step for the ``a`` served."""
    rng = np.random.default_rng(4)
    z = rng.normal(-2.0, 2.0, 5_000)
    y = (rng.random(5_000) < 1 / (1 + np.exp(z + 4.0))).astype(np.float64)  # clicks where the model says least
    cal = OnlineCalibration()
    for _ in range(6):
        cal.fit(z, y)
    served = 1 / (1 + np.exp(-(cal.a * z + cal.b)))
    assert cal.a == cal.min_scale
    assert served.mean() == pytest.approx(y.mean(), rel=0.1)


@pytest.mark.parametrize(("logit", "label"), [(-1e4, 1.0), (65504.0, 0.0), (-3.38e38, 1.0)],
                         ids=["1e4", "float16_max", "bfloat16_max"])
def test_one_row_with_an_extreme_logit_neither_swings_nor_freezes_the_calibration(logit: float, label: float) -> None:
    """A row's pull on ``a`` is its residual times its logit, and a saturated row has no curvature to hold it: one
    confidently wrong row at 1e4 or at float16's limit (a diverging model under AMP), among 256, took a calibration
    fitted on 50 k rows from ``a`` = 1 to ``min_scale`` and ``b`` to -1.3; one at bfloat16's limit put 4e42 into ``H``
    instead, which froze ``a`` for millions of rows. The fit reads logits within the probabilities it can tell
    apart (1e-7 to 1 - 1e-7)."""
    rng = np.random.default_rng(5)

    def rows(n: int, spread: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        t = rng.normal(-2.0, 1.0, n)  # clicks at sigmoid(t); the model says spread * t
        return spread * t, (rng.random(n) < 1 / (1 + np.exp(-t))).astype(np.float64)

    cal = OnlineCalibration()
    for _ in range(50):
        cal.fit(*rows(1000))
    before = (cal.a, cal.b)
    z, y = rows(256)
    cal.fit(np.append(z, logit), np.append(y, label))
    assert cal.a == pytest.approx(before[0], abs=0.02) and cal.b == pytest.approx(before[1], abs=0.05)
    for _ in range(40):  # the model turns twice too confident: the calibration still follows
        cal.fit(*rows(1000, spread=2.0))
    assert cal.a < 0.75


@pytest.mark.parametrize("shift", [10.0, 6.0, -8.0])
@pytest.mark.parametrize("first_group", [1_000, 20_000])
def test_a_model_far_off_the_click_rate_is_calibrated_without_a_newton_swing(shift: float, first_group: int) -> None:
    """Logits ``shift`` nats off the click rate (a model that learned through a click outage, or diverged): its rows
    sit where the sigmoid saturates, with next to no curvature, and one undamped Newton step per group took ``b``
    from 0 to -166 (shift 10, a group of 20 k rows: every score served as 0) and ``a`` from bound to bound, fit
    after fit. The fit now finds each group's posterior mode (damped Newton, as the cited algorithm does): the
    prior, cheap in ``a`` for logits far from 0, shrinks them first, and ``a`` comes back as evidence builds up."""
    rng = np.random.default_rng(6)

    def rows(n: int) -> tuple[np.ndarray, np.ndarray]:
        t = rng.normal(-2.0, 1.0, n)  # clicks at sigmoid(t); the model says t + shift
        return t + shift, (rng.random(n) < 1 / (1 + np.exp(-t))).astype(np.float64)

    cal = OnlineCalibration()
    cal.fit(*rows(first_group))
    fits = [(cal.a, cal.b)]
    for _ in range(10):
        cal.fit(*rows(1_000))
        fits.append((cal.a, cal.b))
    a = np.array(fits)[:, 0]
    assert np.all(np.diff(a) > -1e-3) and np.all(a < 1.5)  # a comes back toward 1 from where it went, no swing
    z, y = rows(50_000)
    served = 1 / (1 + np.exp(-(cal.a * z + cal.b)))
    assert served.mean() == pytest.approx(y.mean(), rel=0.2) and np.median(served) > 0.05  # not all 0 (or 1)


@pytest.mark.parametrize("h", [[[4e42, 0.0], [0.0, 4e42]], [[np.nan, 0.0], [0.0, 1.0]]])
def test_a_checkpointed_curvature_no_fit_can_make_is_restarted_from_the_prior_not_kept_frozen(h) -> None:
    """A checkpoint of a version without the logit clip could hold ``H`` ~4e42 (one bfloat16-limit logit): loaded as
    it was, each fit moved ``(a, b)`` by its inverse (nothing) and the calibration stayed frozen after the upgrade.
    A non-finite ``H`` is no better. Such an ``H`` restarts from the prior; ``(a, b)`` are kept."""
    rng = np.random.default_rng(11)
    cal = OnlineCalibration()
    cal.load_state_dict({"a": 1.0, "b": -0.1, "h": h, "rows": 5_000_000})
    assert (cal.a, cal.b) == (1.0, -0.1)
    for _ in range(40):  # the model turns twice too confident: the calibration follows
        t = rng.normal(-2.0, 1.0, 1000)
        cal.fit(2.0 * t, (rng.random(1000) < 1 / (1 + np.exp(-t))).astype(np.float64))
    assert cal.a < 0.75


def test_a_checkpointed_scale_and_shift_that_cannot_be_served_load_as_the_identity_or_within_bounds() -> None:
    cal = OnlineCalibration()
    cal.load_state_dict({"a": float("nan"), "b": 0.3})
    assert (cal.a, cal.b) == (1.0, 0.0)
    cal.load_state_dict({"a": 40.0, "b": 0.3})
    assert (cal.a, cal.b) == (cal.max_scale, 0.3)


def test_a_curvature_built_by_fits_round_trips_unchanged() -> None:
    rng = np.random.default_rng(12)
    cal = OnlineCalibration()
    for _ in range(30):
        t = rng.normal(-2.0, 1.0, 4000)
        cal.fit(np.clip(t * 50, -40, 40), (rng.random(4000) < 1 / (1 + np.exp(-t))).astype(np.float64))
    copy = OnlineCalibration()
    copy.load_state_dict(cal.state_dict())
    assert np.array_equal(copy.h, cal.h) and cal.h[0, 0] <= cal.max_curvature()


def _with_pending() -> tuple[OnlineCalibration, list, dict]:
    batches, _ = stream(4_000, scale=2.0)
    cal = OnlineCalibration(max_pending=500)
    run(cal, batches[: len(batches) // 2])
    state = cal.state_dict()
    assert cal.pending and len(state["pending_chunks"]) > 1
    return cal, batches[len(batches) // 2:], state


def _set(name: str, value) -> object:  # noqa: ANN001 - a state edit: the value, or a function of the old one
    return lambda d: d.__setitem__(name, value(d[name]) if callable(value) else value)


CORRUPT_PENDING = {
    "an_empty_batch": (_set("pending_chunks", lambda c: [0, *c]), "pending_chunks"),  # max() of no times
    "batches_past_the_ids": (_set("pending_chunks", lambda c: [*c[:-1], c[-1] + 3]), "pending_chunks"),
    "negative_batch": (_set("pending_chunks", lambda c: [-1, *c[:-1], c[-1] + 1]), "pending_chunks[0]"),
    "short_labels": (_set("pending_labels", lambda t: t[:-1]), "pending_labels holds"),
    "nan_label": (_set("pending_labels", lambda t: t.index_fill(0, torch.tensor([0]), float("nan"))), "nan"),
    "label_of_two": (_set("pending_labels", lambda t: t.index_fill(0, torch.tensor([0]), 2.0)), "2.0"),
    "negative_rows": (_set("rows", -4), "rows"),
    # a time that is no integer: through astype(int64) NaN was INT64_MIN, its pair matured at once
    "nan_time": (_set("pending_ts", lambda t: t.double().index_fill(0, torch.tensor([0]), float("nan"))),
                 "pending_ts: nan is not a time in integer ms"),
    "fractional_time": (_set("pending_ts", lambda t: t.double().index_fill(0, torch.tensor([0]), 1.5)),
                        "pending_ts: 1.5 is not a time in integer ms"),
    # a field missing or of another type: a bare KeyError, or read as something else
    "no_logits": (lambda d: d.pop("pending_logits"), "pending_logits is missing"),
    "ids_as_text": (_set("pending_ids", "i1"), "pending_ids is 'i1', not a list"),
    "columns_without_ids": (lambda d: d.pop("pending_ids"), "pending_chunks"),  # its pairs were dropped unsaid
    "scale_as_text": (_set("a", "0.5"), "a is '0.5', not a number"),
    "scale_as_bool": (_set("b", True), "b is True, not a number"),
    # cut at 80 characters saying nothing (repr(v)[:80] left the quote open): how many were left out said
    "scale_as_long_text": (_set("a", "0" * 5000), "a is '" + "0" * 78 + "'... (4,922 more chars), not a number"),
    "curvature_of_three": (_set("h", [1.0, 0.0, 1.0]), "h holds 3 values"),
    "logits_as_text": (_set("pending_logits", "1, 2"), "pending_logits is '1, 2'"),
    "first_layout_not_rows_of_three": (_set("pending", torch.zeros(4)), "pending holds 4 values"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT_PENDING))
def test_calibration_pending_pairs_no_batch_makes_are_refused_at_load_naming_the_value(case: str) -> None:
    """A damaged or edited checkpoint's pending pairs are refused when loaded (the restore uses the previous
    checkpoint): an empty batch of them raised at every batch once it was due to mature (``max()`` of no times), a
    labels column shorter than the logits paired them with other rows' and raised, each batch's messages struck;
    a NaN label fitted ``(a, b)`` to NaN, served from then on."""
    cal, rest, state = _with_pending()
    edit, named = CORRUPT_PENDING[case]
    edit(state)
    fresh = OnlineCalibration(max_pending=500)
    with pytest.raises(ValueError, match=r"calibration state \(calibration\)") as err:
        fresh.load_state_dict(state)
    assert named in str(err.value)
    run(fresh, rest)  # the batches after it still train (nothing of the refused state was kept)
    assert np.isfinite([fresh.a, fresh.b]).all()


def _first_layout(cal: OnlineCalibration) -> dict:
    """``cal``'s state as the first layout saved it (until 7085d2c): ids, and rows (n, 3) of (logit, ts, label) with
    each click already in its label."""
    state = cal.state_dict()
    ids = state.pop("pending_ids")
    clicked = torch.tensor([i in cal.clicked for i in ids], dtype=torch.float64)
    rows = torch.stack([state.pop("pending_logits"), state.pop("pending_ts").double(),
                        torch.maximum(state.pop("pending_labels"), clicked)], dim=1)  # (n, 3)
    del state["pending_chunks"], state["clicked"]
    return {**state, "pending_ids": ids, "pending": rows}


def test_a_calibration_state_of_the_first_layout_is_migrated_and_fits_the_same_pairs() -> None:
    """A checkpoint of the first layout (its pending pairs as one (n, 3) tensor) raised a bare KeyError
    'pending_logits' at load: it loads, each pair its own batch (as it matured then), its clicks in its labels, and
    the pairs are fitted as by the calibration that saved it (one alone may mature before its batch would)."""
    cal, rest, _ = _with_pending()
    assert cal.clicked  # (some pending impressions were clicked: their labels carry it in the first layout)
    old = OnlineCalibration(max_pending=500)
    old.load_state_dict(_first_layout(cal))
    assert (old.pending, old.a, old.b, old.rows) == (cal.pending, cal.a, cal.b, cal.rows)
    assert len(old.chunks) == old.pending and not old.clicked
    run(cal, rest)
    run(old, rest)
    assert cal.rows <= old.rows <= cal.rows + 256
    assert (old.a, old.b) == pytest.approx((cal.a, cal.b), rel=0.05)


def test_a_first_layout_checkpoint_long_past_its_warm_up_takes_the_next_observed_impressions_as_the_old_code_did(
        ) -> None:
    """The first layout kept the stream's start as one ``first_ms`` (an int). Counted as one row of the quorum, the
    first batch after the upgrade moved the start to the restart (its 16th smallest time), and the calibration took a
    maturity_s of a stream an hour old for a fresh stream's warm-up: none of its observed impressions was fitted,
    where the code that wrote the checkpoint took them all."""
    day = 1_700_000_000_000
    first_layout = {"a": 1.0, "b": 0.0, "h": (np.eye(2) * 90.0).tolist(), "rows": 5_000, "now_ms": day + 3_600 * SECOND,
                    "first_ms": day, "pending_ids": [], "pending": torch.zeros(0, 3, dtype=torch.float64)}
    cal = OnlineCalibration(maturity_s=300)
    cal.load_state_dict(first_layout)
    n = 64
    ts = np.full(n, day + 3_601 * SECOND, np.int64)
    cal.observe(np.array([f"i{k}" for k in range(n)], object), np.full(n, OBSERVED, np.int8), np.zeros(n),
                np.zeros(n), ts, np.zeros(n, np.int64))
    assert cal.first_ms == day and cal.pending == n
