"""``streamrec monitor --check`` and ``--once`` build the settings the daemon runs with (a bad --config or
STREAMREC_KAFKA_* is exit 2 there too, not only when the daemon starts), and ``--once`` answers a health check
through its exit status: 1 when a scrape failed (a dead fleet exited 0), 3 when a rule's condition holds."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from streamrec.cli import main

RULE = """
[sinks]
kafka_topic = "alerts"

[[rule]]
name = "cold_start_share"
expr = 'streamrec_learner_bucket_share{field="user_id"}'
op = ">"
threshold = 0.5
for_s = 300
"""


@pytest.fixture
def metrics() -> Iterator[tuple[str, list[str]]]:
    """A /metrics endpoint serving the text in ``body[0]``."""
    body = ["streamrec_learner_bucket_share{field=\"user_id\"} 0.1\n"]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            data = body[0].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", body
    finally:
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rules(tmp_path: Path, url: str) -> str:
    path = tmp_path / "rules.toml"
    path.write_text(f'[sources]\nlearner = "{url}"\n' + RULE)
    return str(path)


@pytest.mark.parametrize("mode", ["--check", "--once"])
def test_check_and_once_read_the_config_file_and_the_environment(
        mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    r = rules(tmp_path, f"http://127.0.0.1:{closed_port()}/metrics")
    assert main(["monitor", "--rules", r, mode, "--config", str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml does not exist" in capsys.readouterr().err
    (tmp_path / "typo.toml").write_text('[kafka]\nbootstarp_servers = "x:1"\n')
    assert main(["monitor", "--rules", r, mode, "--config", str(tmp_path / "typo.toml")]) == 2
    assert "unknown key 'bootstarp_servers' in [kafka]" in capsys.readouterr().err
    monkeypatch.setenv("STREAMREC_KAFKA_BOGUS", "1")
    assert main(["monitor", "--rules", r, mode]) == 2
    assert "STREAMREC_KAFKA_BOGUS does not name a [kafka] setting" in capsys.readouterr().err


def test_once_exits_1_when_a_scrape_failed_and_still_prints_every_rule(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["monitor", "--rules", rules(tmp_path, f"http://127.0.0.1:{closed_port()}/metrics"), "--once"]) == 1
    out = capsys.readouterr().out
    assert "scrape of learner failed" in out and "cold_start_share" in out


def test_once_exits_0_all_clear_and_3_while_a_condition_holds(
        tmp_path: Path, metrics: tuple[str, list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    url, body = metrics
    r = rules(tmp_path, url)
    assert main(["monitor", "--rules", r, "--once", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rules"][0]["state"] == "inactive"
    body[0] = "streamrec_learner_bucket_share{field=\"user_id\"} 0.9\n"
    assert main(["monitor", "--rules", r, "--once", "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["rules"][0]["state"] == "pending"


def test_the_exit_statuses_are_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["monitor", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "1 a scrape failed" in text and "3 a rule's condition holds" in text


def test_state_path_comes_from_the_rules_file_and_the_flag_replaces_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """compose keeps the firing alerts over a restart with ``--state-path`` on a volume (the shared rules file names
    no writable place); the flag replaces the file's ``state_path``, and ``--check`` shows the one in force."""
    r = tmp_path / "rules.toml"
    r.write_text('state_path = "from-file.json"\n[sources]\nlearner = "http://127.0.0.1:1/metrics"\n' + RULE)
    assert main(["monitor", "--rules", str(r), "--check", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state_path"] == "from-file.json"
    flag = str(tmp_path / "state" / "firing.json")
    assert main(["monitor", "--rules", str(r), "--check", "--json", "--state-path", flag]) == 0
    assert json.loads(capsys.readouterr().out)["state_path"] == flag


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/metrics", "http://:9102/metrics"])
def test_a_source_flag_with_a_url_the_rules_file_would_refuse_is_exit_2_at_start(
        url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # a port out of range or no host: --check said OK (exit 0) and the daemon failed every scrape for ever, while
    # the same URL in [sources] is exit 2
    assert main(["monitor", "--check", "--source", f"learner={url}"]) == 2
    assert f"--source 'learner={url}'" in capsys.readouterr().err


@pytest.mark.parametrize("json_flag", [["--json"], []], ids=["json", "text"])
def test_check_shows_the_webhook_as_its_scheme_and_host_only(
        json_flag: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Slack-style webhook's path is its token: ``--check --json`` printed the whole URL in ``sinks``, where
    errors, logs and the sinks' repr show only its scheme and host (``stream.secrets.hide_url_path``)."""
    r = tmp_path / "rules.toml"
    r.write_text('[sources]\nlearner = "http://127.0.0.1:1/metrics"\n'
                 + RULE.replace('kafka_topic = "alerts"', 'webhook_url = "https://hooks.slack.com/services/T0/B0/'
                                'Tok3nXyz"'))
    assert main(["monitor", "--rules", str(r), "--check", *json_flag]) == 0
    out = capsys.readouterr().out
    assert "Tok3nXyz" not in out and "/services/" not in out
    if json_flag:
        assert json.loads(out)["sinks"]["webhook_url"] == "https://hooks.slack.com/***"
