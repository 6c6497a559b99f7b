"""EventLimits refuses bounds the decoders cannot apply (an infinite ``future_ts_s`` made every event with a broker
timestamp raise OverflowError in ``future_ts_ms`` instead of decoding)."""

import math

import pytest

from stream.events import decode_impression
from stream.limits import EventLimits


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, -1.0, "3600", True, None])
def test_future_ts_s_must_be_a_finite_number_of_seconds(bad: object) -> None:
    with pytest.raises(ValueError, match="future_ts_s"):
        EventLimits(future_ts_s=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("ok", [0, 0.0, 1.5, 3600, 3e8])
def test_finite_future_ts_s_decodes_an_event_with_a_broker_timestamp(ok: float) -> None:
    limits = EventLimits(future_ts_s=ok)
    raw = b'{"schema_version":1,"impression_id":"a","ts":1000,"user_id":1,"item_id":2}'
    assert decode_impression(raw, limits, broker_ts_ms=5000).ts == 1000
    assert limits.future_ts_ms == int(ok * 1000)


@pytest.mark.parametrize("raw", ["1e306", "3.2e8"])
def test_a_future_ts_s_past_ten_years_is_refused_naming_the_setting(raw: str) -> None:
    # 1e306 is finite and passed; the first decoded event then raised OverflowError in future_ts_ms (1e309 ms is inf),
    # a traceback in the joiner and the audit. Every other duration is bounded by ten years (DURATION_CAP_S).
    from streamrec.settings import SettingsError, build

    with pytest.raises(SettingsError, match=r"\[limits\] future_ts_s.*<= 3\.15\d*e\+08.*STREAMREC_LIMITS_FUTURE_TS_S"):
        build(EventLimits, "limits", {}, {"STREAMREC_LIMITS_FUTURE_TS_S": raw})
    assert build(EventLimits, "limits", {}, {"STREAMREC_LIMITS_FUTURE_TS_S": "3.1e8"}).future_ts_ms == 310_000_000_000
