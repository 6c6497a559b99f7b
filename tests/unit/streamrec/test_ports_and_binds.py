"""Ports out of range are config errors (exit 2) in every settings class and port flag; a listener that cannot
bind (serve, a --metrics-port) fails with one line naming the setting and the address, not a traceback."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from learner.config import LearnerSettings
from serving.http_server import make_server
from serving.settings import ServeSettings
from stream.errors import BindError, ConfigError
from stream.joiner.config import JoinerSettings
from stream.replay.config import ReplaySettings
from streamrec.cli import main
from streamrec.commands.common import start_metrics
from streamrec.settings import build
from streamrec.stack import StackSettings

NOT_OURS = "192.0.2.1"  # TEST-NET-1: never an address of this machine, and no DNS lookup


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])


@pytest.mark.parametrize("cls, name", [(ServeSettings, "port"), (LearnerSettings, "metrics_port"),
                                       (JoinerSettings, "metrics_port"), (ReplaySettings, "metrics_port"),
                                       (StackSettings, "kafka_port"), (StackSettings, "redis_port")])
@pytest.mark.parametrize("port", [-1, 65536, 70000])
def test_a_port_out_of_range_is_a_config_error(cls: Any, name: str, port: int) -> None:
    with pytest.raises(ConfigError, match=rf"{name} must be a port number \d-65535, got {port}"):
        cls(**{name: port})


def test_port_0_picks_one_for_a_listener_but_not_for_the_stack() -> None:
    assert ServeSettings(port=0).port == 0 and JoinerSettings(metrics_port=0).metrics_port == 0
    with pytest.raises(ConfigError, match=r"\[stack\] kafka_port must be a port number 1-65535"):
        StackSettings(kafka_port=0)
    with pytest.raises(ConfigError, match=r"\[serve\] port"):
        build(ServeSettings, "serve", environ={"STREAMREC_SERVE_PORT": "70000"})


def test_two_ports_of_one_settings_class_on_the_same_port_are_a_config_error(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The stack's broker and Redis both on 23456: ``stack up`` started the broker, then refused Redis with exit 1 as
    "in use by a process this stack did not start" (its own broker), and left the broker running."""
    with pytest.raises(ConfigError, match=r"\[stack\] redis_port and kafka_port are both 23456"):
        StackSettings(kafka_port=23456, redis_port=23456)
    monkeypatch.setenv("STREAMREC_STACK_KAFKA_PORT", "23456")
    monkeypatch.setenv("STREAMREC_STACK_REDIS_PORT", "23456")
    assert main(["stack", "up", "--state-dir", "/nonexistent/never-made"]) == 2
    assert "redis_port and kafka_port are both 23456" in capsys.readouterr().err


def test_monitor_metrics_port_flag_is_range_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["monitor", "--check", "--metrics-port", "70000"])
    assert exc.value.code == 2 and "port number 0-65535" in capsys.readouterr().err


def test_a_metrics_port_in_use_is_one_line_naming_the_setting_and_address(busy_port: int) -> None:
    with pytest.raises(BindError, match=rf"\[joiner\] metrics_port.*127\.0\.0\.1:{busy_port}: the port is in use"):
        start_metrics(busy_port, "127.0.0.1", "[joiner] metrics_port")
    with pytest.raises(ConfigError, match=rf"cannot listen on {NOT_OURS}:0: .* not an address of this machine"):
        start_metrics(0, NOT_OURS, "--metrics-host")
    with pytest.raises(ConfigError, match="a port is 0-65535"):
        start_metrics(70000, "127.0.0.1", "[refresh] metrics_port")  # [refresh] is not range-checked at load


@pytest.mark.parametrize("kind", ["threading", "aiohttp"])
def test_serve_bind_failures_are_one_line_naming_the_setting(kind: str, busy_port: int) -> None:
    app: Any = SimpleNamespace(s=SimpleNamespace(max_active=0, reuse_port=False))
    with pytest.raises(BindError, match=rf"\[serve\] host / port .*127\.0\.0\.1:{busy_port}: the port is in use"):
        make_server(kind, app, "127.0.0.1", busy_port)
    with pytest.raises(ConfigError, match=rf"\[serve\] host / port .*{NOT_OURS}:0"):
        make_server(kind, app, NOT_OURS, 0)


def test_the_cli_prints_a_bind_error_as_one_line_with_exit_1(busy_port: int, tmp_path: Any,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["monitor", "--rules", str(_rules(tmp_path)), "--metrics-port", str(busy_port)])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    assert f"streamrec monitor: error: --metrics-port / --metrics-host: cannot listen on 127.0.0.1:{busy_port}" in err


def _rules(tmp_path: Any) -> Any:
    p = tmp_path / "rules.toml"
    p.write_text('interval_s = 60\n[sources]\n\n[[rule]]\nname = "x"\nexpr = "up"\nop = "=="\nthreshold = 0\n')
    return p
