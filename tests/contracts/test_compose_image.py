"""Contract: the compose deployment's image can write where compose mounts its state.

A named volume mounted on a directory the image does not have is created owned by root, and the services run as the
image's non-root user: a learner whose deltas directory was such a volume could not write one delta (each write
failed, counted, and serving never got fresher than the nightly artifact). The Dockerfile creates every such
directory, owned by that user, so a fresh volume inherits the ownership."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
STATE = "/var/lib/streamrec"


def _made_by_the_image() -> set[str]:
    text = (COMPOSE / "Dockerfile").read_text().replace("\\\n", " ")
    made: set[str] = set()
    for line in text.splitlines():
        if line.startswith("RUN "):
            for cmd in re.split(r"&&|;", line[4:]):
                words = shlex.split(cmd)
                if words[:2] == ["mkdir", "-p"]:
                    made.update(w.rstrip("/") for w in words[2:])
    return made


def _named_volume_mounts() -> dict[str, str]:
    """target -> service, for every named volume an app service mounts under /var/lib/streamrec."""
    out: dict[str, str] = {}
    for name in ("docker-compose.yml", "docker-compose.layered.yml"):
        services = (yaml.safe_load((COMPOSE / name).read_text()) or {}).get("services") or {}
        for svc, spec in services.items():
            for v in (spec or {}).get("volumes", []):
                source, _, rest = str(v).partition(":")
                target = rest.split(":")[0]
                if target.startswith(STATE) and not source.startswith((".", "/")):
                    out[target.rstrip("/")] = svc
    return out


def test_every_state_volume_is_a_directory_the_image_makes_for_its_user() -> None:
    mounts = _named_volume_mounts()
    assert {"/var/lib/streamrec/checkpoints", "/var/lib/streamrec/deltas"} <= set(mounts)  # the parser reads them
    made = _made_by_the_image()
    missing = {t: svc for t, svc in mounts.items() if t not in made}
    assert not missing, f"named volumes on directories the Dockerfile does not create (root-owned): {missing}"


def test_the_monitor_keeps_its_firing_alerts_on_a_volume() -> None:
    spec = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]["monitor"]
    command = spec["command"]
    state = command[command.index("--state-path") + 1]
    assert any(state.startswith(target + "/") for target, svc in _named_volume_mounts().items() if svc == "monitor")
