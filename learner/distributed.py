"""The distributed mode's process group, its split of the samples partitions and its lock-step collectives.

``streamrec train`` under ``torchrun --nproc-per-node N`` (``WORLD_SIZE > 1``) trains one model on N ranks
(``learner/sharded_daemon.py``); this module holds what the ranks agree on, with no TorchRec in it:

- :class:`RankContext`: rank, world size and backend, read from torchrun's environment once, at the process
  edge (``streamrec/commands/train.py``), and the process group's lifecycle (:meth:`RankContext.init`,
  :meth:`RankContext.close`). gloo on CPU, NCCL on CUDA.
- :func:`partitions_of`: samples partition ``p`` goes to rank ``p % world`` (then to one of its DataLoader workers). A
  fixed split, not the consumer group's assignment: the offsets of every partition live in the checkpoint
  (``learner/sharded_checkpoint.py``), written by all ranks at one step boundary, and a restart (same world size, or
  another one after a reshard) reads each partition from exactly the offset the checkpointed model stopped at. A dynamic
  group rebalance moves a partition between ranks at a moment of the broker's choosing; its new owner would have to
  start from a model state that includes every sample the old owner trained, which only a checkpoint of the whole
  sharded model taken at that instant gives, i.e. stopping the world. So the group id only names the commits that lag
  dashboards read (made after each durable checkpoint), never who reads what.
- :class:`LockStep`: sharded embeddings put every rank in every lookup's collectives (the row-wise lookup's
  all-to-all and all-gather, the dense part's gradient all-reduce), so every rank runs the same number of steps,
  each of the same batch size. Once per round each rank says how many rows it has, whether its input ended,
  whether it wants a checkpoint or a stop, and whether its batch is a suspect (a poison strike), and all ranks take
  the same decision from everybody's answer.
- :func:`mark_round_failed`, :func:`round_failed_elsewhere`: a round that failed for its data on some rank, told to
  the others through the group's store (its rendezvous key-value store, not a collective: the failing rank
  never joins the collective the others wait in), so that every rank strikes its own messages of that round.
- :func:`all_gather_objects`, :func:`gather_objects`: small Python values from every rank (offsets, counts, metrics
  histograms), and a delta's rows on rank 0 (`learner/sharded_deltas.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import Metric

from stream.errors import ConfigError

log = logging.getLogger("streamrec.train")


@dataclass(frozen=True)
class RankContext:
    """Who this process is among the ranks of one training job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = "gloo"
    # torchrun's store (its agent's, on MASTER_ADDR:MASTER_PORT) and how often the agent restarted the group
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    agent_store: bool = False
    restart_count: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, env: Mapping[str, str], device_type: str = "cpu") -> RankContext:
        """torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (unset: one process); gloo on CPU, NCCL on CUDA."""
        names = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
        defaults = {"WORLD_SIZE": "1"}
        try:
            world, rank, local, port, restarts = (int(env.get(n, defaults.get(n, "0"))) for n in names)
        except ValueError as exc:
            raise ConfigError(f"{' / '.join(names)} must be integers (torchrun sets them): {exc}") from None
        if world < 1 or not 0 <= rank < world:
            raise ConfigError(f"rank {rank} of world size {world} is not a valid place: run under torchrun, which "
                              "sets RANK and WORLD_SIZE, or set neither for one process")
        if local < 0 or not 0 <= port <= 65535 or restarts < 0:
            raise ConfigError(f"LOCAL_RANK {local}, MASTER_PORT {port}, TORCHELASTIC_RESTART_COUNT {restarts}: each "
                              "must be >= 0 and the port <= 65535 (torchrun sets them)")
        return cls(rank, world, local, "nccl" if device_type == "cuda" else "gloo",
                   master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=port,
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True", restart_count=restarts)

    def init(self, timeout_s: float = 600.0) -> None:
        """Join the default process group (torchrun's rendezvous variables: ``MASTER_ADDR``/``MASTER_PORT``).

        Under torchrun's agent the ranks meet in the agent's store under a prefix of the restart count: after an
        elastic restart the store may still hold the dead group's addresses, and a rank that read one before its
        peer rewrote it tried the old address until gloo gave up (seen here: ``connectFullMesh failed ... Connection
        refused`` in about one restart in three)."""
        if not self.distributed or dist.is_initialized():
            return
        timeout = timedelta(seconds=timeout_s)
        if self.agent_store:
            base = dist.TCPStore(self.master_addr, self.master_port, self.world_size, is_master=False,
                                 timeout=timeout)
            store = dist.PrefixStore(f"streamrec/attempt-{self.restart_count}", base)
            dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world_size,
                                    timeout=timeout)
        else:
            dist.init_process_group(self.backend, rank=self.rank, world_size=self.world_size, timeout=timeout)

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


RANK_LABEL = "rank"  # the label every series of a rank's /metrics carries under torchrun (WORLD_SIZE > 1)


class RankLabelled:
    """A collector: every sample of ``registry`` with the label ``rank="<rank>"`` added. Each rank exports its own
    samples, lag and memory under the same names; without a label of their own the ranks' series were the same series
    to a scraper, and the monitor (first source wins) and Prometheus (one job, several instances) could not tell a
    rank that stopped training, or blew up its memory, from the others."""

    def __init__(self, rank: int, registry: CollectorRegistry = REGISTRY) -> None:
        self.rank, self.registry = str(rank), registry

    def collect(self) -> list[Metric]:
        out = []
        for family in self.registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                labelled.add_sample(s.name, {**s.labels, RANK_LABEL: self.rank}, s.value, s.timestamp, s.exemplar)
            out.append(labelled)
        return out


def metrics_registry(ctx: RankContext) -> CollectorRegistry:
    """What a learner's /metrics serves: the process's registry, its series labelled with the rank where there are
    several ranks (one process keeps its series as they were: its rules and alerts' identities unchanged)."""
    if not ctx.distributed:
        return REGISTRY
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankLabelled(ctx.rank))
    return registry


def partitions_of(partitions: list[int], rank: int, world_size: int, worker: int = 0,
                  num_workers: int = 1) -> list[int]:
    """The samples partitions ``rank`` reads: ``p % world_size == rank`` (module docstring: why a fixed split); and
    of those, the ones its DataLoader worker ``worker`` of ``num_workers`` reads: ``(p // world_size) % num_workers
    == worker``. A topic's partitions are 0..P-1, so ``p // world_size`` numbers the rank's own 0, 1, 2, ...: dealt
    out in turn, every worker gets a share (if the rank has as many partitions as workers), the shares differ by at
    most one, and a partition the topic gains later goes to one worker by ``p`` alone, whatever was listed before.
    Dealt by ``p % num_workers``, rank 1 of 2 (the odd partitions) gave one of 2 workers all and the other none.
    Who reads a partition changes nothing of where it starts: that is its offset in the checkpoint."""
    return sorted(p for p in partitions if p % world_size == rank and (p // world_size) % num_workers == worker)


@dataclass(frozen=True)
class Round:
    """What every rank decided together for one round (:meth:`LockStep.agree`)."""

    steps: tuple[int, ...]  # rows of each step this round, the same on every rank (the most any rank has)
    checkpoint: bool  # some rank wants a checkpoint now (its samples or seconds since the last one)
    stop: str | None  # why every rank stops now (None: go on)
    delta: bool = False  # some rank's serving delta is due: every rank enters learner/sharded_deltas.py's round
    turn: int | None = None  # the rank whose suspect batch is the round's only rows (None: every rank's batch)


class LockStep:
    """Per round, one all-gather of ``[rows, input ended, wants checkpoint, stop signal, samples, wants delta,
    suspect]`` per rank.

    A round's steps: rank r trains its rows as chunks of ``step_rows`` (the last one shorter); step i of the
    round has as many rows as the largest chunk i of any rank, and a rank with fewer pads its chunk with empty
    rows (no lookups, zero loss weight). The job stops when every rank's input ended (``exit_when_idle``), when
    any rank got SIGTERM/SIGINT, or when the samples trained by all ranks together reach ``max_samples``.

    Suspects: a round's rows of every rank meet in collective stages (the id lookup by the key's owner, the
    base-rate bias, rank 0's quality metrics), so a failed round blames every message in it, on every rank, as
    one process blames its whole batch (``stream/strikes.py``). A suspect is retried alone in the whole group:
    when any rank's batch is a suspect, the lowest such rank trains it as the round's only rows (``Round.turn``)
    and every other rank keeps its batch for a later round."""

    def __init__(self, step_rows: int, max_samples: int | None = None) -> None:
        self.step_rows = step_rows
        self.max_samples = max_samples

    def agree(self, rows: int, ended: bool, wants_checkpoint: bool, signalled: bool, samples: int,
              wants_delta: bool = False, suspect: bool = False) -> Round:
        mine = torch.tensor([rows, int(ended), int(wants_checkpoint), int(signalled), samples, int(wants_delta),
                             int(suspect)], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(out, mine)
            everyone = torch.stack(out)  # (world, 7)
        else:
            everyone = mine.unsqueeze(0)  # (1, 7)
        per_rank = everyone[:, 0].tolist()
        suspects = everyone[:, 6].nonzero().flatten().tolist()
        turn = int(suspects[0]) if suspects else None
        trained = per_rank if turn is None else [r if k == turn else 0 for k, r in enumerate(per_rank)]
        n_steps = max((-(-r // self.step_rows) for r in trained), default=0)
        steps = tuple(max(min(self.step_rows, r - i * self.step_rows) for r in trained) for i in range(n_steps))
        total = int(everyone[:, 4].sum())
        stop = None
        if bool(everyone[:, 3].any()):
            stop = "signal"
        elif self.max_samples is not None and total >= self.max_samples:
            stop = "max samples"
        elif bool(everyone[:, 1].all()) and not any(per_rank):
            stop = "input idle"
        return Round(steps, bool(everyone[:, 2].any()), stop, bool(everyone[:, 5].any()), turn)


def all_gather_objects(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (one process: ``[obj]``)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_objects(obj: Any, dst: int = 0) -> list[Any] | None:
    """``obj`` of every rank, in rank order, on rank ``dst`` (None on the others; one process: ``[obj]``)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# What the collectives raise when another rank is gone or stuck: gloo's transport errors and NCCL's are plain
# RuntimeErrors (checked here on torch 2.13: "[gloo/transport/tcp/pair.cc] Read error ...: Connection reset by
# peer"), so they are told apart by their text.
_PEER_FAILURE_TEXT = ("gloo", "nccl", "connection reset", "connection closed", "broken pipe", "timed out")


def is_peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` says another rank failed (or the group's transport did), not this rank's own batch: a
    rank that only saw its peer die gives its innocent messages no poison strikes."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(t in text for t in _PEER_FAILURE_TEXT)


# What a collective raises when its timeout (RankContext.init's, [learner] collective_timeout_s) ends the wait for a
# peer (checked on torch 2.13, gloo: "[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 2000ms for send
# operation to complete"; NCCL's watchdog: "Watchdog caught collective operation timeout")
_TIMEOUT_TEXT = ("timed out waiting", "collective operation timeout")


def peer_hung(exc: BaseException, rank: int, timeout_s: float) -> str | None:
    """The line that says a collective gave up waiting for a hung peer, naming the setting that bounds it; None when
    ``exc`` is no collective's timeout. gloo's own text names neither the peer's state nor the setting."""
    text = str(exc).lower()
    if not is_peer_failure(exc) or not any(t in text for t in _TIMEOUT_TEXT):
        return None
    return (f"rank {rank}: a collective waited {timeout_s:g} s ([learner] collective_timeout_s) for another rank and "
            "gave up: a peer hung (alive, but not in the collective) or is that much slower. torchrun restarts the "
            "group from the last checkpoint; raise collective_timeout_s if a rank's step or checkpoint takes longer")


# The store key of a round that failed for its data; the store is the attempt's (under torchrun's agent its keys
# carry the restart count, RankContext.init), so a restarted group starts without it.
_ROUND_FAILED = "streamrec/round-failed"


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def mark_round_failed(rank: int, exc: BaseException) -> None:
    """Tell the other ranks that this rank's round failed for its data (not a peer's, not the infrastructure's):
    each then strikes its own messages of the round (:func:`round_failed_elsewhere`). Called BEFORE the rank leaves
    the group, so a peer that notices the departure finds the key. Best effort: a store that cannot be reached
    only costs the other ranks' strikes (as before this existed)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    try:
        _store().set(_ROUND_FAILED, f"rank {rank}: {type(exc).__name__}: {exc}"[:300])
    except Exception as err:  # noqa: BLE001 - the rank is failing anyway; its own strikes are written
        log.warning("could not tell the other ranks that the round failed: %s", err)


def round_failed_elsewhere() -> str | None:
    """The error of a rank whose round failed for its data (:func:`mark_round_failed`), or None: the peer died, hung
    or lost its connection (no message's fault), or the store cannot be reached (then nothing is blamed)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    try:
        store = _store()
        if not store.check([_ROUND_FAILED]):
            return None
        return bytes(store.get(_ROUND_FAILED)).decode(errors="replace")
    except Exception:  # noqa: BLE001 - no evidence of a data failure: no strikes
        return None
