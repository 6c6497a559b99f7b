"""A holdout message of the samples topic that does not decode as samples (``cache_refresh/validate.py``
``read_holdout``) is left out of the quality check with a warning saying how many were and why. Before, it was dropped
without a word: the AUCs were compared on fewer samples than ``holdout_messages`` (a topic of mostly foreign or
damaged messages, on a handful) and nothing said so."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from cache_refresh import validate
from stream.config import KafkaSettings
from stream.samples import SampleBatch


class _Message:
    def __init__(self, value: bytes) -> None:
        self._value = value

    def partition(self) -> int:
        return 0

    def value(self) -> bytes:
        return self._value

    def offset(self) -> int:
        return 7


def _samples(n: int) -> bytes:
    return SampleBatch.from_columns(
        impression_id=[f"i{k}" for k in range(n)], ts=np.arange(n) * 1000, label=np.arange(n) % 2,
        label_delay_ms=np.zeros(n), user_id=np.arange(n), item_id=np.arange(n), history=[[1]] * n).encode()


def test_holdout_messages_that_are_no_samples_are_counted_in_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    messages = [_Message(_samples(4)), _Message(b"not arrow at all"), _Message(_samples(3))]
    monkeypatch.setattr(validate, "watermarks", lambda *_a, **_k: {0: (0, len(messages))})

    def read_to_end(_kafka: Any, _topic: str, handle: Any, **_k: Any) -> list[int]:
        for m in messages:
            handle(m)
        return [0]

    monkeypatch.setattr(validate, "read_to_end", read_to_end)
    with caplog.at_level(logging.WARNING, logger="streamrec.refresh"):
        batches = validate.read_holdout(KafkaSettings(), 10, 5.0)
    assert [len(b) for b in batches] == [4, 3]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "1 of the 3 holdout messages" in warned[0] and "not an Arrow IPC stream" in warned[0]
