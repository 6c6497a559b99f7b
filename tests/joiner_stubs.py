"""Stand-ins for the join pipeline in tests of the drivers' consumer callbacks, which use only part of it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def assigning_pipeline(**parts: Any) -> Any:
    """A pipeline whose partition layout takes every assignment (stream/joiner/partitions.py) and whose restores find
    no input topic made again (``started_over``), nor a running one (``check_topics``), with ``parts``."""
    stub = SimpleNamespace(layout=SimpleNamespace(assigned=lambda partitions: list(partitions)),
                           below_applied=lambda records: set(), regressed=lambda partitions: None,
                           check_topics=lambda: None, topics_due=lambda: False,
                           **{"started_over": set(), **parts})
    if "take_started_over" not in parts:
        def take_started_over() -> set[tuple[str, int]]:
            again, stub.started_over = stub.started_over, set()
            return again

        stub.take_started_over = take_started_over
    return stub
