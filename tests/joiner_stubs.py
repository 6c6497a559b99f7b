"""Stand-ins for the join pipeline in tests of the drivers' consumer callbacks, which use only part of it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def assigning_pipeline(**parts: Any) -> Any:
    """A pipeline whose partition layout takes every assignment (stream/joiner/partitions.py) and whose restores find
    no input topic made again (``started_over``), with ``parts``."""
    return SimpleNamespace(layout=SimpleNamespace(assigned=lambda partitions: list(partitions)),
                           **{"started_over": set(), **parts})
