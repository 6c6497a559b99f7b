"""How a user's event log maps onto events: :class:`ColumnMap` (the CLI's ``--*-col`` flags, :data:`FLAGS`), the
time units, and :class:`EventLogError`, the error for a log that cannot be read as mapped (``eventlog.py`` says the
rules)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from stream.errors import ConfigError

TIME_UNITS = ("s", "ms", "us", "ns", "iso")
DATASET_SETTING = "--dataset ([replay] dataset)"  # the setting that names the event log, in error messages

# The CLI flag that sets each ColumnMap field (named in error messages).
FLAGS = {
    "user": "--user-col", "item": "--item-col", "time": "--time-col", "time_unit": "--time-unit",
    "impression_id": "--impression-id-col", "clicked": "--clicked-col", "click_time": "--click-time-col",
    "features": "--feature-cols", "dense": "--dense-cols",
}
class EventLogError(ConfigError):
    """The event log cannot be read as mapped (missing column, unknown format, unusable type).

    A ``ValueError`` (via :class:`~stream.errors.ConfigError`, so the CLI reports it as a
    usage error); the message names the file, the column and the flag that fixes it.
    """


@dataclass(frozen=True)
class ColumnMap:
    """Which column of the file holds what (defaults match the CLI flags' defaults)."""

    user: str = "user_id"
    item: str = "item_id"
    time: str = "ts"
    # one of s, ms, us, ns, iso (ISO-8601 strings or Arrow timestamp columns); None (the default, here as in the
    # CLI when --time-unit is not given): ms, checked: numbers that are all before 1973 as ms are refused (epoch
    # seconds?). An explicit "ms" reads them as they are
    time_unit: str | None = None
    impression_id: str | None = None  # None -> generated f"{file_stem}-{row:09d}"
    clicked: str | None = "clicked"  # truthy (1/true/yes) -> a click follows after a delay; None -> no clicks
    click_time: str | None = None  # the click's own time (same unit), when present; overrides the delay
    features: tuple[str, ...] = ()  # categorical/multi-valued context columns, passed as context
    dense: tuple[str, ...] = ()  # numeric columns passed as dense features

    def roles(self) -> list[tuple[str, str]]:
        """``(ColumnMap field, column name)`` of every mapped column, in a stable order."""
        out: list[tuple[str, str]] = []
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "time_unit" or v is None:
                continue
            for col in (v,) if isinstance(v, str) else v:
                out.append((f.name, col))
        return out
