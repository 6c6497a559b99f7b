"""Nothing is exposed by default: the joiner's, learner's and monitor's Prometheus metrics listeners bind
loopback (127.0.0.1) unless a host is set (``--metrics-host``, ``metrics_host`` in [joiner]/[learner],
``STREAMREC_<SECTION>_METRICS_HOST``), and a host that is set is the one bound.

Each test runs the real subcommand (``streamrec join|train|monitor --metrics-port P``) in-process up to the
point where it has started its listener: ``prometheus_client.start_http_server`` is wrapped so that it starts
the real server, hands it to the test and stops the command there (before any Kafka or Redis client exists).
The test then checks the listening socket (the server's address and the kernel's /proc/net/tcp), connects to
it, and shuts it down again (the autouse thread-leak guard checks that)."""

from __future__ import annotations

import argparse
import re
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import prometheus_client
import pytest

from learner.config import LearnerSettings
from stream.joiner.config import JoinerSettings
from streamrec.cli import build_parser
from streamrec.stack import free_port


class _Started(Exception):
    """Raised by the wrapped start_http_server once the real listener runs: stops the command there."""


class _Listeners:
    def __init__(self) -> None:
        self.started: list[tuple[Any, threading.Thread, str]] = []

    def start_http_server(self, port: int, addr: str = "0.0.0.0", *args: Any, **kwargs: Any) -> Any:
        server, thread = _REAL_START(port, addr, *args, **kwargs)
        self.started.append((server, thread, addr))
        raise _Started

    def close(self) -> None:
        for server, thread, _ in self.started:
            server.shutdown()
            server.server_close()
            thread.join(5)


_REAL_START = prometheus_client.start_http_server


@pytest.fixture
def listeners(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Listeners]:
    for name in ("STREAMREC_JOINER_METRICS_HOST", "STREAMREC_LEARNER_METRICS_HOST", "STREAMREC_JOINER_METRICS_PORT",
                 "STREAMREC_LEARNER_METRICS_PORT"):
        monkeypatch.delenv(name, raising=False)
    ls = _Listeners()
    # the commands import it at call time (`from prometheus_client import start_http_server`)
    monkeypatch.setattr(prometheus_client, "start_http_server", ls.start_http_server)
    try:
        yield ls
    finally:
        ls.close()


@pytest.fixture
def quiet_rules(tmp_path: Path) -> Path:
    """A rules file with no sink (so the monitor starts no sink thread) and no source."""
    path = tmp_path / "rules.toml"
    path.write_text('interval_s = 15\n[sinks]\nlog = false\n\n[[rule]]\nname = "r"\nexpr = "x"\nop = ">"\n'
                    'threshold = 1\nfor_s = 0\nseverity = "info"\n')
    return path


def _argv(command: str, port: int, rules: Path) -> list[str]:
    extra = {"join": ["--driver", "kafka"], "train": ["--checkpoint-dir", str(rules.parent / "ckpt")],
             "monitor": ["--rules", str(rules)]}[command]
    return [command, "--metrics-port", str(port), *extra]


def _start(listeners: _Listeners, argv: list[str]) -> tuple[Any, str]:
    args: argparse.Namespace = build_parser().parse_args(argv)
    with pytest.raises(_Started):
        args.func(args)
    assert len(listeners.started) == 1, "the command started no metrics listener"
    server, _, addr = listeners.started[0]
    return server, addr


def _listening_addresses(port: int) -> set[str] | None:
    """IPv4 addresses with a socket in LISTEN on ``port``, from /proc/net/tcp (None where there is none)."""
    proc = Path("/proc/net/tcp")
    if not proc.exists():
        return None
    found = set()
    for line in proc.read_text().splitlines()[1:]:
        fields = line.split()
        local, state = fields[1], fields[3]
        hex_ip, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(hex_ip)[::-1]))  # little-endian on every Linux host
    return found


def _accepts(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def _non_loopback_address() -> str | None:
    """This machine's address on its default route, if it has one that is not loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, the kernel only picks a route
            ip = str(s.getsockname()[0])
        except OSError:
            return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def _scrape(host: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


COMMANDS = ["join", "train", "monitor"]


def test_settings_default_to_loopback() -> None:
    assert JoinerSettings().metrics_host == "127.0.0.1"
    assert LearnerSettings().metrics_host == "127.0.0.1"
    monitor_args = build_parser().parse_args(["monitor"])
    assert monitor_args.metrics_host == "127.0.0.1"


@pytest.mark.parametrize("command", COMMANDS)
def test_metrics_listener_binds_loopback_by_default(command: str, listeners: _Listeners, quiet_rules: Path) -> None:
    port = free_port()
    server, addr = _start(listeners, _argv(command, port, quiet_rules))
    assert addr == "127.0.0.1"
    assert server.server_address[0] == "127.0.0.1"
    assert server.server_address[1] == port
    bound = _listening_addresses(port)
    if bound is not None:
        assert bound == {"127.0.0.1"}, f"port {port} listens on {bound}"
        assert "0.0.0.0" not in bound
    assert _accepts("127.0.0.1", port)
    assert "# HELP" in _scrape("127.0.0.1", port)
    other = _non_loopback_address()
    if other is not None:
        assert not _accepts(other, port), f"the metrics listener answers on {other}:{port}"


@pytest.mark.parametrize("command", COMMANDS)
def test_metrics_host_flag_is_honoured(command: str, listeners: _Listeners, quiet_rules: Path) -> None:
    port = free_port()
    # 127.0.0.2 is loopback too on Linux (127/8), but a different address: 127.0.0.1 must not answer
    server, addr = _start(listeners, [*_argv(command, port, quiet_rules), "--metrics-host", "127.0.0.2"])
    assert addr == "127.0.0.2"
    assert server.server_address[:2] == ("127.0.0.2", port)
    bound = _listening_addresses(port)
    if bound is not None:
        assert bound == {"127.0.0.2"}
    assert _accepts("127.0.0.2", port)
    assert not _accepts("127.0.0.1", port)


@pytest.mark.parametrize(("command", "env"), [("join", "STREAMREC_JOINER_METRICS_HOST"),
                                              ("train", "STREAMREC_LEARNER_METRICS_HOST")])
def test_metrics_host_from_the_environment(command: str, env: str, listeners: _Listeners, quiet_rules: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env, "127.0.0.2")
    port = free_port()
    server, addr = _start(listeners, _argv(command, port, quiet_rules))
    assert addr == "127.0.0.2" and server.server_address[:2] == ("127.0.0.2", port)
    assert not _accepts("127.0.0.1", port)


def test_metrics_host_from_the_config_file(listeners: _Listeners, quiet_rules: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "streamrec.toml"
    cfg.write_text('[joiner]\nmetrics_host = "127.0.0.2"\n[learner]\nmetrics_host = "127.0.0.2"\n')
    port = free_port()
    server, addr = _start(listeners, [*_argv("train", port, quiet_rules), "--config", str(cfg)])
    assert addr == "127.0.0.2" and server.server_address[:2] == ("127.0.0.2", port)
    with pytest.raises(urllib.error.URLError):
        _scrape("127.0.0.1", port)


# -- the compose deployment publishes nothing beyond loopback ------------------------------------------
COMPOSE = Path(__file__).resolve().parents[2] / "compose" / "docker-compose.yml"


def test_compose_publishes_only_on_loopback_and_has_no_default_passwords() -> None:
    yaml = pytest.importorskip("yaml")
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    published = {name: svc["ports"] for name, svc in services.items() if svc.get("ports")}
    assert published, "no published port at all: the test no longer looks at the right file"
    for name, ports in published.items():
        for port in ports:
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port!r} beyond loopback"
    assert {"kafka", "redis", "joiner", "learner"}.isdisjoint(published)
    assert yaml.safe_load(COMPOSE.read_text())["x-grafana-admin-password-required"].startswith(
        "${GRAFANA_ADMIN_PASSWORD:?")
    assert "requirepass" in " ".join(services["redis"]["command"])
    assert "requirepass $$(cat /run/secrets/redis_password)" in " ".join(services["redis"]["command"])
    kafka = services["kafka"]["environment"]
    assert "PLAINTEXT://:" not in kafka["KAFKA_LISTENERS"] and "SASL_SSL://" in kafka["KAFKA_LISTENERS"]


def test_compose_hands_no_secret_to_a_program_as_an_argument() -> None:
    # The topics init passed the SCRAM password to kafka-configs.sh as `--add-config "...password=$(cat ...)"`: a
    # command line is world-readable on the host (`ps`) while the JVM runs, and kafka-configs.sh prints its arguments in
    # the error it exits with ("Error while executing config command with args '...'"), into `docker compose logs`.
    import yaml

    services = yaml.safe_load(COMPOSE.read_text())["services"]
    as_argument = re.compile(r"--[\w.-]+[ =][^\n]*\$\$\(cat /run/secrets/")  # an option whose value reads a secret
    for name, svc in services.items():
        texts = [*(svc.get("command") or []), *(svc.get("entrypoint") or []),
                 *((svc.get("healthcheck") or {}).get("test") or [])]
        for text in texts if not isinstance(texts, str) else [texts]:
            for line in str(text).splitlines():
                assert not as_argument.search(line), f"{name} passes a secret on a command line: {line.strip()}"
    assert "--add-config-file" in " ".join(services["topics"]["command"])
