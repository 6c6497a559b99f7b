"""Which columns of a sample batch the model reads, and how they land in the fused embedding table.

A field is one column of ``stream/samples.py``: ``user_id``, ``item_id``, ``history`` or a context
column ``ctx.<name>``. Its values are ``stable_hash`` int64s (``stream/features.py``). Every field owns
a contiguous block of ``num_buckets`` rows in ONE fused table; a value goes to row
``field_offset + value mod num_buckets``.

A field with ``capacity > 0`` is *dynamic* (``learner/row_mapper.py``, ``learner/id_map.py``): its block is
``num_buckets`` shared fallback rows followed by ``capacity`` own rows that admitted ids get; an id not
(yet) admitted uses its bucket ``value mod num_buckets``, exactly the static row. ``blocks`` gives the
bucket area of every field (the modulo), ``own_rows`` where the admitted rows start.

``single`` fields have one value per sample; ``multi`` (genres) and ``sequence`` (history) have a list
that is pooled (mean) by ``nn.EmbeddingBag`` from ``(values, offsets)``: never a (B, L, D) tensor.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any, Literal

from stream.samples import CTX_PREFIX

FieldKind = Literal["single", "multi", "sequence"]


@dataclass(frozen=True)
class FieldSpec:
    name: str  # column name in the sample batch
    kind: FieldKind = "single"
    num_buckets: int = 100_000
    shares: str | None = None  # use another field's rows (history shares item_id's), num_buckets ignored
    # dynamic ids (cold start): own rows for admitted ids; 0 = static hashing
    capacity: int = 0
    admit_after: int = 1  # sightings before an id gets its own row
    ttl_s: float | None = None  # own rows unseen this long (event time) are evicted
    init: str = "bucket"  # an admitted row starts as its bucket's vector, or "zero"
    # bucket rows idle this long (event time) have shrunk halfway to zero when next used; None = never
    bucket_half_life_s: float | None = None

    def __post_init__(self) -> None:
        if self.num_buckets < 1:
            raise ValueError(f"field {self.name!r}: num_buckets must be >= 1, got {self.num_buckets}")
        if self.capacity < 0 or self.admit_after < 0:
            raise ValueError(f"field {self.name!r}: capacity and admit_after must be >= 0")
        if self.bucket_half_life_s is not None and self.bucket_half_life_s <= 0:
            raise ValueError(f"field {self.name!r}: bucket_half_life_s must be > 0 or None, "
                             f"got {self.bucket_half_life_s}")
        if self.init not in ("bucket", "zero"):
            raise ValueError(f"field {self.name!r}: init must be bucket or zero, got {self.init!r}")
        object.__setattr__(self, "init", str(self.init))  # a plain str (not learner.config.IdInit): stored in files
        if self.kind not in ("single", "multi", "sequence"):
            raise ValueError(f"field {self.name!r}: kind must be single, multi or sequence, got {self.kind!r}")


@dataclass(frozen=True)
class FeatureConfig:
    fields: tuple[FieldSpec, ...]
    dense: tuple[str, ...] = ()  # dense.<name> columns
    embedding_dim: int = 16
    version: int = 1

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate field names in feature config: {names}")
        if not self.fields:
            raise ValueError("a feature config needs at least one field")

    @property
    def num_fields(self) -> int:
        return len(self.fields)

    @property
    def num_rows(self) -> int:
        return sum(f.num_buckets + f.capacity for f in self.fields if f.shares is None)

    def owner(self, f: FieldSpec) -> FieldSpec:
        """The field whose rows ``f`` uses (itself, or the one it shares)."""
        if f.shares is None:
            return f
        return next(o for o in self.fields if o.name == f.shares)

    @property
    def dynamic(self) -> bool:
        return any(f.capacity > 0 for f in self.fields)

    @property
    def keyed(self) -> bool:
        """Whether batches keep the hashed values behind their rows (``TensorBatch.keys``): dynamic fields are mapped
        to rows from them, and the cold tracker counts users by their hashed ids, hash buckets only too (without
        them a learner with ``id_capacity = 0`` counted no user cold or warm: cold and warm AUC NaN for good)."""
        return self.dynamic or any(f.name == "user_id" for f in self.fields)

    @property
    def blocks(self) -> list[tuple[int, int]]:
        """``(first row, bucket rows)`` of every field's block in the fused table, in field order: a hashed
        value goes to ``first + value mod bucket rows`` (for a dynamic field: while it is not admitted)."""
        return list(self._blocks)

    @functools.cached_property
    def _blocks(self) -> tuple[tuple[int, int], ...]:
        """:attr:`blocks`, computed once (serving asks per request; the config is frozen)."""
        own: dict[str, tuple[int, int]] = {}
        acc = 0
        for f in self.fields:
            if f.shares is None:
                own[f.name] = (acc, f.num_buckets)
                acc += f.num_buckets + f.capacity
        out = []
        for f in self.fields:
            if f.shares is not None and f.shares not in own:
                raise ValueError(f"field {f.name!r} shares {f.shares!r}, which is not a field with its own rows")
            out.append(own[f.shares or f.name])
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FeatureConfig:
        return cls(fields=tuple(FieldSpec(**f) for f in d["fields"]), dense=tuple(d.get("dense", ())),
                   embedding_dim=int(d["embedding_dim"]), version=int(d.get("version", 1)))


def default_config(context: dict[str, FieldKind], buckets: int = 200_000, ctx_buckets: int = 10_000,
                   with_ids: bool = True, with_history: bool = True, embedding_dim: int = 16,
                   dense: tuple[str, ...] = (), id_capacity: int = 0, admit_after: int = 1,
                   id_ttl_s: float | None = None, id_init: str = "bucket",
                   user_bucket_half_life_s: float | None = None) -> FeatureConfig:
    """user id, item id, history (sharing item id's rows) and the given context columns. ``id_capacity > 0``
    makes user and item ids dynamic (``buckets`` fallback rows + ``id_capacity`` own rows each);
    ``user_bucket_half_life_s`` lets idle user buckets forget their earlier occupants."""
    fields: list[FieldSpec] = []
    if with_ids:
        user_decay = user_bucket_half_life_s if id_capacity > 0 else None
        fields += [FieldSpec(name, "single", buckets, capacity=id_capacity, admit_after=admit_after, ttl_s=id_ttl_s,
                             init=id_init, bucket_half_life_s=decay)
                   for name, decay in (("user_id", user_decay), ("item_id", None))]
    if with_history:
        fields.append(FieldSpec("history", "sequence", buckets, shares="item_id" if with_ids else None))
    fields += [FieldSpec(CTX_PREFIX + name, kind, ctx_buckets) for name, kind in sorted(context.items())]
    return FeatureConfig(tuple(fields), dense=dense, embedding_dim=embedding_dim)
