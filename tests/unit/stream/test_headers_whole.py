"""``stream.kafka.headers_whole``: the kafka driver's batch-wide form of ``headers_of``'s check for a pair that
confluent-kafka left with an empty slot (a header key that is not UTF-8), one C-level call for all of a batch's
pairs."""

from __future__ import annotations

import ctypes
from typing import Any

from stream.kafka import headers_whole


def _pair_with_an_empty_key_slot(value: bytes) -> tuple[Any, ...]:
    """A (key, value) pair as confluent-kafka builds it for a key it cannot decode: the key's slot left NULL."""
    new = ctypes.pythonapi.PyTuple_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_ssize_t]
    pair = new(2)  # both slots NULL
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(value))  # the slot's reference
    slot = id(pair) + tuple.__basicsize__ + ctypes.sizeof(ctypes.c_void_p)  # ob_item[1]
    ctypes.c_void_p.from_address(slot).value = id(value)
    return pair  # never read its key: it is NULL


def test_one_broken_pair_among_many_whole_ones_makes_the_batch_not_whole() -> None:
    whole: list[Any] = [None, [("traceparent", b"00-a"), ("x", None)], [], [("k", b"v")]]
    assert headers_whole(whole) and headers_whole([]) and headers_whole([None, None])
    broken = [*whole, [("ok", b"y"), _pair_with_an_empty_key_slot(b"z")], [("k", b"v")]]
    assert not headers_whole(broken)


def test_the_kafka_driver_marks_the_message_of_a_broken_pair_that_raised_nothing_and_keeps_the_others_headers() -> None:
    # a headers() that handed back its broken list without raising (headers_of: a call site that does not check)
    from confluent_kafka import Message

    from stream.errors import BadMessage
    from stream.joiner.kafka_driver import _headers

    good = [("traceparent", b"00-a")]
    msgs = [Message(topic="t", partition=0, offset=i, key=b"k", value=b"v", headers=h)
            for i, h in enumerate([None, good, [("ok", b"y"), _pair_with_an_empty_key_slot(b"z")], good])]
    got = _headers(msgs)
    assert got[0] is None and got[1] == good and got[3] == good
    assert isinstance(got[2], BadMessage) and got[2].kind == "bad_header"
