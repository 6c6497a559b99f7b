"""The learner's health monitors, as the pure computations behind its Prometheus metrics (``learner/daemon.py``
publishes them, at most once a second; ``monitor/default_rules.toml`` alerts on them):

* memory: :func:`rss_bytes` (the process's resident set, from ``/proc/self/statm``) and, on CUDA, torch's
  allocated/reserved device memory; :class:`GrowthRate`, the least-squares slope of a gauge over a sliding
  window in bytes per hour (a leak is a steady slope; a one-off allocation is a step the window forgets);
* gradients: :class:`GradNorms`, the L2 norm of every optimizer step's gradient, dense (MLP, bias) and the
  embedding table apart, and on sampled steps the table's per field block (rows of a field's block, so
  ``history`` counts under the ``item_id`` rows it shares), kept as device tensors (no sync per step) until the
  daemon drains them;
  :class:`UpdateNorms` the L2 norm of what a step changed, sampled (a zero learning rate or a frozen table
  leaves the gradients as they were but changes nothing);
* feature coverage: :class:`FieldCoverage`, per field the share of recent samples carrying it (a single-valued
  categorical carries ``stream.features.MISSING`` when absent, also when its column stopped arriving, a list is
  empty, a dense feature is 0);
* label balance: :class:`PositiveRate`, the share of positives among the last ``window`` samples trained.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import torch

from learner.batch import TensorBatch
from learner.features import FeatureConfig
from stream.features import MISSING

MEMORY_WINDOW_S = 600.0  # the growth rate's sliding window (s)
HOUR_S = 3600.0


def rss_bytes() -> int:
    """This process's resident set size in bytes (``/proc/self/statm``; psutil where there is no /proc; 0 when
    neither is available)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - not installed, or no such information here
        return 0


class GrowthRate:
    """Growth per hour of a sampled value: the least-squares slope of the (time, value) samples of the last
    ``window_s`` seconds, NaN until they span ``min_span_s`` (half the window by default), so a process that
    just started (loading its model, filling its id maps) reports nothing rather than a steep start."""

    def __init__(self, window_s: float = MEMORY_WINDOW_S, min_span_s: float | None = None) -> None:
        self.window_s = window_s
        self.min_span_s = window_s / 2 if min_span_s is None else min_span_s
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, t: float, value: float) -> None:
        self._samples.append((t, value))
        while self._samples and self._samples[0][0] < t - self.window_s:
            self._samples.popleft()

    def per_hour(self) -> float:
        s = self._samples
        if len(s) < 2 or s[-1][0] - s[0][0] < self.min_span_s:
            return float("nan")
        t = np.fromiter((x for x, _ in s), np.float64, len(s))
        v = np.fromiter((y for _, y in s), np.float64, len(s))
        t -= t.mean()
        return float((t * (v - v.mean())).sum() / (t * t).sum()) * HOUR_S


class MemoryMonitor:
    """RSS and (on CUDA) device memory, with their growth rates; :meth:`sample` at most once a second."""

    def __init__(self, device: torch.device, read_rss: Callable[[], int] = rss_bytes,
                 clock: Callable[[], float] = time.monotonic, window_s: float | None = None) -> None:
        self.device, self.read_rss, self.clock = device, read_rss, clock
        window = MEMORY_WINDOW_S if window_s is None else window_s
        self.growth = {"rss": GrowthRate(window)}
        if device.type == "cuda":
            self.growth["cuda_allocated"] = GrowthRate(window)

    def sample(self) -> dict[str, float]:
        """Bytes now: ``rss`` and, on CUDA, ``cuda_allocated``/``cuda_reserved``; each fed to its growth rate."""
        now = self.clock()
        out = {"rss": float(self.read_rss())}
        if self.device.type == "cuda":
            out["cuda_allocated"] = float(torch.cuda.memory_allocated(self.device))
            out["cuda_reserved"] = float(torch.cuda.memory_reserved(self.device))
        for name, g in self.growth.items():
            g.add(now, out[name])
        return out

    def growth_per_hour(self) -> dict[str, float]:
        return {name: g.per_hour() for name, g in self.growth.items()}


def field_blocks(cfg: FeatureConfig) -> tuple[list[str], list[int]]:
    """(names, first rows) of the fields that own rows in the fused table, in row order; a field's block runs
    to the next one's first row (the last one's to the table's end)."""
    names, starts, acc = [], [], 0
    for f in cfg.fields:
        if f.shares is None:
            names.append(f.name)
            starts.append(acc)
            acc += f.num_buckets + f.capacity
    return names, starts


class GradNorms:
    """The gradient L2 norms of each optimizer step: dense, the embedding table, and (sampled) per field block.

    Per step: :meth:`embedding` gets the table's touched rows (U,) and their summed gradients (U, D + 1) (from
    the fused lookup's backward, or the coalesced sparse gradient), :meth:`end_step` the dense norm. The table's
    norm is one reduction per step; the per-block split (a search of U rows and a scatter) only on steps with
    ``sample_blocks`` set (the trainer sets it on the steps it samples updates on, at most once a second). Values
    stay tensors on the device until :meth:`drain` (one sync for all of them); at most ``keep`` steps wait, the
    oldest dropped first, so a trainer nobody drains holds bounded memory."""

    def __init__(self, field_names: Sequence[str] = (), field_starts: Sequence[int] = (), keep: int = 1024) -> None:
        self.field_names = list(field_names)
        self._starts: torch.Tensor | None = (torch.tensor(list(field_starts), dtype=torch.int64)
                                             if field_names else None)
        self.sample_blocks = False  # split this step's table norm per field block
        self._table: list[torch.Tensor] = []  # this step's table norms so far (one per backward)
        self._blocks: torch.Tensor | None = None  # this step's squared per-block norms, when sampled
        # per step: (its dense gradients' norms (tensors,), the table's norm ())
        self.pending: deque[tuple[torch.Tensor, torch.Tensor]] = deque(maxlen=keep)
        self.pending_blocks: deque[torch.Tensor] = deque(maxlen=keep)  # per sampled step (blocks,)
        self._zero: torch.Tensor | None = None

    @classmethod
    def of(cls, model: torch.nn.Module, keep: int = 1024) -> GradNorms:
        cfg = getattr(model, "cfg", None)
        if isinstance(cfg, FeatureConfig):
            return cls(*field_blocks(cfg), keep=keep)
        return cls(keep=keep)

    def embedding(self, rows: torch.Tensor, sums: torch.Tensor) -> None:
        """Unique ``rows`` (U,) of the table and their summed gradients (U, D + 1) of this step."""
        sums = sums.detach()
        self._table.append(torch.linalg.vector_norm(sums, dtype=torch.float32))
        if self.sample_blocks and self._starts is not None:
            if self._starts.device != rows.device:
                self._starts = self._starts.to(rows.device)
            block = torch.searchsorted(self._starts, rows, right=True) - 1  # (U,) the field block of each row
            sq = sums.float().square().sum(dim=1)  # (U,)
            parts = torch.zeros(len(self.field_names), dtype=torch.float32, device=sq.device).index_add_(0, block, sq)
            self._blocks = parts if self._blocks is None else self._blocks + parts

    def end_step(self, dense_norms: Sequence[torch.Tensor] = (), table_measured: bool = True) -> None:
        """Close a step with the norms of its dense gradients, one per tensor (``torch._foreach_norm``; none: 0;
        combined at :meth:`drain`, not here). A step whose table got no gradient (a frozen table, a batch without
        lookups) has an embedding norm of 0; one whose table gradient was not measured (``table_measured=False``:
        the sharded trainer measures it on sampled steps only) NaN, which the daemons do not observe."""
        device = (dense_norms[0].device if dense_norms else
                  self._table[0].device if self._table else torch.device("cpu"))
        if self._zero is None or self._zero.device != device:
            self._zero = torch.zeros((), dtype=torch.float32, device=device)
        if not table_measured:
            table = torch.full((), float("nan"), device=device)
        elif len(self._table) == 1:
            table = self._table[0]
        else:  # none (0), or several backwards in one step (accumulation: never on the fused path)
            table = torch.linalg.vector_norm(torch.stack(self._table)) if self._table else self._zero
        self.pending.append((torch.stack(list(dense_norms)) if dense_norms else self._zero.reshape(1), table))
        if self.sample_blocks and self.field_names:
            blocks = self._blocks if self._blocks is not None else torch.zeros(len(self.field_names), device=device)
            self.pending_blocks.append(blocks.sqrt())
        self._table, self._blocks = [], None

    def drain(self) -> tuple[list[tuple[float, float]], list[dict[str, float]]]:
        """((dense, table) of each step, {field: norm} of each sampled step) since the last drain, oldest first."""
        steps: list[tuple[float, float]] = []
        blocks: list[dict[str, float]] = []
        if self.pending:
            flat = torch.cat([d for d, _ in self.pending]).float().cpu()  # every dense tensor's norm
            step = torch.repeat_interleave(torch.tensor([len(d) for d, _ in self.pending]))  # each one's step
            dense = torch.zeros(len(self.pending)).index_add_(0, step, flat.square()).sqrt().tolist()
            table = torch.stack([t for _, t in self.pending]).float().cpu().tolist()
            steps = list(zip(dense, table, strict=True))
            self.pending.clear()
        if self.pending_blocks:
            blocks = [dict(zip(self.field_names, b, strict=True))
                      for b in torch.stack([t.cpu() for t in self.pending_blocks]).tolist()]
            self.pending_blocks.clear()
        return steps, blocks


def combine_rank_norms(per_rank: Sequence[tuple[list[tuple[float, float]], list[dict[str, float]]]],
                       ) -> tuple[list[tuple[float, float]], list[dict[str, float]]]:
    """One model's :meth:`GradNorms.drain` from every rank's, drained after the same steps (the sharded ranks step
    in lock-step): the dense norm is rank 0's (DDP's all-reduce left every rank the same dense gradient), the
    table's and each field block's ``sqrt(sum over ranks of norm^2)`` (each rank measured the rows of its own shard,
    and the shards are disjoint)."""
    steps = [(d, math.sqrt(sum(s[i][1] ** 2 for s, _ in per_rank)))
             for i, (d, _) in enumerate(per_rank[0][0])]
    blocks = [{f: math.sqrt(sum(b[i][f] ** 2 for _, b in per_rank)) for f in first}
              for i, first in enumerate(per_rank[0][1])]
    return steps, blocks


def combine_rank_updates(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """One model's :meth:`UpdateNorms.drain` from every rank's, of the same sampled step: the dense change is rank
    0's (DDP's replicas moved alike), the table's ``sqrt(sum over ranks of norm^2)`` (each rank measured its own
    shard's rows, and the shards are disjoint)."""
    out = {k: v for k, v in per_rank[0].items() if k == "dense"}
    if all("embedding" in r for r in per_rank):
        out["embedding"] = math.sqrt(sum(r["embedding"] ** 2 for r in per_rank))
    return out


class UpdateNorms:
    """The L2 norm of what one optimizer step changed, dense and embedding, sampled every ``every_s`` seconds
    (a copy of the dense weights and a gather of the touched rows, once per sample; nothing between)."""

    def __init__(self, every_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self._last = -math.inf
        self.sampling = False  # this step is sampled
        self._dense_before: list[torch.Tensor] | None = None
        self._rows: torch.Tensor | None = None
        self._rows_before: torch.Tensor | None = None
        self.latest: dict[str, float] = {}  # part -> norm of the last sampled step
        self._latest_t: dict[str, torch.Tensor] = {}
        self._table_done = False

    def start(self) -> bool:
        """Whether the step about to run is sampled (and so its changes are recorded)."""
        now = self.clock()
        self.sampling = False
        if now - self._last >= self.every_s:
            self._last = now
            self.begin()
        return self.sampling

    def begin(self) -> None:
        """Sample the step about to run, whatever the clock (the sharded trainer: on the steps its ranks agreed to
        sample, ``learner/sharded_trainer.py``)."""
        self.sampling = True
        self._rows = self._rows_before = None
        self._dense_before = None
        self._table_done = False

    def rows_before(self, weight: torch.Tensor, rows: torch.Tensor) -> None:
        """The table's ``rows`` (U,) as they are before this step updates them."""
        if self.sampling:
            self._rows = rows if self._rows is None else torch.cat([self._rows, rows])
            before = weight.detach().index_select(0, rows)
            self._rows_before = before if self._rows_before is None else torch.cat([self._rows_before, before])

    def rows_after(self, weight: torch.Tensor) -> None:
        """The change of the rows given to :meth:`rows_before` (none: the table did not change, 0)."""
        if not self.sampling:
            return
        if self._rows is None or self._rows_before is None:
            self.rows_changed([])
        else:
            self.rows_changed([(weight, self._rows, self._rows_before)])
        self._rows = self._rows_before = None

    def rows_changed(self, pieces: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """The table's change of this step, from pieces (weight (R, W) now, rows (U,) of it, those rows before the
        step (U, W)): one process's table is one piece, a sharded rank's each local shard of it (none: 0)."""
        if not self.sampling:
            return
        self._table_done = True
        sq = [(w.detach().index_select(0, rows).float() - before.float()).square().sum()
              for w, rows, before in pieces]  # () each
        self._latest_t["embedding"] = torch.stack(sq).sum().sqrt() if sq else torch.zeros(())

    def dense_before(self, params: Sequence[torch.Tensor]) -> None:
        if self.sampling:
            self._dense_before = [p.detach().clone() for p in params]

    def dense_after(self, params: Sequence[torch.Tensor]) -> None:
        if not self.sampling or self._dense_before is None:
            return
        diffs = torch._foreach_sub([p.detach() for p in params], self._dense_before)
        norms = torch._foreach_norm(diffs) if diffs else []
        self._latest_t["dense"] = (torch.linalg.vector_norm(torch.stack(list(norms)).float()) if norms
                                   else torch.zeros(()))
        self._dense_before = None

    def finish(self, weight: torch.Tensor) -> None:
        """End the step: a table not measured yet (no gradient reached it) changed by 0."""
        if self.sampling and not self._table_done:
            self.rows_after(weight)
        self.sampling = False

    def drain(self) -> dict[str, float]:
        """The norms of the last sampled step, per part (one sync, at most once per sample)."""
        if self._latest_t:
            self.latest.update({k: float(v) for k, v in self._latest_t.items()})
            self._latest_t.clear()
        return dict(self.latest)


class FieldCoverage:
    """Per field, the share of the last ``window`` samples that carry it (``observe`` each batch before its ids
    are mapped to rows). A single-valued categorical carries ``MISSING`` when absent: read from the batch's
    hashed ``keys`` when it has them (``FeatureConfig.keyed``: a user id or dynamic fields), else from its row,
    ``first + MISSING mod buckets`` (a present value hashing to that bucket counts as missing: 1 in ``buckets``).

    :meth:`shares` lists only the fields some sample has carried since this process started: a field that never
    arrived (``history`` is in every model, and a stream without histories has none) has not *stopped* arriving.
    A field that stopped before a restart is therefore not listed after it."""

    def __init__(self, cfg: FeatureConfig, window: int) -> None:
        self.cfg, self.window = cfg, max(1, window)
        self.names = [f.name for f in cfg.fields] + [f"dense.{d}" for d in cfg.dense]
        blocks = cfg.blocks
        self._missing_row = [first + MISSING % buckets for first, buckets in blocks]
        self._parts: deque[tuple[int, np.ndarray]] = deque()
        self._n = 0
        self._present = np.zeros(len(self.names), np.int64)
        self._ever = np.zeros(len(self.names), bool)  # carried by some sample since the start

    def counts(self, tb: TensorBatch) -> np.ndarray:
        """(fields + dense,) samples of ``tb`` carrying each field."""
        b = len(tb)
        out = np.zeros(len(self.names), np.int64)
        if b == 0:
            return out
        offsets = tb.offsets.numpy()
        values = tb.values.numpy()
        for i, f in enumerate(self.cfg.fields):
            start, end = int(offsets[i * b]), int(offsets[(i + 1) * b])
            if f.kind == "single" and end - start == b:
                vals = tb.keys[start:end] if tb.keys is not None else values[start:end]
                miss = MISSING if tb.keys is not None else self._missing_row[i]
                out[i] = int(np.count_nonzero(vals != miss))
            else:  # lists (and a single field with absent rows): a sample carries it when its bag is not empty
                out[i] = int(np.count_nonzero(np.diff(offsets[i * b:(i + 1) * b + 1])))
        if self.cfg.dense:
            out[len(self.cfg.fields):] = np.count_nonzero(tb.dense.numpy(), axis=0)
        return out

    def observe(self, tb: TensorBatch) -> None:
        self.add(len(tb), self.counts(tb))

    def add(self, n: int, c: np.ndarray) -> None:
        """``n`` samples of which ``c`` (fields + dense,) carried each field (:meth:`counts`; the sharded daemon's
        rank 0 adds every rank's counts of a round)."""
        if n == 0:
            return
        self._parts.append((n, c))
        self._n += n
        self._present += c
        self._ever |= c > 0
        while self._parts and self._n - self._parts[0][0] >= self.window:
            n0, c0 = self._parts.popleft()
            self._n -= n0
            self._present -= c0

    def shares(self) -> dict[str, float]:
        if self._n == 0:
            return {}
        return {name: float(p) / self._n
                for name, p, ever in zip(self.names, self._present.tolist(), self._ever.tolist(), strict=True) if ever}


class PositiveRate:
    """Share of positive labels among the last ``window`` samples trained; NaN until ``min_samples`` arrived
    (a first batch of negatives is no imbalance yet)."""

    def __init__(self, window: int, min_samples: int = 1000) -> None:
        self.window = max(1, window)
        self.min_samples = min(min_samples, self.window)
        self._parts: deque[tuple[int, float]] = deque()
        self._n = 0
        self._pos = 0.0

    def observe(self, labels: np.ndarray) -> None:
        n = len(labels)
        if n == 0:
            return
        pos = float(np.count_nonzero(np.asarray(labels) > 0.5))
        self._parts.append((n, pos))
        self._n += n
        self._pos += pos
        while self._parts and self._n - self._parts[0][0] >= self.window:
            n0, p0 = self._parts.popleft()
            self._n -= n0
            self._pos -= p0

    @property
    def samples(self) -> int:
        return self._n

    @property
    def rate(self) -> float:
        return self._pos / self._n if self._n >= self.min_samples else float("nan")
