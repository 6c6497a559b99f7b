"""The learner's side of the deltas (:mod:`learner.deltas` holds the format, the names and the reading of one file):
:class:`DeltaWriter` marks the rows a trained batch touched, writes them every ``deltas_every_s`` with the dense
weights (and the id maps), numbers them for good across restarts, removes a dead branch's files and announces each on
Redis (:func:`redis_notifier`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prometheus_client import Counter as PCounter
from torch import nn

from learner import checkpoint as ckpt_io
from learner.deltas import (
    ABANDONED,
    ABANDONED_KEEP,
    MAX_BYTES,
    PENDING,
    SEQ_FILE,
    DeltaError,
    covered,
    delta_path,
    encode_delta,
    list_deltas,
    load_delta,
    max_seq,
    read_abandoned,
    read_abandoned_file,
    read_seq_file,
    rough_bytes,
)
from learner.id_map import without_admitted
from learner.tensorpack import ALIGN, SigningKey, load_signing_key
from stream.config import RedisSettings
from stream.files import fsync_dir, open_regular, write_atomic
from stream.secrets import Secret

log = logging.getLogger("streamrec.deltas")

DELTA_WRITE_FAILURES = PCounter("streamrec_learner_delta_write_failures_total",
                                "Serving deltas that could not be written (a full disk, the directory gone); the rows "
                                "go out with the next one, training goes on.")


# -- writing ---------------------------------------------------------------------------------------
class DeltaWriter:
    """Marks the rows each trained batch touched; writes them (and the dense weights) every ``every_s``."""

    def __init__(self, directory: Path, num_rows: int, every_s: float, keep: int = 100,
                 notify: Callable[[int], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 id_maps_every_s: float = 60.0, lineage: str | None = None, key: SigningKey | None = None,
                 seq_file: Path | None = None) -> None:
        if every_s <= 0:
            raise ValueError(f"deltas every_s must be > 0 (0 turns deltas off upstream), got {every_s}")
        if keep < 1:
            raise ValueError(f"deltas keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.every_s, self.keep, self.notify, self.clock = every_s, keep, notify, clock
        self.lineage = lineage
        self.key = key  # signs every delta written (learner.tensorpack container format 2) when given
        self.touched = torch.zeros(num_rows, dtype=torch.bool)  # (num_rows,)
        # (num_rows,) rows handed to another id (evicted or admitted) since the last delta that carried the id maps:
        # held back until one does (:meth:`hold`)
        self.held = torch.zeros(num_rows, dtype=torch.bool)
        self.pending_path = self.directory / PENDING
        self._pending_ok = True  # False after a failed append, until the next delta starts a new list
        self._restore_pending()
        # seq_file: the checkpoint directory's DELTA_SEQ (module docstring "Numbering"); None: the directory alone
        self.seq_file = Path(seq_file) if seq_file is not None else None
        on_disk, used = max_seq(self.directory), read_seq_file(self.seq_file)
        if used > on_disk:
            log.warning("deltas directory %s holds no delta past seq %d, but this lineage already wrote up to %d "
                        "(%s): the directory was emptied or replaced; numbering continues at %d, so serving "
                        "cannot mistake the new deltas for ones it applied", self.directory, on_disk, used,
                        self.seq_file, used + 1)
        self.seq = self._reserved = max(on_disk, used)
        self._last = clock()
        self.written = 0
        self.failed = 0  # writes that failed (OSError): survived, retried at the next due time
        self._unprunable: set[Path] = set()  # deltas a prune could not remove (each logged once)
        # the learner's id maps (RowMapper.state_dict), sent with a delta at most every id_maps_every_s
        self.id_maps_source: Callable[[], dict[str, Any]] | None = None
        self.id_maps_every_s = id_maps_every_s
        self._last_maps = -float("inf")

    @classmethod
    def from_settings(cls, ls: Any, num_rows: int, key: SigningKey | None = None,
                      redis_settings: RedisSettings | None = None) -> DeltaWriter:
        """From ``streamrec.settings.LearnerSettings`` (``deltas_*``), announcing each delta on the Redis of
        ``redis_settings`` (the [redis] settings: url, credentials, TLS) when given; the deprecated
        ``ls.deltas_redis_url``, when set, replaces only their url. Neither: no announcement (serving polls).
        The lineage is the one of ``ls.checkpoint_dir`` (created there if the directory has none yet), and so is
        the record of the seqs it used (``DELTA_SEQ``).
        Deltas are signed with ``key``, or (when not given) the key in ``ls.signing_key_file`` if one is set."""
        channel = ls.deltas_channel or (redis_settings or RedisSettings()).deltas_channel  # "" = the prefix's channel
        target = redis_settings
        deprecated_url = getattr(ls, "deltas_redis_url", None)
        if deprecated_url:
            log.warning("[learner] deltas_redis_url is deprecated: the learner announces deltas on the [redis] url "
                        "with its credentials; remove deltas_redis_url (STREAMREC_LEARNER_DELTAS_REDIS_URL)")
            target = _with_url(target or RedisSettings(), deprecated_url)
        notify = redis_notifier(target, channel) if target is not None else None
        if key is None:
            key = load_signing_key(getattr(ls, "signing_key_file", None))
        return cls(Path(ls.deltas_dir), num_rows, ls.deltas_every_s, keep=ls.deltas_keep, notify=notify,
                   id_maps_every_s=ls.deltas_id_maps_every_s, lineage=ckpt_io.lineage(Path(ls.checkpoint_dir)),
                   key=key, seq_file=Path(ls.checkpoint_dir) / SEQ_FILE)

    def mark(self, values: torch.Tensor) -> None:
        """Rows of one trained batch (``TensorBatch.values``, (N,) int64; duplicates are fine). The rows not
        marked yet are appended to the pending list (``PENDING``), so they survive a restart."""
        values = values.to(self.touched.device)
        fresh = values[~self.touched[values]]
        if len(fresh) == 0:
            return
        fresh = torch.unique(fresh)
        self.touched[fresh] = True
        self._append_pending(fresh)

    def resend_all(self, why: str) -> None:
        """Mark every row, so the next delta carries the whole table (in parts past :data:`MAX_BYTES`) with the dense
        weights and the id maps: the learner's restore went back past newer checkpoints (``why`` names them), whose
        artifact serving may run with their deltas applied; the restart's usual resend (every admitted id's row)
        left the other rows they changed at their values there (module docstring)."""
        log.warning("%s: the next delta resends all %d rows, so serving, which may run an artifact of them, ends on "
                    "this training's state", why, len(self.touched))
        self.mark(torch.arange(len(self.touched), device=self.touched.device))

    def abandon_after(self, seq: int | None, samples_trained: int | None = None) -> None:
        """Remove the deltas numbered past ``seq``, the ``delta_seq`` of the checkpoint the learner resumed from (None:
        not known, nothing removed): written after it by the training the restore threw away, a dead branch. Left in
        the directory, an artifact of a later checkpoint (its ``delta_seq`` past them, its count below theirs) took
        them for a restarted numbering, counted a rewind and applied them
        (:meth:`~learner.delta_reader.DeltaReader.newer`). This writer's numbering stays past them (a seq is never used
        twice); a reader that had not read them counts them pruned.

        Serving may have applied them: the rows they carry are marked first (and the pending list synced before any
        file goes), so the next delta sends each with this learner's value. The restart's usual resend (admitted ids'
        rows, the pending list) left the item and bucket rows only they touched at the dead training's values in
        serving until the next artifact. One that cannot be read, or pruned by the dead run itself (``keep``: its
        deltas on disk start after a hole no restart recorded abandoned), or gone with the directory (emptied or
        replaced: ``DELTA_SEQ`` says seqs past the checkpoint's were taken, neither a file nor a record here says which
        rows they carried): every row is resent (:meth:`resend_all`).
        One at the checkpoint's own ``samples_trained`` (an earlier restart's first delta, nothing trained since) holds
        the checkpoint's values, this learner's: not read (a fallback's resend of every row is not resent again)."""
        if seq is None:
            return
        listed = [(s, n, p) for s, n, p in list_deltas(self.directory) if s > seq]
        found, dead = [(p, n) for _, n, p in listed], [p for _, _, p in listed]
        first = listed[0][0] if listed else seq + 1  # (a hole before it no earlier restart recorded: pruned unread)
        gone = first - 1 - seq
        if gone > 0 and covered(seq + 1, first - 1, read_abandoned(self.directory, self.lineage)) < gone:
            self.resend_all(f"deltas {seq + 1}..{first - 1} of the abandoned training (after the checkpoint's delta "
                            f"seq {seq}) were pruned before this restart (deltas_keep) and cannot be read")
        # Seqs this lineage took past the checkpoint (DELTA_SEQ) with no file or abandoned record here: the directory
        # was emptied or replaced, and serving may have applied them. One is no sign: the last seq reserved may never
        # have been written (a crash, a failed write), unless the directory lost even the checkpoint's own seq.
        untraced = self.seq - max(on_disk := max_seq(self.directory), seq)
        if (untraced > 1 or (untraced > 0 and on_disk < seq)) and not bool(self.touched.all()):
            self.resend_all(f"deltas {seq + 1}..{self.seq} of the abandoned training (after the checkpoint's delta seq "
                            f"{seq}) are not in {self.directory} (emptied or replaced) and cannot be read")
        for p in (p for p, n in found if n != samples_trained):
            if bool(self.touched.all()):
                break
            try:
                self.mark(load_delta(p).rows)
            except FileNotFoundError:
                continue
            except (DeltaError, OSError) as exc:
                self.resend_all(f"delta {p.name} of the abandoned training cannot be read ({exc})")
        if dead:
            self.sync()
        if self.seq > seq:  # (seqs reserved and never written too: no reader ever gets them)
            self._record_abandoned(seq + 1, self.seq)
        for p in list(dead):
            try:  # (EPERM, EROFS: logged; raised, the learner did not start, for a side output)
                p.unlink(missing_ok=True)
            except OSError as exc:
                dead.remove(p)
                log.error("cannot remove %s of the training the restore threw away (%s): an artifact of a later "
                          "checkpoint may apply it; remove it by hand", p, exc)
        if dead:
            log.warning("removed deltas %s..%s of the training after the checkpoint resumed from (delta seq %d): "
                        "serving never applies them; this learner's deltas go on at seq %d", dead[0].name,
                        dead[-1].name, seq, self.seq + 1)

    def _record_abandoned(self, first: int, last: int) -> None:
        """Add ``first..last`` to :data:`ABANDONED` (the last :data:`ABANDONED_KEEP` ranges kept). A record that
        cannot be written is logged: a reader that missed them then counts them as a gap. A range the lineage's lines
        already hold is not added again: each restart of a crash loop added it, and 64 of them pushed out every older
        range (a reader then counted those seqs as pruned unread)."""
        path = self.directory / ABANDONED
        had = read_abandoned_file(path)
        if covered(first, last, [(a, b) for a, b, lin in had if lin == str(self.lineage)]) == last - first + 1:
            return
        lines = [f"{a} {b} {lin}" for a, b, lin in had] + [f"{first} {last} {self.lineage}"]
        try:
            write_atomic(path, ("\n".join(lines[-ABANDONED_KEEP:]) + "\n").encode())
        except OSError as exc:
            log.warning("cannot record the abandoned deltas %d..%d in %s (%s): a serving process that had not read "
                        "them counts them as pruned", first, last, path, exc)

    def hold(self, rows: np.ndarray) -> None:
        """Rows (global, (R,) int64) the id maps just handed to another id (evicted, admitted). Serving maps ids with
        the maps of the last delta that carried them: a delta without maps that sent such a row served the id that
        left it the vector of the id that took it. So they wait, marked, for the next delta with the maps."""
        if len(rows):
            self.held[torch.from_numpy(np.asarray(rows, dtype=np.int64))] = True

    def _append_pending(self, fresh: torch.Tensor) -> None:
        if not self._pending_ok or not len(fresh):
            return
        try:  # (non-blocking: a FIFO in its place is ENXIO, not a wait for a reader for ever)
            fd = os.open(self.pending_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
            with os.fdopen(fd, "ab") as fh:
                fh.write(fresh.cpu().numpy().astype("<i8", copy=False).tobytes())
        except OSError as exc:
            self._pending_ok = False
            log.warning("cannot append to %s (%s): rows marked until the next delta are sent only if this process "
                        "lives to write it", self.pending_path, exc)

    def _restore_pending(self) -> None:
        """Mark the rows a previous writer on this directory marked and never wrote (rows outside this table,
        from another config, and a torn last entry are left out). A list that cannot be read (permissions, a disk
        error, a directory or a FIFO in its place: :func:`~stream.files.open_regular`) is logged and the learner
        starts: those rows reach serving with the next artifact (as for a list :meth:`sync` cannot make durable).
        Raised, it stopped the learner at start for a side output."""
        try:
            with open_regular(self.pending_path) as (fh, _):
                raw = fh.readall()
        except FileNotFoundError:
            return
        except OSError as exc:
            self._pending_ok = False  # not appended to either, until the next delta starts a new list
            log.warning("cannot read %s (%s): the rows it lists reach serving with the next artifact, not with the "
                        "next delta; the learner starts", self.pending_path, exc)
            return
        rows = np.frombuffer(raw, dtype="<i8", count=len(raw) // 8).astype(np.int64)
        rows = rows[(rows >= 0) & (rows < len(self.touched))]
        self.touched[torch.from_numpy(rows).to(self.touched.device)] = True
        if len(rows):
            log.info("%d row(s) marked before a restart and not in any delta yet go out with the next one", len(rows))

    def sync(self) -> None:
        """Make the pending list durable (the daemon calls it with each checkpoint). A list that cannot be (an fsync
        that fails: EIO, ENOSPC on a deltas volume that filled up) is logged and the checkpoint goes on: after a crash
        before the next delta, the rows trained since the last one may then reach serving only with the next
        artifact. Raised, it failed every checkpoint, the one at exit too, for a side output."""
        try:
            fd = os.open(self.pending_path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO there would block the checkpoint
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("cannot open %s to make it durable (%s); the checkpoint goes on", self.pending_path, exc)
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                log.warning("%s is not a regular file: not made durable; the checkpoint goes on", self.pending_path)
                return
            os.fsync(fd)
            fsync_dir(self.directory)
        except OSError as exc:
            log.warning("cannot make %s durable (%s): the rows trained since the last delta may reach serving only "
                        "with the next artifact if the learner stops before the next delta; the checkpoint goes on",
                        self.pending_path, exc)
        finally:
            os.close(fd)

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
        due = self.id_maps_source is not None and self.maps_due()  # the maps are built only for a delta written
        rows = (self.touched if due else self.touched & ~self.held).nonzero().squeeze(1)  # (R,)
        if len(rows) == 0:
            return None
        maps = self.id_maps_source() if due and self.id_maps_source is not None else None
        weight: torch.Tensor = model.sparse.bag.weight  # type: ignore[union-attr,assignment]  # (num_rows, D + 1)
        vectors = weight[rows.to(weight.device)].float().cpu()  # (R, D + 1)
        return self.write_rows(rows.cpu(), vectors, dense_weights(model), samples_trained, maps)

    def maps_due(self) -> bool:
        """Whether the next delta should carry the id maps (``id_maps_every_s`` passed since the last that did)."""
        return self.clock() - self._last_maps >= self.id_maps_every_s

    def write_rows(self, rows: torch.Tensor, vectors: torch.Tensor, dense_state: dict[str, torch.Tensor],
                   samples_trained: int, id_maps: dict[str, Any] | None = None) -> Path | None:
        """Write one delta of ``rows`` (R,) int64 with their ``vectors`` (R, D + 1) float32 and the dense weights,
        then clear the marks: :meth:`write`'s second half, called directly by the distributed mode's rank 0
        (``learner/sharded_deltas.py``), which gathers the rows from the ranks that hold them, and the id maps
        (``id_maps``, ``RowMapper.state_dict``) from the ranks' shares when :meth:`maps_due`. Without ``id_maps``
        the delta carries ``id_maps_source()`` when one is set and due.

        A write that fails (a full disk, the directory gone) is survived, as a checkpoint's is: logged, counted
        (``failed``, ``streamrec_learner_delta_write_failures_total``), nothing is half-visible (the file is written
        aside and renamed), the marks and the pending list stay, and the next due time tries again with the same
        seq (serving sees no gap), and the maps with it when it carried them; None is returned. Training goes on.
        A delta past the reader's :data:`MAX_BYTES` goes out in parts (module docstring "Parts"); the last one's
        path is returned."""
        if id_maps is None and self.id_maps_source is not None and self.maps_due():
            id_maps = self.id_maps_source()
        bounds = self._parts(rows, vectors, dense_state, samples_trained, id_maps)
        path = None
        for i, (lo, hi) in enumerate(bounds):
            last = i == len(bounds) - 1
            maps = id_maps if last or id_maps is None or i else {n: without_admitted(m) for n, m in id_maps.items()}
            if (path := self._write_one(rows[lo:hi], vectors[lo:hi], dense_state, samples_trained,
                                        None if not last and i else maps, last and id_maps is not None)) is None:
                return None
        return path

    def _parts(self, rows: torch.Tensor, vectors: torch.Tensor, dense_state: dict[str, torch.Tensor],
               samples_trained: int, id_maps: dict[str, Any] | None) -> list[tuple[int, int]]:
        """``[lo, hi)`` of the rows of each part, every one within :data:`MAX_BYTES` (module docstring "Parts")."""
        def size(n: int, maps: dict[str, Any] | None) -> int:  # the file bytes with n rows (+ header digits)
            payload = {"seq": self.seq + 1, "samples_trained": int(samples_trained), "created": time.time(),
                       "lineage": self.lineage, "rows": rows[:0], "vectors": vectors[:0], "dense_state": dense_state}
            return len(encode_delta({**payload, **({"id_maps": maps} if maps is not None else {})}, self.key)) + (
                n * (rows.element_size() + vectors[:1].numel() * vectors.element_size()) + 2 * ALIGN + 64)

        rough = rough_bytes([rows, vectors, dense_state, id_maps])  # an upper bound without encoding (cheap)
        if rough <= MAX_BYTES or size(len(rows), id_maps) <= MAX_BYTES:
            return [(0, len(rows))]
        empty = {n: without_admitted(m) for n, m in id_maps.items()} if id_maps is not None else None
        fixed = [size(0, m) for m in (empty, None, id_maps)]  # first part, middle parts, last part
        row_bytes = size(1, None) - fixed[1]
        caps = [(MAX_BYTES - f) // row_bytes for f in fixed]
        if min(caps) < 1:
            log.error("a delta's id maps and dense weights alone come near the reader's %d-byte limit: written as "
                      "one delta, which serving refuses; lower id_capacity or raise the limit", MAX_BYTES)
            return [(0, len(rows))]
        bounds: list[tuple[int, int]] = []
        lo = 0
        while len(rows) - lo > caps[2]:
            step = min(caps[0] if not bounds else caps[1], len(rows) - lo - caps[2])  # (the last part full)
            bounds.append((lo, lo + step))
            lo += step
        return [*bounds, (lo, len(rows))]

    def _write_one(self, rows: torch.Tensor, vectors: torch.Tensor, dense_state: dict[str, torch.Tensor],
                   samples_trained: int, id_maps: dict[str, Any] | None, full_maps: bool) -> Path | None:
        """One delta file (:meth:`write_rows`); ``full_maps``: ``id_maps`` are the learner's (not a part's first)."""
        seq = self.seq + 1
        self._reserve(seq)
        payload: dict[str, Any] = {"seq": seq, "samples_trained": int(samples_trained), "created": time.time(),
                                   "lineage": self.lineage, "rows": rows, "vectors": vectors,
                                   "dense_state": dense_state}
        if id_maps is not None:
            payload["id_maps"] = id_maps
        data = encode_delta(payload, self.key)
        path = delta_path(self.directory, seq, int(samples_trained))
        try:
            self.directory.mkdir(parents=True, exist_ok=True)  # (a directory removed meanwhile is made again)
            write_atomic(path, data)
        except OSError as exc:
            self.failed += 1
            DELTA_WRITE_FAILURES.inc()
            log.error("delta %d could not be written to %s (%s); training goes on, the rows stay marked and go out "
                      "with the next delta", seq, self.directory, exc)
            if path.exists():  # in place, not known durable (the directory's fsync failed): its seq is taken
                self.seq = seq  # (a retry under it left two deltas of one seq: a reader skipped the second for good)
            return None
        self.seq = seq
        if full_maps:  # (only now: after a failed write the maps stay due, the retry carries them)
            self.held.zero_()
            self._last_maps = self.clock()
        self.touched[rows.to(self.touched.device)] = False  # the rows held back stay marked (and listed) for later
        try:  # everything it listed is in the durable delta now
            self.pending_path.unlink(missing_ok=True)
            self._pending_ok = True
        except OSError as exc:  # the old rows go out once more after a restart: harmless
            log.warning("cannot remove %s (%s)", self.pending_path, exc)
        self._append_pending(self.touched.nonzero().squeeze(1))
        self.written += 1
        self._prune()
        if self.notify is not None:
            try:
                self.notify(self.seq)
            except Exception as exc:  # noqa: BLE001 - a lost notification only delays serving to its next poll
                from learner.kafka_dataset import worker_died  # (here: serving imports this module, not Kafka's)

                if worker_died(exc):  # torch says it once, wherever the learner is (learner/lag.py): not Redis's
                    raise
                log.warning("delta %d written but not announced (%s); serving picks it up when it polls", self.seq, exc)
        return path

    def _prune(self) -> None:
        """Remove the deltas past the newest ``keep``. One that cannot be removed (EPERM, EROFS) is logged once (while
        it stays) and left: raised, it left ``write_rows`` (``after_step``) and stopped training, for a side output,
        though the delta just written was durable. A reader only reads more files meanwhile. A listing that fails
        (EIO) is logged too: raised, it stopped training the same way, after the delta was in place."""
        try:
            listed = [p for _, _, p in list_deltas(self.directory)]  # (oldest first)
        except OSError as exc:  # a directory that cannot be listed now (EIO): the delta just written stands
            ckpt_io.PRUNE_FAILURES.labels("deltas").inc()
            log.warning("cannot list %s to prune it (%s); the next delta prunes it", self.directory, exc)
            return
        self._unprunable &= set(listed)  # (gone since: forgotten)
        short = False
        for old in listed[:-self.keep]:
            try:
                old.unlink(missing_ok=True)
            except OSError as exc:
                short = True
                if old not in self._unprunable:
                    self._unprunable.add(old)
                    log.error("cannot prune %s (%s): the deltas directory keeps more than deltas_keep files until it "
                              "can be removed; training goes on", old, exc)
        if short:
            ckpt_io.PRUNE_FAILURES.labels("deltas").inc()

    def _reserve(self, seq: int) -> None:
        """Record ``seq`` in the seq file before any delta carries it (module docstring "Numbering"). A record that
        cannot be written is logged and the delta still goes out: only an emptied deltas directory on top of it
        could make a later writer use the seq again."""
        if self.seq_file is None or seq <= self._reserved:
            return
        try:
            write_atomic(self.seq_file, str(seq).encode())
        except OSError as exc:
            log.warning("cannot record delta seq %d in %s (%s); should the deltas directory be emptied before it is "
                        "recorded, a restarted learner could number a delta %d again", seq, self.seq_file, exc, seq)
            return
        self._reserved = seq


def dense_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every non-embedding weight of ``model`` (its state dict without ``sparse.*``), on the CPU, floats as float32:
    a delta's ``dense_state``."""
    return {k: v.detach().float().cpu().clone() if v.is_floating_point() else v.detach().cpu().clone()
            for k, v in model.state_dict().items() if not k.startswith("sparse.")}


def _with_url(rs: RedisSettings, url: str) -> RedisSettings:
    """``rs`` at ``url`` (the deprecated ``deltas_redis_url``): credentials in the url replace those of ``rs``,
    and the TLS files stay only for a rediss:// url."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    changes: dict[str, Any] = {"url": url}
    if parts.password:
        changes.update(password=Secret(""), password_file=None, password_env=None)
    if parts.username:
        changes["username"] = ""
    if parts.scheme != "rediss":
        changes.update(ssl_ca_certs=None, ssl_certfile=None, ssl_keyfile=None)
    return dataclasses.replace(rs, **changes)


def redis_notifier(target: RedisSettings | str, channel: str) -> Callable[[int], None]:
    """``PUBLISH channel seq`` on the Redis of ``target`` (the [redis] settings with their credentials and TLS,
    or a bare url); the client connects lazily and reconnects. A failed PUBLISH raises a
    :class:`~stream.redis_client.RedisFailure` whose one line names the Redis (url redacted) and the cause. The
    timeout bounds each whole reply (``whole_reply``): a Redis trickling its replies held the learner's training step
    for as long as it trickled (each read within the timeout), and now fails the announcement after 1 s a try."""
    import redis

    from stream.redis_client import connect, failure

    settings = target if isinstance(target, RedisSettings) else RedisSettings(url=target)
    client = connect(settings, timeout_s=1.0, retries=1, whole_reply=True)

    def notify(seq: int) -> None:
        try:
            client.publish(channel, str(seq))
        except (redis.RedisError, OSError) as exc:
            raise failure(exc, settings) from exc

    return notify
