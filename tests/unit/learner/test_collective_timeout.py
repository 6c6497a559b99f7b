"""A rank whose peer hangs (alive, never entering the collective) gives up after ``[learner] collective_timeout_s``
and says so in a line naming the setting (learner/distributed.py, ``peer_hung``): gloo's own text ("Timed out waiting
2000ms for send operation to complete") names neither. The peer here really hangs: a gloo rank blocked on an Event."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

from learner.distributed import LockStep, RankContext, is_peer_failure, peer_hung

TIMEOUT_S = 2.0  # a short collective_timeout_s: the test waits this long once; what it asserts is the line


def _rank(rank: int, port: int, out: str) -> None:
    """Rank 0 enters a round's agreement; rank 1 hangs before it, for good (the test kills it)."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    RankContext(rank, 2, master_port=port).init(timeout_s=TIMEOUT_S)
    if rank == 1:
        threading.Event().wait()
    try:
        LockStep(10).agree(5, False, False, False, 0)
        line = "no error"
    except RuntimeError as exc:
        line = f"{is_peer_failure(exc)}|{peer_hung(exc, rank, TIMEOUT_S)}"
    Path(out).write_text(line)
    os._exit(0)  # the hung peer's group is never left cleanly


def test_a_collective_whose_peer_hangs_fails_after_collective_timeout_s_with_a_line_naming_it(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rank0.txt"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port, str(out))) for r in range(2)]
    try:
        for p in procs:
            p.start()
        procs[0].join(timeout=120)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    peer_failure, line = out.read_text().split("|", 1)
    assert peer_failure == "True"  # no strikes for this rank's messages: a hung peer is no message's fault
    assert line.startswith("rank 0: a collective waited 2 s ([learner] collective_timeout_s) for another rank")
    assert "a peer hung" in line


def test_a_ranks_own_error_or_a_departed_peer_is_no_timeout() -> None:
    assert peer_hung(RuntimeError("index 9 is out of bounds for dimension 0"), 0, 600) is None
    assert peer_hung(RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:1234: Connection reset by "
                                  "peer"), 0, 600) is None
