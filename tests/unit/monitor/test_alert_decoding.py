"""``Alert.from_json`` reads alerts back (external readers of the alerts topic, the tests): any bytes decode to an
alert or raise one ValueError saying what is wrong (not JSON, nested too deep, a missing key, a wrong type), never
KeyError, TypeError, AttributeError, OverflowError or RecursionError."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from monitor.alerts import Alert, AlertState, Severity

_GOOD: dict[str, Any] = json.loads(Alert(rule="r", source="s", severity=Severity.WARNING, state=AlertState.FIRING,
                                         value=0.5, threshold=0.1, message="m", ts=1, labels={"a": "b"}).to_json())


@pytest.mark.parametrize(("data", "said"), [
    (b"\xff", "not JSON"),
    (b"{", "not JSON"),
    (b"[" * 100_000, "nested too deep"),
    (b"[]", "not a JSON object"),
    (json.dumps({k: v for k, v in _GOOD.items() if k != "rule"}), "missing 'rule'"),
    (json.dumps({k: v for k, v in _GOOD.items() if k != "ts"}), "missing 'ts'"),
    (json.dumps({**_GOOD, "rule": 5}), "'rule'"),
    (json.dumps({**_GOOD, "message": ["x"]}), "'message'"),
    (json.dumps({**_GOOD, "labels": [["a", "b"]]}), "'labels'"),
    (json.dumps({**_GOOD, "labels": {"a": 1}}), "'labels'"),
    (json.dumps({**_GOOD, "value": [1]}), "'value'"),
    (json.dumps({**_GOOD, "value": "x"}), "'value'"),
    (json.dumps({**_GOOD, "value": 10 ** 400}), "'value'"),  # OverflowError escaped
    (json.dumps({**_GOOD, "value": 2 ** 1024 - 2 ** 970}), "'value'"),  # the first integer float() rounds to inf
    (json.dumps({**_GOOD, "ts": "12"}), "'ts'"),
    (json.dumps({**_GOOD, "ts": 1.5}), "'ts'"),
    (json.dumps({**_GOOD, "ts": True}), "'ts'"),
    (json.dumps({**_GOOD, "severity": "loud"}), "'severity'"),
    (json.dumps({**_GOOD, "severity": {}}), "'severity'"),
    (json.dumps({**_GOOD, "kind": "other"}), "'kind'"),
    (json.dumps({**_GOOD, "fingerprint": 5}), "'fingerprint'"),
    ('{"rule": "r", "source": "s", "severity": "warning", "state": "firing", "value": NaN, "threshold": null, '
     '"message": "m", "ts": Infinity}', "'ts'"),
])
def test_a_malformed_alert_record_is_a_value_error_saying_what_is_wrong(data: bytes | str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        Alert.from_json(data)


def test_a_record_an_older_writer_sent_still_reads() -> None:
    old = {k: v for k, v in _GOOD.items() if k not in ("kind", "fingerprint")}
    assert Alert.from_json(json.dumps(old)) == Alert.from_json(json.dumps(_GOOD))
    assert Alert.from_json(json.dumps({**_GOOD, "value": "+Inf", "threshold": None})).value == float("inf")
    biggest = 2 ** 1024 - 2 ** 970 - 1  # an integer JSON may carry that is still a float
    assert Alert.from_json(json.dumps({**_GOOD, "value": biggest})).value == float(biggest)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
                     max_leaves=8)
_records = st.one_of(
    st.binary(max_size=100),
    _json.map(json.dumps),
    st.builds(lambda k, v: json.dumps({**_GOOD, k: v}), st.sampled_from(sorted(_GOOD)), _json),
    st.builds(lambda k: json.dumps({x: v for x, v in _GOOD.items() if x != k}), st.sampled_from(sorted(_GOOD))))


@example(b"[" * 100_000)
@example(b'{"rule":' * 100_000)
@example(json.dumps({**_GOOD, "value": float("nan")}))
@given(_records)
@settings(max_examples=150, deadline=None)
def test_any_record_decodes_to_a_well_typed_alert_or_is_a_value_error(data: bytes | str) -> None:
    try:
        a = Alert.from_json(data)
    except ValueError as exc:
        assert str(exc).strip()
        return
    assert all(isinstance(x, str) for x in (a.rule, a.source, a.message, a.fingerprint))
    assert type(a.ts) is int and (a.value is None or type(a.value) is float)
    assert (a.threshold is None or type(a.threshold) is float)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in a.labels.items())
    assert Alert.from_json(a.to_json()).to_json() == a.to_json()  # writes back as itself (NaN != NaN: the bytes)


def test_a_record_whose_labels_hold_a_lone_surrogate_decodes_with_a_fingerprint_of_its_own() -> None:
    """``"\\udc80"`` is valid JSON for a lone surrogate: an older writer's record (no fingerprint) holding one raised
    UnicodeEncodeError computing its fingerprint, and so did every Alert made with such a label."""
    lone = {k: v for k, v in _GOOD.items() if k not in ("kind", "fingerprint")}
    a = Alert.from_json(json.dumps({**lone, "labels": {"a": "\udc80"}}))
    b = Alert.from_json(json.dumps({**lone, "labels": {"a": "\udc81"}}))
    assert a.labels == {"a": "\udc80"} and len(a.fingerprint) == 16 and a.fingerprint != b.fingerprint
    assert Alert.from_json(a.to_json()) == a  # and it round-trips through what the sinks send
    assert 'a="\\udc80"' in a.describe() and a.describe().encode()  # the log sink's line can be written
    assert Alert.from_json(json.dumps(lone)).fingerprint == _GOOD["fingerprint"]  # other fingerprints unchanged
