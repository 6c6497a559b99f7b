"""A publish resolves what earlier runs fired (cache_refresh/alerts.py ``RefreshAlerts.resolve_firing``): one resolved
record per fingerprint, however many times it fired; the record started afresh. The end-to-end case (a failed run,
then a publish of another process) is tests/integration/test_refresh_outcomes.py's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cache_refresh.alerts import FIRING
from cache_refresh.publish import clean_leftovers
from tests.unit.cache_refresh.test_overlap import RecordedAlerts


def test_an_alert_fired_every_minute_for_months_resolves_once_with_the_others(tmp_path: Path) -> None:
    """More lines than a state file may hold (16 MB: a per-minute schedule failing for ~3 months), a line of
    something else and a line longer than any record: each fingerprint resolved once, the rest skipped."""
    line = json.dumps({"rule": "refresh_failed", "severity": "critical", "labels": {"stage": "hot_set"}}) + "\n"
    with open(tmp_path / FIRING, "w") as f:
        f.write(line * (17_000_000 // len(line) + 1))
        f.write("not json\n" + "x" * 200_000 + "\n")
        f.write(json.dumps({"rule": "refresh_pinned", "severity": "warning", "labels": {"stage": "publish"}}) + "\n")
    alerts = RecordedAlerts()
    alerts.record_in(tmp_path)
    assert alerts.resolve_firing("v2") == 2
    assert sorted((a.rule, a.state.value, a.severity.value, dict(a.labels)) for a in alerts.fired) == [
        ("refresh_failed", "resolved", "critical", {"stage": "hot_set"}),
        ("refresh_pinned", "resolved", "warning", {"stage": "publish"})]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # taken: the next publish resolves nothing again
    assert alerts.resolve_firing("v3") == 0


def test_an_alert_fired_after_the_record_was_taken_waits_for_the_next_publish(tmp_path: Path) -> None:
    """Fired alerts are appended; one fired once a publish has resolved the record is resolved by the next."""
    alerts = RecordedAlerts()
    alerts.record_in(tmp_path)
    first = alerts.fire("checkpoint", "no checkpoint", "refresh_failed")
    assert alerts.resolve_firing("v1") == 1
    later = alerts.fire("lock", "another run", "refresh_skipped", severity="warning")
    assert alerts.resolve_firing("v2") == 1
    assert [(a.fingerprint, a.state.value) for a in alerts.fired] == [
        (first.fingerprint, "firing"), (first.fingerprint, "resolved"),
        (later.fingerprint, "firing"), (later.fingerprint, "resolved")]


KILLED_WHILE_RESOLVING = """
import os, sys
from pathlib import Path
from stream.config import KafkaSettings
from cache_refresh.alerts import RefreshAlerts
alerts = RefreshAlerts(KafkaSettings(), "", publish_root=Path(sys.argv[1]))
alerts.fire("checkpoint", "no checkpoint", "refresh_failed")
RefreshAlerts._send = lambda self, alert: os._exit(9)  # killed once FIRING is aside, before a resolved record is sent
alerts.resolve_firing("v1")
"""


def test_alerts_of_a_publish_killed_while_resolving_them_are_resolved_by_the_next_publish(tmp_path: Path) -> None:
    """A process killed between renaming FIRING aside and sending the resolved records: the aside had a temp name,
    removed by the next run's ``clean_leftovers``, and its alerts stayed firing for ever. Now the next publish resolves
    them (with what fired since), once: the publish after it resolves nothing."""
    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_RESOLVING, str(tmp_path)], check=False,
                            cwd=Path(__file__).resolve().parents[3])
    assert killed.returncode == 9
    assert not (tmp_path / FIRING).exists()  # taken aside by the killed publish
    assert clean_leftovers(tmp_path) == []  # the next run's first stage: the aside is no leftover of a temp write
    alerts = RecordedAlerts()
    alerts.record_in(tmp_path)
    later = alerts.fire("lock", "another run", "refresh_skipped", severity="warning")
    assert alerts.resolve_firing("v2") == 2
    assert sorted((a.rule, a.state.value, a.labels["stage"]) for a in alerts.fired[1:]) == [
        ("refresh_failed", "resolved", "checkpoint"), ("refresh_skipped", "resolved", "lock")]
    assert later.fingerprint in {a.fingerprint for a in alerts.fired[1:]}
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert alerts.resolve_firing("v3") == 0


def test_a_record_that_cannot_be_read_is_kept_and_resolved_by_a_later_publish(tmp_path: Path, monkeypatch) -> None:
    """A read error (EIO) on the record taken aside: its alerts stay firing, and the record stays for the next
    publish to resolve (it was removed unread, its alerts never resolved)."""
    import errno

    import cache_refresh.alerts as mod

    alerts = RecordedAlerts()
    alerts.record_in(tmp_path)
    alerts.fire("checkpoint", "no checkpoint", "refresh_failed")
    real = mod.open_regular

    def failing(path: Path, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(mod, "open_regular", failing)
    assert alerts.resolve_firing("v1") == 0
    assert [p.name for p in tmp_path.iterdir() if p.name != FIRING]  # the aside, kept
    monkeypatch.setattr(mod, "open_regular", real)
    assert alerts.resolve_firing("v2") == 1
    assert [a.state.value for a in alerts.fired] == ["firing", "resolved"]
    assert list(tmp_path.iterdir()) == []
