"""Deltas: what the learner changed since the last one, so serving stays fresh between nightly refreshes.

    learner                                            serving
    trained batch --mark(values)--> touched (num_rows,) bool
    every deltas_every_s: delta-<seq>.pt  ----------->  DeltaReader.newer(seq, samples) -> apply_delta
                          + PUBLISH <prefix>:model-deltas <seq>   (wakes serving; it also polls the directory)

One delta file (``torch.save`` of a dict, format 1)::

    format           1
    seq              int, 1, 2, ... (continues after the largest file in the directory across restarts)
    samples_trained  the learner's sample count when it was written
    created          unix time, seconds
    rows             (R,) int64       every row of the fused table touched since the previous delta
    vectors          (R, D + 1) f32   their current values (embedding + first-order weight), absolute
    dense_state      {name: tensor}   every non-embedding weight of the model (MLP, bias), absolute
    id_maps          (optional)       the learner's id maps (learner/row_mapper.py), at most every
                                      id_maps_every_s: ids admitted after the artifact get their own rows

Values are absolute, not increments: applying deltas in ``seq`` order over any model that is at least as
old as the first one gives the learner's current rows, and a delta written before an artifact's source
checkpoint (``samples_trained`` not greater) is already in that artifact and is skipped. Files are
written to a temporary name, fsynced and renamed, so a reader never sees half of one; the last
``keep`` are kept (a reader that falls further behind than that waits for the next artifact for the
rows it missed, and counts the gap).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger("streamrec.deltas")

FORMAT = 1
_PREFIX = "delta-"


@dataclass(frozen=True)
class Delta:
    seq: int
    samples_trained: int
    created: float
    rows: torch.Tensor  # (R,) int64
    vectors: torch.Tensor  # (R, D + 1) float32
    dense_state: dict[str, torch.Tensor]
    path: Path
    id_maps: dict[str, Any] | None = None  # RowMapper.state_dict() when this delta carries one


def delta_path(directory: Path, seq: int, samples_trained: int) -> Path:
    """``delta-<seq>-<samples_trained>.pt``: readers skip deltas by name, without loading them."""
    return directory / f"{_PREFIX}{seq:012d}-{samples_trained:015d}.pt"


def list_deltas(directory: Path) -> list[tuple[int, int, Path]]:
    """``(seq, samples_trained, path)`` of the complete delta files, oldest first."""
    if not directory.is_dir():
        return []
    out = []
    for p in directory.glob(f"{_PREFIX}*.pt"):
        try:
            seq, samples = p.stem[len(_PREFIX):].split("-")
            out.append((int(seq), int(samples), p))
        except ValueError:
            continue
    return sorted(out)


def load_delta(path: Path) -> Delta:
    d = torch.load(path, map_location="cpu", weights_only=True)
    if d.get("format") != FORMAT:
        raise ValueError(f"delta {path} has format {d.get('format')!r}; this streamrec reads {FORMAT}")
    return Delta(int(d["seq"]), int(d["samples_trained"]), float(d["created"]), d["rows"], d["vectors"],
                 d["dense_state"], path, d.get("id_maps"))


class DeltaWriter:
    """Marks the rows each trained batch touched; writes them (and the dense weights) every ``every_s``."""

    def __init__(self, directory: Path, num_rows: int, every_s: float, keep: int = 100,
                 notify: Callable[[int], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 id_maps_every_s: float = 60.0) -> None:
        if every_s <= 0:
            raise ValueError(f"deltas every_s must be > 0 (0 turns deltas off upstream), got {every_s}")
        if keep < 1:
            raise ValueError(f"deltas keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.every_s, self.keep, self.notify, self.clock = every_s, keep, notify, clock
        self.touched = torch.zeros(num_rows, dtype=torch.bool)  # (num_rows,)
        existing = list_deltas(self.directory)
        self.seq = existing[-1][0] if existing else 0
        self._last = clock()
        self.written = 0
        # the learner's id maps (RowMapper.state_dict), sent with a delta at most every id_maps_every_s
        self.id_maps_source: Callable[[], dict[str, Any]] | None = None
        self.id_maps_every_s = id_maps_every_s
        self._last_maps = -float("inf")

    @classmethod
    def from_settings(cls, ls: Any, num_rows: int) -> DeltaWriter:
        """From ``streamrec.settings.LearnerSettings`` (``deltas_*``), announcing on Redis when configured."""
        notify = redis_notifier(ls.deltas_redis_url, ls.deltas_channel) if ls.deltas_redis_url else None
        return cls(Path(ls.deltas_dir), num_rows, ls.deltas_every_s, keep=ls.deltas_keep, notify=notify,
                   id_maps_every_s=ls.deltas_id_maps_every_s)

    def mark(self, values: torch.Tensor) -> None:
        """Rows of one trained batch (``TensorBatch.values``, (N,) int64; duplicates are fine)."""
        self.touched[values.to(self.touched.device)] = True

    def due(self) -> bool:
        return self.clock() - self._last >= self.every_s

    def after_step(self, trainer: Any, values: torch.Tensor) -> Path | None:
        """The daemon's hook after each trained batch: mark, and when due apply any pending
        (accumulated) gradient so the rows written are the trained ones, then write."""
        self.mark(values)
        if not self.due():
            return None
        trainer.step()
        return self.write(trainer.model, trainer.samples)

    @torch.no_grad()
    def write(self, model: nn.Module, samples_trained: int) -> Path | None:
        """Write one delta of the rows marked since the last one; None when nothing was trained."""
        self._last = self.clock()
        rows = self.touched.nonzero().squeeze(1)  # (R,)
        if len(rows) == 0:
            return None
        weight = model.sparse.bag.weight  # type: ignore[union-attr]  # (num_rows, D + 1)
        vectors = weight[rows.to(weight.device)].float().cpu()  # (R, D + 1)
        dense_state = {k: v.detach().float().cpu().clone() if v.is_floating_point() else v.detach().cpu().clone()
                       for k, v in model.state_dict().items() if not k.startswith("sparse.")}
        self.seq += 1
        payload = {"format": FORMAT, "seq": self.seq, "samples_trained": int(samples_trained), "created": time.time(),
                   "rows": rows.cpu(), "vectors": vectors, "dense_state": dense_state}
        if self.id_maps_source is not None and self._last - self._last_maps >= self.id_maps_every_s:
            payload["id_maps"] = self.id_maps_source()
            self._last_maps = self._last
        path = delta_path(self.directory, self.seq, int(samples_trained))
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        self.touched.zero_()
        self.written += 1
        for _, _, old in list_deltas(self.directory)[:-self.keep]:
            old.unlink(missing_ok=True)
        if self.notify is not None:
            try:
                self.notify(self.seq)
            except Exception as exc:  # noqa: BLE001 - a lost notification only delays serving to its next poll
                log.warning("delta %d written but not announced (%s); serving picks it up when it polls", self.seq, exc)
        return path


def redis_notifier(url: str, channel: str) -> Callable[[int], None]:
    """``PUBLISH channel seq`` on a Redis at ``url`` (the client connects lazily and reconnects)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)

    def notify(seq: int) -> None:
        client.publish(channel, str(seq))

    return notify


class DeltaReader:
    """Serving's side: the deltas a model has not seen yet, in order."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.gaps = 0  # deltas pruned before this reader got to them
        self.bad = 0  # unreadable files skipped
        self._bad: set[Path] = set()

    def mark_bad(self, path: Path) -> None:
        """Never yield ``path`` again (it could not be applied)."""
        self.bad += 1
        self._bad.add(path)

    def latest_seq(self) -> int:
        found = list_deltas(self.directory)
        return found[-1][0] if found else 0

    def newer(self, after_seq: int, after_samples: int) -> Iterator[Delta]:
        """Deltas with ``seq > after_seq`` and ``samples_trained > after_samples``, oldest first. The ones
        at or below ``after_samples`` are already in the model's source checkpoint: skipped by name."""
        expected = after_seq + 1
        for seq, samples, path in list_deltas(self.directory):
            if seq <= after_seq:
                continue
            if seq > expected and after_seq > 0:
                self.gaps += seq - expected
                log.warning("deltas %d..%d were pruned before serving read them; their rows wait for the next "
                            "artifact", expected, seq - 1)
            expected = seq + 1
            if samples <= after_samples or path in self._bad:
                continue
            try:
                d = load_delta(path)
            except FileNotFoundError:
                continue  # pruned between listing and reading
            except Exception as exc:  # noqa: BLE001 - a corrupt file must not stop the ones after it
                self.mark_bad(path)
                log.error("delta %s is unreadable (%s); skipped", path, exc)
                continue
            yield d
