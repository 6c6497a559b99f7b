"""A TCP proxy in front of a real Redis that can make it trickle: its replies reach the client one byte every
``gap_s`` while ``trickling`` is set (commands go through at once). A Redis that answers this way (a congested or
lossy link, a server swapping, a middlebox) never leaves a read idle for a whole socket timeout, so a per-``recv``
timeout never fires: the tests that use it check that a whole round trip is bounded, not each read.

    with TrickleProxy(redis_port) as proxy:
        url = proxy.url            # redis://127.0.0.1:<proxy port>/0
        proxy.trickling = True     # from now on, replies trickle; False: they pass at once again
"""

from __future__ import annotations

import select
import socket
import threading
from types import TracebackType


class TrickleProxy:
    def __init__(self, target_port: int, gap_s: float = 0.02) -> None:
        self.target_port, self.gap_s = target_port, gap_s
        self.trickling = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"

    def __enter__(self) -> TrickleProxy:
        self._spawn(self._accept)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        with self._lock:
            socks, threads = list(self._socks), list(self._threads)
        for t in threads:
            t.join(5)
        for s in socks:
            s.close()
        self._listener.close()

    def _spawn(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, name="trickle-proxy", daemon=True)  # type: ignore[arg-type]
        with self._lock:
            self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            server = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._socks += [client, server]
            self._spawn(self._pump, client, server, False)
            self._spawn(self._pump, server, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, reply: bool) -> None:
        """Copy ``src`` to ``dst`` until either closes or the proxy stops; replies a byte per ``gap_s`` while
        trickling."""
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([src], [], [], 0.1)
                if not ready:
                    continue
                data = src.recv(65536)
                if not data:
                    break
                for i in range(len(data)):
                    if not (reply and self.trickling):
                        dst.sendall(data[i:])
                        break
                    dst.sendall(data[i:i + 1])
                    if self._stop.wait(self.gap_s):
                        return
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
