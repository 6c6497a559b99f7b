"""Serving's side of the deltas (:mod:`learner.deltas` holds the format, the names and the reading of one file):
:class:`DeltaReader` yields the deltas a model has not seen yet, in order, each checked before it is yielded; gaps,
rewinds, transient shortages and bad files are counted and said.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from learner.deltas import (
    SUFFIX,
    TRANSIENT_TRIES,
    Delta,
    DeltaError,
    covered,
    list_deltas,
    load_delta,
    parse_name,
    read_abandoned,
    transient,
)
from learner.tensorpack import SigningKey

log = logging.getLogger("streamrec.deltas")

_REMEMBER = 1024  # gap ranges and rewind positions a reader remembers having counted


# -- reading ---------------------------------------------------------------------------------------
def _fingerprint(path: Path) -> tuple[str, int, int] | None:
    """``(path, size, mtime)`` of this version of a file; None when it is gone. A file that cannot be looked at (a
    symlink loop, an I/O error, a stale NFS handle) is fingerprinted by its name and error, so it is rejected once."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return (str(path), -1, -(exc.errno or 1))
    return (str(path), st.st_size, st.st_mtime_ns)


_Version = tuple[str, int, int]  # a file version: _fingerprint's (path, size, mtime)


@dataclass
class _Shortages:
    """One step of using a delta (its read, its application) failing for want of a resource of this process: per file
    version the consecutive rounds it failed so, and the versions failing so in the current round. Reads and
    applications keep one each: a read that succeeds says nothing of an application that runs out of memory every
    round (it reset such a delta's tries, and it was retried for ever)."""

    failing: dict[_Version, int] = dataclasses.field(default_factory=dict)  # version -> consecutive rounds failed
    now: set[_Version] = dataclasses.field(default_factory=set)  # versions failing so in this round

    def prune(self, live: set[str]) -> None:
        """Forget the versions of files no longer listed (pruned, replaced)."""
        self.failing = {fp: n for fp, n in self.failing.items() if fp[0] in live}


class DeltaReader:
    """Serving's side: the deltas a model has not seen yet, in order, each checked before it is yielded.

    ``on_reject(path, reason)`` hears of every file rejected (once per file version), ``on_skip(path,
    reason)`` of every delta passed over on purpose (another lineage). Rejections of unreadable files are
    remembered for good (a read failing for want of a resource of this process is first retried, :attr:`retries`,
    up to :data:`TRANSIENT_TRIES` rounds in a row; so is a yielded delta whose application failed so,
    :meth:`retry_apply`); :meth:`mark_unfit` remembers a delta that did not fit the live
    model only until :meth:`forget_unfit` (called when another artifact is swapped in: it may fit that one). With
    ``key`` (serving's signing key) only deltas signed with it are yielded; the others are rejected.
    """

    def __init__(self, directory: Path, on_reject: Callable[[Path, str], None] | None = None,
                 on_skip: Callable[[Path, str], None] | None = None, key: SigningKey | None = None) -> None:
        self.directory = Path(directory)
        self.key = key
        self.gaps = 0  # deltas pruned before this reader got to them
        self.rewinds = 0  # times the directory's numbering went back behind a model's seq (newer re-based)
        self._gapped: list[tuple[int, int]] = []  # missing seqs (first, last) already counted
        self._rewound: set[tuple[int, int]] = set()  # positions (seq, samples) a rewind was already counted at
        # seqs never (again) counted as gaps: those this reader got to (rejected, passed over: their loss is told
        # through on_reject/on_skip) and those counted when pruned between listing and reading; the newest _REMEMBER
        self._settled: set[int] = set()
        self.bad = 0  # unreadable files skipped
        self.on_reject, self.on_skip = on_reject, on_skip
        self._bad: set[tuple[str, int, int]] = set()
        self._unfit: set[tuple[str, int, int]] = set()
        self.retries = 0  # reads or applications of a delta that failed transiently and were left for the next round
        self._reads, self._applies = _Shortages(), _Shortages()  # (kept apart: _Shortages)
        self.retrying: Path | None = None  # the delta the last round ended at, read again next round (None: none)
        # file version -> (lineage, created) read in it
        self._stamps: dict[tuple[str, int, int], tuple[str | None, float]] = {}

    def mark_bad(self, path: Path, reason: str = "could not be applied") -> None:
        """Never yield this version of ``path`` again."""
        fp = _fingerprint(path)
        if fp is None or fp in self._bad:
            return
        self.bad += 1
        self._bad.add(fp)
        self._settle(path)
        if self.on_reject is not None:
            self.on_reject(path, reason)
        else:
            log.error("delta %s rejected, skipped (the deltas after it still apply): %s", path.name, reason)

    def _retry_later(self, fp: _Version, path: Path, exc: BaseException) -> bool:
        """Whether the read of ``path`` (version ``fp``) that raised ``exc`` is left for the next round: a transient
        failure (``MemoryError``, an errno of :data:`~learner.deltas.TRANSIENT_ERRNOS`) short of :data:`TRANSIENT_TRIES`
        rounds in a row (:meth:`_again`). Any other failure ends the tries."""
        if not transient(exc):
            self._reads.failing.pop(fp, None)
            return False
        return self._again(self._reads, fp, path, f"could not be read ({type(exc).__name__}: {exc})", "retried")

    def retry_apply(self, path: Path, exc: BaseException) -> bool:
        """Whether delta ``path``, yielded by :meth:`newer`, whose application raised ``exc`` for want of a resource
        of this process (memory, descriptors: the caller's judgement, not a misfit) is yielded again next round rather
        than rejected: the rule of a read failing so (:meth:`_again`), with tries of its own. The caller ends the
        round there (values are absolute: no later delta applies before it). A misfit it is not: rejected as one, its
        rows were lost until the next artifact while the later deltas stepped past it."""
        fp = _fingerprint(path) or (str(path), -1, 0)  # (gone meanwhile: the next round finds it missing)
        return self._again(self._applies, fp, path, f"could not be applied ({type(exc).__name__}: {exc})",
                           "applied again")

    def _again(self, shortages: _Shortages, fp: _Version, path: Path, failure: str, again: str) -> bool:
        """The one rule for a delta (version ``fp`` of ``path``) one of whose steps just failed for want of a resource
        of this process: tried again next round, counted in :attr:`retries` and logged, up to :data:`TRANSIENT_TRIES`
        rounds in a row, then given up on (False: the caller rejects it). A second failure in one round (:meth:`newer`
        with ``same_round``) counts no further try: the tries are rounds of freshness, not attempts."""
        if fp in shortages.now:
            return True
        tries = shortages.failing.pop(fp, 0) + 1
        if tries >= TRANSIENT_TRIES:
            return False
        shortages.failing[fp] = tries
        shortages.now.add(fp)
        self.retries += 1
        log.warning("delta %s %s, this process is short of a resource; no later delta applies before it, it is %s "
                    "next round (try %d of %d)", path.name, failure, again, tries, TRANSIENT_TRIES)
        return True

    def mark_unfit(self, path: Path) -> None:
        """Do not yield this version of ``path`` again until :meth:`forget_unfit`."""
        fp = _fingerprint(path)
        if fp is not None:
            self._unfit.add(fp)
            self._settle(path)

    def forget_unfit(self) -> None:
        self._unfit.clear()

    def _vanish(self, seq: int, after_seq: int, lineage: str | None) -> None:
        """Delta ``seq`` was listed and is gone before it was read: pruned unread, a gap like one never listed (counted
        once, here, and not again when a later round finds it missing), unless a restart of ``lineage`` removed it as a
        dead branch (:func:`read_abandoned`). As for every gap, only past a known place (``after_seq`` > 0)."""
        if after_seq == 0 or seq in self._settled or covered(seq, seq, read_abandoned(self.directory, lineage)):
            return
        self._settle(seq)
        self.gaps += 1
        log.warning("delta %d was pruned before serving read it; its rows wait for the next artifact", seq)

    def _settle(self, delta: Path | int) -> None:
        """Never count the seq of ``delta`` (a delta file or its seq) as a gap; the newest :data:`_REMEMBER` kept."""
        parsed = (delta, 0) if isinstance(delta, int) else parse_name(delta, SUFFIX)
        if parsed is None:
            return
        self._settled.add(parsed[0])
        if len(self._settled) > _REMEMBER:
            self._settled.discard(min(self._settled))

    def _foreign(self, path: Path, lineage: str | None) -> bool:
        """Whether delta ``path`` is of another lineage than ``lineage`` (both known): an earlier training's delta
        left in the directory, which says nothing of this lineage's numbering. Read (whole, checked) once per file
        version, only for a delta :meth:`newer` would otherwise take for a rewind; one that cannot be read is not
        known foreign. Without it a new lineage's model (numbered after the earlier training's deltas, trained to
        fewer samples) counted a rewind at every round and applied its own deltas again each time."""
        fp = _fingerprint(path)
        if lineage is None or fp is None:
            return False
        theirs = self._stamp(fp, path)
        return theirs is not None and theirs[0] is not None and theirs[0] != lineage

    def _stamp(self, fp: _Version, path: Path) -> tuple[str | None, float] | None:
        """(lineage, created) of version ``fp`` of delta ``path``, read (whole, checked) once per file version; None
        when it cannot be read."""
        if fp not in self._stamps:
            try:
                d = load_delta(path, self.key)
            except (DeltaError, OSError, MemoryError, ValueError, RecursionError):
                return None
            self._stamps[fp] = (d.lineage, d.created)
        return self._stamps[fp]

    def _held(self, path: Path, lineage: str | None, applied_created: float | None) -> bool:
        """Whether delta ``path`` (at or below the seq of a model of ``lineage`` re-based on a directory that went
        backwards, trained no further than it) is one the model holds: of its lineage (known), written no later than
        the newest delta it applied (``applied_created``). A lineage's numbering never goes back (``DELTA_SEQ``), so
        such a file is one it numbered before the model's seq: a deltas directory restored from a backup, not a
        restarted numbering. Applied again, its older values overwrote the newer ones of the deltas it applied after
        it, until the next artifact."""
        fp = _fingerprint(path)
        if lineage is None or applied_created is None or fp is None:
            return False
        stamp = self._stamp(fp, path)
        return stamp is not None and stamp[0] == lineage and stamp[1] <= applied_created

    def latest_seq(self) -> int:
        found = list_deltas(self.directory)
        return found[-1][0] if found else 0

    def newer(self, after_seq: int, after_samples: int, lineage: str | None = None,
              applied_samples: int | None = None, same_round: bool = False,
              applied_created: float | None = None) -> Iterator[Delta]:
        """Checked deltas with ``seq > after_seq``, oldest first, of ``lineage`` (when both it and the delta have
        one); with ``after_seq`` 0 (the model's place in the numbering not known, or re-based below) only those with
        ``samples_trained > after_samples``: the others are already in the model's source checkpoint. Skipped by
        name, never read (module docstring: a learner's count goes back when its restore does).

        ``after_seq``: the last delta the model holds (a fresh artifact's: the seq its source checkpoint includes,
        ``source.delta_seq``, or 0 when it does not say); deltas missing between it and the first one listed after
        it were pruned unread and are counted in :attr:`gaps` (once per missing range). ``applied_samples``: the
        largest ``samples_trained`` the model holds (None: not known, the second rewind test below is not made).

        A stream that went backwards (the directory's latest seq below ``after_seq``, or a delta at or below it that
        was trained past ``applied_samples`` and is not of another lineage, :meth:`_foreign`: the numbering
        restarted, so those seqs were never applied) would be
        skipped forever (a latest seq below it is no rewind when a restart of ``lineage`` recorded every seq after it
        up to ``after_seq`` abandoned, :func:`read_abandoned`: the restart has written nothing newer yet); instead it
        is counted in :attr:`rewinds`, logged once per position, and the model is re-based on ``samples_trained``:
        every delta newer than ``after_samples`` comes, in seq order, as for a model that holds none (values are
        absolute, so the result is the learner's current rows), except, when only the latest seq went back, the deltas
        at or below ``after_seq`` the model holds (:meth:`_held`: of ``lineage``, trained no further than it, written
        no later than ``applied_created``, when the newest delta it applied was written): a deltas directory restored
        from a backup. A delta whose seq a restart of ``lineage`` recorded
        abandoned is never read: a dead branch the restart could not remove (a directory refusing removals).

        ``same_round``: this call is part of the previous one's round (serving reads the deltas for a new artifact,
        then for the live model, in one check): a delta whose read failed transiently in that round and fails so again
        counts no second try of its :data:`TRANSIENT_TRIES`, which are rounds (nor does one whose application failed
        so again, :meth:`retry_apply`). A delta the caller goes on past (asks for the next one: applied, or rejected)
        starts its application's tries afresh."""
        self.retrying = None
        if not same_round:
            self._reads.now, self._applies.now = set(), set()
        found = list_deltas(self.directory)
        live = {str(p) for _, _, p in found}
        self._bad = {fp for fp in self._bad if fp[0] in live}  # forget files that are gone
        self._reads.prune(live)
        self._applies.prune(live)
        self._stamps = {fp: st for fp, st in self._stamps.items() if fp[0] in live}
        dead = read_abandoned(self.directory, lineage) if found else []  # the ranges a restart of lineage abandoned
        if dead:  # a dead branch a restart could not remove is never read
            found = [f for f in found if not covered(f[0], f[0], dead)]
        held = after_samples if applied_samples is None else max(after_samples, applied_samples)
        latest = found[-1][0] if found else 0
        passed = applied_samples is not None and any(s <= after_seq and n > held and not self._foreign(p, lineage)
                                                     for s, n, p in found)
        # (not when a restart of the lineage removed every seq past the latest: nothing newer yet)
        behind = latest < after_seq and covered(latest + 1, after_seq, dead) < after_seq - latest
        rebased_from = 0  # the model's seq when the directory went backwards (behind) and it was re-based; 0: not
        if after_seq > 0 and found and (behind or passed):
            if (after_seq, held) not in self._rewound:
                if len(self._rewound) > _REMEMBER:
                    self._rewound.clear()
                self._rewound.add((after_seq, held))
                self.rewinds += 1
                self._settled.clear()  # (seqs of the numbering that went back: the new one's same seqs are others)
                self._gapped.clear()
                log.warning("the deltas in %s went backwards (latest seq %d, trained to %d samples) behind this "
                            "model's seq %d (trained to %d): the learner's numbering restarted (its deltas directory "
                            "was emptied or replaced); re-basing on samples_trained: every delta past %d samples "
                            "applies, in seq order (not those of this lineage the model holds: a directory "
                            "restored from a backup)", self.directory, latest, max(n for _, n, _ in found), after_seq,
                            held, after_samples)
            rebased_from = after_seq
            after_seq = 0
        expected = after_seq + 1
        for seq, samples, path in found:
            if seq <= after_seq:
                continue
            if seq > expected and after_seq > 0:
                # (less those a restart removed as a dead branch: their rows went out again, nothing was lost; and
                # those counted already: when they vanished after a listing, or in a round that saw the same hole
                # end at another delta, one since pruned; and those this reader got to: not pruned unread)
                gone = seq - expected - covered(expected, seq - 1,
                                                 dead + self._gapped + [(v, v) for v in self._settled])
                if gone:
                    if len(self._gapped) > _REMEMBER:
                        self._gapped.clear()
                    self._gapped.append((expected, seq - 1))
                    self.gaps += gone
                    log.warning("%d of deltas %d..%d were pruned before serving read them; their rows wait for the "
                                "next artifact", gone, expected, seq - 1)
            expected = seq + 1
            if samples <= after_samples and after_seq == 0:
                continue
            if seq <= rebased_from and samples <= held and not passed and self._held(path, lineage, applied_created):
                self._settle(seq)  # (restored from a backup: in the model already, not applied again)
                continue
            fp = _fingerprint(path)
            if fp is None:
                self._vanish(seq, after_seq, lineage)
                continue
            if fp in self._bad or fp in self._unfit:
                continue
            try:
                d = load_delta(path, self.key)
            except FileNotFoundError:
                self._vanish(seq, after_seq, lineage)
                continue
            except (DeltaError, OSError, MemoryError, ValueError, RecursionError) as exc:
                if self._retry_later(fp, path, exc):  # this process short of a resource: the round ends here
                    self.retrying = path
                    return
                # damaged, malformed, or unreadable (permissions, I/O): one file must not stop the updates after it
                self.mark_bad(path, (str(exc) if isinstance(exc, (DeltaError, OSError)) else f"{type(exc).__name__}: "
                                     f"{exc}") + (f" ({TRANSIENT_TRIES} reads in a row)" if transient(exc) else ""))
                continue
            self._reads.failing.pop(fp, None)  # (not its application's tries: they are rounds of their own)
            self._stamps[fp] = (d.lineage, d.created)
            if lineage is not None and d.lineage is not None and d.lineage != lineage:
                self._unfit.add(fp)
                self._settle(seq)
                if self.on_skip is not None:
                    self.on_skip(path, f"lineage {d.lineage} is not the live artifact's {lineage}")
                continue
            yield d
            self._applies.failing.pop(fp, None)  # gone on past: applied, or rejected as a misfit
