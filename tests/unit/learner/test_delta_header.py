"""A delta's header (kind, format) that is not the string and integer this streamrec writes is a DeltaError, whatever
value sits there (a fuzz case once found a tensor there answering ``!=`` with a tensor: a RuntimeError)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from learner import tensorpack
from learner.deltas import FORMAT, KIND, DeltaError, decode_delta


@pytest.mark.parametrize("kind, fmt", [
    (KIND, torch.zeros(0, dtype=torch.int64)), (KIND, torch.tensor([2, 2])), (KIND, torch.tensor(2)),
    (torch.zeros(0), FORMAT), (KIND, "2"), (KIND, None), (KIND, 2.5), (None, FORMAT), ("other", FORMAT),
])
def test_a_kind_or_format_other_than_this_streamrecs_is_a_delta_error(kind: Any, fmt: Any) -> None:
    raw = tensorpack.pack({"kind": kind, "format": fmt})
    with pytest.raises(DeltaError, match="this streamrec reads kind"):
        decode_delta(raw, Path("d.delta"))


def test_a_delta_of_a_newer_format_is_refused_saying_to_upgrade_serving() -> None:
    """A newer learner's delta read by this serving (a rolling upgrade that reached the learner first): refused, and
    the error says what to do about it."""
    raw = tensorpack.pack({"kind": KIND, "format": FORMAT + 1})
    with pytest.raises(DeltaError, match=rf"format {FORMAT + 1}, this streamrec reads .*newer.*upgrade serving"):
        decode_delta(raw, Path("d.delta"))
