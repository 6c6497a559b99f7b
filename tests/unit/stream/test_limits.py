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


@pytest.mark.parametrize("ok", [0, 0.0, 1.5, 3600, 1e9])
def test_finite_future_ts_s_decodes_an_event_with_a_broker_timestamp(ok: float) -> None:
    limits = EventLimits(future_ts_s=ok)
    raw = b'{"schema_version":1,"impression_id":"a","ts":1000,"user_id":1,"item_id":2}'
    assert decode_impression(raw, limits, broker_ts_ms=5000).ts == 1000
    assert limits.future_ts_ms == int(ok * 1000)
