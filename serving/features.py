"""A scoring request -> the model's input tensors: the user's bags once, the candidates' bags per candidate.

For ``B = len(items)`` candidates of one user, the output is the scorer's request layout (``learner/scorer.py``,
``input_layout`` 2)::

    values   (N,) int64                global rows of the fused table: the user row's bags, then the candidates'
    offsets  (F + F * B + 1,) int64    bag starts, include_last_offset layout: bag f is field f of the USER ROW
                                       (shared by every candidate), bag F + f * B + b is field f of candidate b
    dense    (B, Dd) float32           dense features in ``FeatureConfig.dense`` order, absent ones 0

Each field's bag lies on one side, the other side's bags are empty: the user, the history and the shared context in
the user row (hashed, mapped and looked up once per request instead of once per candidate: ~96% of a request's rows
were those, repeated), the item and any context sent per item on the candidates' side. Pooled, ``user + candidate``
is then exactly what training pools for the ``B`` samples the joiner would emit for the same user, items, context
and history (``learner.batch.to_tensors``; ``learner.scorer.to_candidate_rows`` turns this layout back into that one).

Raw values are hashed by ``stream.features`` (the one definition the joiner uses too) and hashed values
become rows through the artifact's ``map_rows`` (so id maps and hash-bucket fallback match training).

Absent features follow ``stream/joiner/sample_rows.py``: a missing single-valued context feature is
``MISSING`` (its own row, as in a training batch where other samples have the feature), a missing
list-valued one an empty bag (a zero vector), a missing dense value 0.0.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Protocol

import numpy as np

from learner.features import FeatureConfig
from serving.request import RequestError, ScoreRequest
from serving.settings import ServeSettings
from stream.events import ContextValue
from stream.features import MISSING, hash_context, hash_ids, hash_value
from stream.samples import CTX_PREFIX


class RowMapper(Protocol):
    """What the encoder needs of a loaded artifact (``serving.model.ScoringModel`` provides it)."""

    feature_config: FeatureConfig

    def map_rows(self, field_index: int, hashed: np.ndarray) -> np.ndarray: ...


_EMPTY = np.zeros(0, np.int64)
# A request checked and hashed, its rows not looked up yet (FeatureEncoder.check): (field, hashed values) bags in the
# order they are mapped, offsets (F + F*B + 1,), dense (B, Dd)
Checked = tuple[list[tuple[int, np.ndarray]], np.ndarray, np.ndarray]
MAX_REQUEST_VALUES = ServeSettings.max_request_values  # the default bound of encode()


def _too_many(req: ScoreRequest, expanded: int, spent: int, max_values: int, why: str) -> RequestError:
    """422: the call's candidates (and the request's shared context) expand past ``[serve] max_request_values``
    (``expanded``: counted so far)."""
    calls = f"; {expanded:,} with the batch's earlier requests (the bound is per call)" if spent else ""
    return RequestError(422, f"field '{req.where}items': {len(req.items)} candidates expand to at least "
                        f"{expanded - spent:,} feature values{why}{calls}, over [serve] max_request_values = "
                        f"{max_values:,}; send fewer candidates or shorter lists, or raise [serve] max_request_values")


class FeatureEncoder:
    """Built once per loaded model: the per-field plan of its feature config."""

    def __init__(self, mapper: RowMapper) -> None:
        self.mapper = mapper
        cfg = mapper.feature_config
        self.cfg = cfg
        self.num_fields = cfg.num_fields
        # (field index, source, context name): source is user | item | history | ctx | absent
        self.plan: list[tuple[int, str, str]] = []
        for f, spec in enumerate(cfg.fields):
            if spec.name in ("user_id", "item_id", "history"):
                self.plan.append((f, spec.name.removesuffix("_id"), ""))
            elif spec.name.startswith(CTX_PREFIX):
                self.plan.append((f, "ctx", spec.name[len(CTX_PREFIX):]))
            else:
                self.plan.append((f, "absent", ""))
        self.context_names = frozenset(name for _, src, name in self.plan if src == "ctx")
        self.multi = frozenset(spec.name[len(CTX_PREFIX):] for spec in cfg.fields
                               if spec.kind != "single" and spec.name.startswith(CTX_PREFIX))  # list-valued context
        self._ctx_fields = [(f, name) for f, src, name in self.plan if src == "ctx"]
        self.dense_names = tuple(cfg.dense)
        self._dense_index = {n: i for i, n in enumerate(self.dense_names)}

    # -- validation against this model's features ---------------------------------------------
    def _check_names(self, where: str, context: dict[str, ContextValue], dense: dict[str, float]) -> None:
        for k in context:
            if k not in self.context_names:
                raise RequestError(422, f"field '{where}context.{k}': this model has no such context feature; "
                                   f"known: {', '.join(sorted(self.context_names)) or 'none'}")
        for k in dense:
            if k not in self._dense_index:
                raise RequestError(422, f"field '{where}dense.{k}': this model has no such dense feature; "
                                   f"known: {', '.join(self.dense_names) or 'none'}")

    # -- encoding ---------------------------------------------------------------------------------
    def _bag(self, name: str, hashed: int | list[int] | None) -> list[int]:
        if hashed is None:
            return [] if name in self.multi else [MISSING]
        return hashed if type(hashed) is list else [hashed]  # type: ignore[list-item]

    def encode(self, req: ScoreRequest, history: list[int] | Callable[[], list[int]],
               observe: Callable[[str, np.ndarray], None] | None = None,
               max_values: int = MAX_REQUEST_VALUES, mapper: RowMapper | None = None, spent: int = 0
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(values (N,), offsets (F + F*B + 1,), dense (B, Dd))`` for the request's ``B`` candidates, in the user-row
        layout (module docstring): the user's bags once, the candidates' after them. :meth:`check` then :meth:`rows`:
        a call of several requests (a batch) checks them all before it looks up any row (a refused call has none)."""
        return self.rows(self.check(req, history, observe, max_values, spent), mapper)

    def check(self, req: ScoreRequest, history: list[int] | Callable[[], list[int]],
              observe: Callable[[str, np.ndarray], None] | None = None,
              max_values: int = MAX_REQUEST_VALUES, spent: int = 0) -> Checked:
        """The request checked against this model (a 422: a feature it lacks, ``max_values``) and hashed, no row looked
        up yet: ``(bags, offsets (F + F*B + 1,), dense (B, Dd))``, ``bags`` the hashed ``(field, values)`` in the
        order :meth:`rows` maps them.

        ``history``: the user's clicked items' hashes, oldest first (``stream.history.UserHistory``), or a callable
        that returns them: called once, after every other field is encoded (serving's Redis read is in flight
        meanwhile: ``serving/history.py``), and not at all when the request is refused first (a 422).
        ``observe(kind, hashed)``: told the hashed ids whose rows are read, by kind (``user``; ``item`` for the
        candidates and the history), as they are hashed here (``serving/lookup_counts.py`` counts them).
        ``max_values``: the most rows one HTTP call may look up (``[serve] max_request_values``; a 422 past it): the
        candidates' values and the shared context's (:meth:`request_values`; a shared list is looked up once, yet a
        batch of ``max_batch`` requests each sharing lists of 1,024 values read past the bound uncounted). A
        context field that some item overrides is carried by every candidate, the request's shared bag repeated for
        each one without its own: 1,000 candidates x a shared list of 1,024 values is a million lookups from a 20 KB
        body.
        ``spent``: the values the call's earlier requests look up (:meth:`request_values`): the bound is
        per HTTP call, a batch's requests together (checked per request, ``max_batch`` multiplied it)."""
        where = req.where
        self._check_names(where, req.context, req.dense)
        b = len(req.items)
        dense = self._dense(req, b)  # first: it refuses unknown dense names (422) before any lookup is observed
        shared = hash_context(req.context)
        per_item = None
        if req.item_context is not None:
            for i, c in enumerate(req.item_context):
                self._check_names(f"{where}items[{i}].", c, {})
            per_item = [hash_context(c) for c in req.item_context]
        f_count = self.num_fields
        user_values: dict[int, np.ndarray] = {}  # the user row's bags by field, hashed (mapped once all are counted)
        user_lengths = np.zeros(f_count, np.int64)  # (F,)
        cand_values: list[tuple[int, np.ndarray]] = []  # (field, hashed bags), field-major: mapped as user_values
        cand_lengths = np.zeros((f_count, b), np.int64)  # (F, B); a field of the user row: all 0
        history_field = -1
        expanded = spent + b  # the call's values looked up per candidate: the items, then context sent per item
        if expanded > max_values:
            raise _too_many(req, expanded, spent, max_values, "")
        for f, src, name in self.plan:
            if src == "history":  # last: see the docstring
                history_field = f
                continue
            if src == "item":
                hashed = hash_ids(req.items)  # (B,) ids as check_id accepts them (serving/request.py)
                if observe is not None:
                    observe("item", hashed)
                cand_values.append((f, hashed))  # (B,)
                cand_lengths[f] = 1
                continue
            if src == "ctx" and per_item is not None and any(name in c for c in per_item):
                own = self._bag(name, shared.get(name))  # a candidate without its own value carries the shared one
                bags = [own if (v := c.get(name)) is None else self._bag(name, v) for c in per_item]
                lens = np.fromiter(map(len, bags), np.int64, b)  # (B,)
                expanded += int(lens.sum())
                if expanded > max_values:
                    raise _too_many(req, expanded, spent, max_values,
                                    f" ('context.{name}' is sent per item, so every candidate carries a '{name}' "
                                    f"of its own or the shared one, {len(own)} values)")
                flat = np.fromiter(chain.from_iterable(bags), np.int64, int(lens.sum()))
                cand_values.append((f, flat))
                cand_lengths[f] = lens
                continue
            if src == "user":
                one = np.array([hash_value(req.user_id)], np.int64)
                if observe is not None:
                    observe("user", one)
            elif src == "ctx":
                one = np.asarray(self._bag(name, shared.get(name)), np.int64)
            else:
                one = _EMPTY
            if len(one):  # (L,): the same bag for every candidate, once in the user row
                user_values[f] = one
                user_lengths[f] = len(one)
        shared_values, widest = self._shared_values(req, user_lengths)
        if shared_values and expanded + shared_values > max_values:
            raise _too_many(req, expanded + shared_values, spent, max_values,
                            f" with the request's shared context ({shared_values:,} values, "
                            f"'context.{widest}' the longest: looked up once, shared by every candidate)")
        if history_field >= 0:
            one = np.asarray(history() if callable(history) else history, np.int64)
            if observe is not None:
                observe("item", one)
            if len(one):
                user_values[history_field] = one
                user_lengths[history_field] = len(one)
        offsets = np.zeros(f_count * (b + 1) + 1, np.int64)  # (F + F*B + 1,)
        np.cumsum(user_lengths, out=offsets[1:f_count + 1])
        np.cumsum(cand_lengths.ravel(), out=offsets[f_count + 1:])
        offsets[f_count + 1:] += offsets[f_count]
        return [*sorted(user_values.items()), *cand_values], offsets, dense

    def rows(self, checked: Checked, mapper: RowMapper | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`check`'s request with its rows looked up: ``(values (N,), offsets, dense)``. ``mapper``: what maps ids
        to rows, the encoder's own by default; serving passes the model snapshot it then scores with
        (``serving.model.PinnedModel``), of the same feature config."""
        bags, offsets, dense = checked
        m = self.mapper if mapper is None else mapper
        parts = [m.map_rows(f, h) for f, h in bags]
        return (np.concatenate(parts) if parts else _EMPTY), offsets, dense

    def _shared_values(self, req: ScoreRequest, user_lengths: np.ndarray) -> tuple[int, str]:
        """(values, longest name) of the context ``req`` shares (``req.context``) in the user row (``user_lengths``
        (F,)): counted against ``max_values`` with the candidates' values. Not counted: the user id and a context
        field's "missing" value (one each, at most F per request) and the history (``history_len``, the server's)."""
        sent = [(int(user_lengths[f]), name) for f, name in self._ctx_fields if name in req.context]
        return sum(n for n, _ in sent), max(sent)[1] if sent else ""

    def request_values(self, req: ScoreRequest, offsets: np.ndarray) -> int:
        """The values of an encoded request (its ``offsets``) that ``max_values`` bounds: the candidates' and the
        shared context's."""
        f = self.num_fields
        return int(offsets[-1] - offsets[f]) + self._shared_values(req, np.diff(offsets[:f + 1]))[0]

    def _dense(self, req: ScoreRequest, b: int) -> np.ndarray:
        dd = len(self.dense_names)
        row = np.zeros(dd, np.float32)
        for k, v in req.dense.items():
            row[self._dense_index[k]] = v
        dense = np.repeat(row[None, :], b, axis=0)  # (B, Dd)
        if req.item_dense is not None:
            for i, d in enumerate(req.item_dense):
                for k, v in d.items():
                    j = self._dense_index.get(k)
                    if j is None:
                        raise RequestError(422, f"field '{req.where}items[{i}].dense.{k}': this model has no such "
                                           f"dense feature; known: {', '.join(self.dense_names) or 'none'}")
                    dense[i, j] = v
        return dense
