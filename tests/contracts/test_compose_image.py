"""Contract: the compose deployment's image can write where compose mounts its state.

A named volume mounted on a directory the image does not have is created owned by root, and the services run as the
image's non-root user: a learner whose deltas directory was such a volume could not write one delta (each write
failed, counted, and serving never got fresher than the nightly artifact). The Dockerfile creates every such
directory, owned by that user, so a fresh volume inherits the ownership.

The broker does not create topics on first use (``KAFKA_AUTO_CREATE_TOPICS_ENABLE: false``): the one-shot ``topics``
service creates every topic the code names by default, and compose/README.md lists what it creates (the joiner's
state log was missing from that list)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from cache_refresh.settings import RefreshSettings
from monitor.rules import load_rules
from stream.config import KafkaSettings
from stream.joiner.config import JoinerSettings
from stream.joiner.state_log import state_topic

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


def _topics_compose_creates() -> set[str]:
    """The topics the one-shot ``topics`` service's script creates (its ``for t in ...`` list and its ``--topic``s)."""
    script = " ".join(yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]["topics"]["command"])
    created = {w for m in re.finditer(r"\bfor t in ([^;]*);", script) for w in m.group(1).split()}
    created |= {name for name in re.findall(r"--topic\s+(\S+)", script) if not name.startswith('"')}
    return created


def test_compose_creates_every_topic_the_code_names_and_its_readme_lists_them() -> None:
    kafka, joiner = KafkaSettings(), JoinerSettings()
    inputs = (kafka.impressions_topic, kafka.clicks_topic, kafka.samples_topic)
    needed = {*inputs, *(t + kafka.dlq_suffix for t in inputs), joiner.late_clicks_topic, state_topic(joiner.app_id),
              RefreshSettings().alerts_topic, load_rules(str(COMPOSE / "alert-rules.toml")).sinks.kafka_topic}
    created = _topics_compose_creates()
    assert "samples" in created, "the parser no longer reads the topics service's script"
    assert not needed - created, f"topics the code uses by default that compose never creates: {needed - created}"
    row = next(line for line in (COMPOSE / "README.md").read_text().splitlines() if line.startswith("| `topics`"))
    unlisted = sorted(t for t in created if f"`{t}`" not in row)
    assert not unlisted, f"compose/README.md's topics row does not list {unlisted}, which the topics service creates"
