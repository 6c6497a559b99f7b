"""The faust join driver keeps the CLI's log redaction (stream/secrets.py: every log line scrubbed at the source).

faust's worker set up logging of its own when it started (mode's ``setup_logging``: the root logger's handlers cleared
and replaced), so the ``RedactingFilter`` the CLI installed was gone from then on: a secret in any line logged after
the start (a library's error text, a librdkafka log line) went to stderr as it was. The kafka driver never had this."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from stream.config import KafkaSettings
from stream.joiner.config import JoinerSettings
from stream.joiner.worker import FaustJoinWorker
from stream.secrets import MASK, Secret
from streamrec.commands.common import setup_logging


@pytest.fixture
def cli_root_logger(capfd: pytest.CaptureFixture[str]) -> Iterator[None]:
    """The root logger as ``streamrec join`` sets it up (``setup_logging``: to stderr, captured by ``capfd``), pytest's
    own handlers put back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    try:
        setup_logging("warning")
        yield
    finally:
        for h in root.handlers:
            if h not in handlers:
                h.close()
        root.handlers[:] = handlers
        root.setLevel(level)


@pytest.fixture
def signals_put_back() -> Iterator[None]:
    """The process's dispositions of the signals mode's worker takes at its start (``install_signal_handlers``: on its
    event loop), put back: the loop's close resets them to Python's defaults, not to what they were, so a pytest worker
    that ignored SIGINT handled it from then on and children started by later tests no longer inherited it ignored."""
    found = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        yield
    finally:
        for sig, handler in found.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: one set in C


@pytest.mark.usefixtures("signals_put_back")
def test_a_secret_logged_after_the_faust_worker_started_is_scrubbed(cli_root_logger: None,
                                                                     capfd: pytest.CaptureFixture[str]) -> None:
    w = FaustJoinWorker(SimpleNamespace(), KafkaSettings(bootstrap_servers="127.0.0.1:9"),  # type: ignore[arg-type]
                        JoinerSettings(app_id="redaction-test"))
    try:
        worker = w._faust_worker()
        asyncio.run(worker.on_first_start())  # what the worker's start does first (mode.Worker: logging among it)
        secret = Secret("faust-driver-secret-31")
        logging.getLogger("streamrec.join").warning("a library's error text quoting %s", secret.reveal())
    finally:
        shutil.rmtree(w._datadir, ignore_errors=True)
    err = capfd.readouterr().err
    assert "a library's error text quoting" in err, err  # the line was written ...
    assert "faust-driver-secret-31" not in err and MASK in err, err  # ... scrubbed
