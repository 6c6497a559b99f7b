"""A deterministic synthetic feed with a planted click model (``--dataset synthetic``).

:func:`build_synthetic` returns an :class:`~stream.replay.table.EventTable` whose ground truth is
known exactly, so the rest of the system (joiner, learner, serving) can be checked against it:

* **Users and items** are drawn from a bounded Zipf law over popularity ranks ``1..N`` (exponent
  ``s.zipf_exponent``, inverse CDF of the continuous approximation), and each rank is mapped to a
  62-bit id by a seeded bijective mixer, so popular ids are not small numbers and ``s.users`` may be
  100 M without any array of that size being allocated: memory is O(impressions).
* **Brand-new users** (``s.new_user_share`` of impressions) have 1..``s.new_user_impressions`` (5)
  impressions each, with ids ``2**62 + k`` that can never collide with a returning user. By default they
  come in bursts of consecutive impressions; with ``s.new_user_session_s > 0`` a user's impressions are
  spread over a session of that many seconds, interleaved with everyone else's (what a new user of a
  feed does, and what cold-start learning needs: feedback from early impressions before later ones).
* **Event time** is a Poisson process at ``s.impressions_per_s`` from ``s.start_ts_ms``.
* **Click model**: every id has a latent vector (and every item a bias) derived from a hash of the
  id, so nothing is stored per id and anyone can recompute it (:func:`oracle_probability`)::

      p = sigmoid(b + signal * <u, i> / sqrt(dim) + item_bias + device_effect)

  ``b`` starts at ``logit(base_ctr)`` and is calibrated so that the mean ``p`` equals ``base_ctr``
  (``stats["intercept"]``). Labels are Bernoulli(p); ``stats["oracle_auc"]`` is the AUC of the true
  ``p`` against them, the best any model can do on this table.
* **Clicks**: one per positive impression after a delay from ``draw_click_delays_ms``; a share comes
  after the attribution window (late), a share is sent twice (duplicates), and clicks for impression
  ids that were never shown are added (orphans).
* **Malformed messages** (``s.malformed_share`` of all messages) are *added* as raw messages, one
  defect kind after another, so the counts of valid events stay exact.

All randomness comes from one ``np.random.Generator(np.random.PCG64(seed))``: the same seed gives the
same table.
"""

from __future__ import annotations

import math
from itertools import combinations
from typing import Any

import numpy as np
import orjson

from stream.errors import ConfigError
from stream.events import MAX_TS_MS
from stream.replay.config import MAX_IDS, ClickDelay, SyntheticSettings
from stream.replay.table import CLICK, IMPRESSION, ContextPart, EventTable, RawMessage, draw_click_delays_ms

__all__ = [
    "DEVICES",
    "MALFORMED_KINDS",
    "NEW_USER_BASE",
    "build_synthetic",
    "oracle_probability",
    "rank_auc",
]

#: ids of brand-new users are ``NEW_USER_BASE + k``; returning users' ids are below it.
NEW_USER_BASE = MAX_IDS
DEVICES = ("ios", "android", "web")
_DEVICE_CUM_SHARE = np.array([0.35, 0.80])  # ios 35 %, android 45 %, web 20 %
_DEVICE_EFFECT = np.array([0.15, 0.0, -0.25])  # added to the logit
_ITEM_BIAS_SCALE = 0.5
_N_TAGS = 10  # tag values 0..9; an item has 1-3 of them
_TAG_SIZE_CUM_SHARE = np.array([0.4, 0.75])  # 1 tag 40 %, 2 tags 35 %, 3 tags 25 %
_DUPLICATE_GAP_MS = (1_000, 10_000)  # a duplicate click follows its original by 1-10 s

#: defect kinds of malformed messages, in round-robin order: (kind, topic)
MALFORMED_KINDS: tuple[tuple[str, int], ...] = (
    ("not_json", IMPRESSION),
    ("missing_field", IMPRESSION),
    ("wrong_type", IMPRESSION),
    ("nan", IMPRESSION),
    ("negative_id", IMPRESSION),
    ("oversized_id", IMPRESSION),
    ("unknown_schema_version", IMPRESSION),
    ("click_missing_impression_id", CLICK),
)

_M64 = (1 << 64) - 1
_M62 = np.uint64((1 << 62) - 1)
_SALT_USER_RANK = 0x5EED_0001
_SALT_ITEM_RANK = 0x5EED_0002
_SALT_USER_VEC = 0x5EED_0003
_SALT_ITEM_VEC = 0x5EED_0004
_SALT_ITEM_BIAS = 0x5EED_0005
_SALT_DEVICE = 0x5EED_0006
_SALT_TAGS = 0x5EED_0007


# --------------------------------------------------------------------------------------------------
# hashing


def _mix64_int(x: int) -> int:
    """splitmix64 finaliser on a Python int (for deriving per-seed keys)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _key(seed: int, salt: int, j: int = 0) -> np.uint64:
    return np.uint64(_mix64_int(_mix64_int(_mix64_int(seed) ^ salt) + j))


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorised on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _permute62(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """A keyed bijection of ``[0, 2**62)``: add, xor-shift and odd multiply, all modulo 2**62."""
    x = (x + key) & _M62
    x = x ^ (x >> np.uint64(31))
    x = (x * np.uint64(0xBF58476D1CE4E5B9)) & _M62
    x = x ^ (x >> np.uint64(29))
    x = (x * np.uint64(0x94D049BB133111EB)) & _M62
    return x ^ (x >> np.uint64(32))


def _unit(ids: np.ndarray, key: np.uint64) -> np.ndarray:
    """A uniform [0, 1) float per id, from a hash of the id and ``key``."""
    h = _mix64(ids.astype(np.uint64) ^ key)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


# --------------------------------------------------------------------------------------------------
# the planted model


def _zipf_ranks(rng: np.random.Generator, n_ranks: int, exponent: float, size: int) -> np.ndarray:
    """Ranks in ``1..n_ranks`` with P(rank) ~ rank**-exponent (continuous approximation)."""
    u = rng.random(size)
    log_top = math.log(n_ranks + 1.0)
    if abs(exponent - 1.0) < 1e-9:
        x = np.exp(u * log_top)
    else:
        t = 1.0 - exponent
        x = np.exp(np.log1p(u * math.expm1(t * log_top)) / t)
    return np.clip(np.floor(x).astype(np.int64), 1, n_ranks)


def _rank_to_id(ranks: np.ndarray, seed: int, salt: int) -> np.ndarray:
    return _permute62((ranks - 1).astype(np.uint64), _key(seed, salt)).astype(np.int64)


def _device_of(user_id: np.ndarray, seed: int) -> np.ndarray:
    """Device index per row (a user keeps one device)."""
    return np.searchsorted(_DEVICE_CUM_SHARE, _unit(user_id, _key(seed, _SALT_DEVICE)), side="right")


def _interaction_logit(
    user_id: np.ndarray, item_id: np.ndarray, device: np.ndarray, s: SyntheticSettings, seed: int
) -> np.ndarray:
    """Everything in the logit except the intercept. Latent components are uniform with variance 1."""
    dot = np.zeros(len(user_id))
    half_width = math.sqrt(3.0)
    for j in range(s.latent_dim):
        u = _unit(user_id, _key(seed, _SALT_USER_VEC, j)) * (2 * half_width) - half_width
        v = _unit(item_id, _key(seed, _SALT_ITEM_VEC, j)) * (2 * half_width) - half_width
        dot += u * v
    bias = (_unit(item_id, _key(seed, _SALT_ITEM_BIAS)) * 2.0 - 1.0) * (_ITEM_BIAS_SCALE * math.sqrt(3.0))
    return s.signal * dot / math.sqrt(s.latent_dim) + bias + _DEVICE_EFFECT[device]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _calibrate_intercept(z: np.ndarray, target: float) -> float:
    """``b`` with mean(sigmoid(b + z)) == target (bisection on at most 65 536 rows)."""
    sample = z[:65_536]
    if len(sample) == 0:
        return math.log(target / (1.0 - target))
    lo, hi = -40.0, 40.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if float(_sigmoid(mid + sample).mean()) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def rank_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney) formula, ties given their average rank. NaN if one class."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels, dtype=bool)
    n_pos = int(labels.sum())
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based average rank of each distinct score
    rank_sum = float(avg_rank[inverse][labels].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def oracle_probability(table: EventTable, s: SyntheticSettings, seed: int) -> np.ndarray:
    """The true click probability of every impression of a table built by :func:`build_synthetic`.

    Recomputed from the table's columns (ids and the ``device`` context) and ``stats["intercept"]``,
    so a learner's AUC can be compared with the best achievable one. Shape ``(N,)`` float64.
    """
    device = None
    for part in table.context:
        if part.dicts and "device" in part.dicts[0]:
            per_dict = np.array([DEVICES.index(d["device"]) for d in part.dicts], dtype=np.int64)
            device = per_dict[part.index]
    if device is None:
        raise ValueError("table has no 'device' context: not built by build_synthetic")
    user_id = np.asarray(table.user_id, dtype=np.int64)
    item_id = np.asarray(table.item_id, dtype=np.int64)
    z = _interaction_logit(user_id, item_id, device, s, seed)
    return _sigmoid(table.stats["intercept"] + z)


# --------------------------------------------------------------------------------------------------
# building blocks


def _check(s: SyntheticSettings, n: int) -> None:
    """A :class:`ConfigError` (exit 2 at the CLI, one line) for a run the generator cannot make: the settings' own
    bounds are checked where they are built (``SyntheticSettings.__post_init__``)."""
    if n < 0:
        raise ConfigError(f"[synthetic] impressions/limit must be >= 0, got {n}")


def _new_user_slots(rng: np.random.Generator, n: int, n_new: int, max_size: int = 5,
                    session_rows: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Place ``n_new`` new-user impressions among ``n``, 1..``max_size`` per user: in bursts of consecutive
    rows, or with ``session_rows > 0`` spread uniformly over a window of that many rows (a session).

    Returns (row positions, new-user number 0..G-1 per position).
    """
    if n_new == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    sizes = rng.integers(1, max_size + 1, size=n_new)
    ends = np.cumsum(sizes)
    n_groups = int(np.searchsorted(ends, n_new)) + 1  # first group whose end reaches n_new
    sizes = sizes[:n_groups].copy()
    sizes[-1] -= int(ends[n_groups - 1]) - n_new
    group = np.repeat(np.arange(n_groups, dtype=np.int64), sizes)
    if session_rows > 0:
        # Sessions: every row gets a sort key on one row axis. Returning rows sit evenly; a new user's
        # rows at its session start plus uniform offsets within the session; rows are placed by key.
        key_new = rng.uniform(0, n, n_groups)[group] + rng.uniform(0, session_rows, n_new)
        key_ret = (np.arange(n - n_new) + 0.5) * (n / max(n - n_new, 1))
        rank = np.empty(n, dtype=np.int64)
        rank[np.argsort(np.concatenate([key_new, key_ret]), kind="stable")] = np.arange(n)
        return rank[:n_new], group
    # Arrange the G bursts and the n - n_new returning rows as tokens in a random order.
    n_tokens = n_groups + (n - n_new)
    is_burst = np.zeros(n_tokens, dtype=bool)
    is_burst[rng.choice(n_tokens, size=n_groups, replace=False)] = True
    lengths = np.ones(n_tokens, dtype=np.int64)
    lengths[is_burst] = sizes
    starts = (np.cumsum(lengths) - lengths)[is_burst]
    offset = np.arange(n_new, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    return starts[group] + offset, group


def _context_parts(ts: np.ndarray, device: np.ndarray, item_id: np.ndarray, seed: int) -> list[ContextPart]:
    hour = (ts // 3_600_000) % 24
    device_hour = [{"device": d, "hour": h} for d in DEVICES for h in range(24)]
    part_dh = ContextPart(index=(device * 24 + hour).astype(np.int64), dicts=device_hour)

    by_size = [list(combinations(range(_N_TAGS), k)) for k in (1, 2, 3)]
    tag_dicts = [{"tags": list(c)} for combos in by_size for c in combos]
    first = np.cumsum([0] + [len(c) for c in by_size])  # dict index of the first combo of each size
    n_of_size = np.array([len(c) for c in by_size])
    size_idx = np.searchsorted(_TAG_SIZE_CUM_SHARE, _unit(item_id, _key(seed, _SALT_TAGS)), side="right")
    within = (
        _mix64(item_id.astype(np.uint64) ^ _key(seed, _SALT_TAGS, 1)) % n_of_size[size_idx].astype(np.uint64)
    ).astype(np.int64)
    part_tags = ContextPart(index=first[size_idx] + within, dicts=tag_dicts)
    return [part_dh, part_tags]


def _malformed_value(kind: str, impression_id: str, ts: int, user_id: int, item_id: int) -> bytes:
    base: dict[str, Any] = {
        "schema_version": 1,
        "impression_id": impression_id,
        "ts": ts,
        "user_id": user_id,
        "item_id": item_id,
    }
    if kind == "not_json":
        return b"{not json " + impression_id.encode()
    if kind == "missing_field":
        del base["user_id"]
        return orjson.dumps(base)
    if kind == "wrong_type":
        base["ts"] = str(ts)
        return orjson.dumps(base)
    if kind == "nan":  # orjson never writes NaN, so splice it into the text
        return orjson.dumps(base)[:-1] + b',"dense":{"price":NaN}}'
    if kind == "negative_id":
        base["user_id"] = -5
        return orjson.dumps(base)
    if kind == "oversized_id":  # 2**64 does not fit orjson's integers either
        base["user_id"] = 0
        return orjson.dumps(base).replace(b'"user_id":0', b'"user_id":' + str(2**64).encode())
    if kind == "unknown_schema_version":
        base["schema_version"] = 99
        return orjson.dumps(base)
    if kind == "click_missing_impression_id":
        return orjson.dumps({"schema_version": 1, "ts": ts})
    raise ValueError(f"unknown malformed kind {kind!r}")


def _malformed(
    rng: np.random.Generator,
    count: int,
    seed: int,
    ts_lo: int,
    ts_hi: int,
    user_id: np.ndarray,
    item_id: np.ndarray,
) -> tuple[list[RawMessage], dict[str, int]]:
    by_kind = {kind: 0 for kind, _ in MALFORMED_KINDS}
    if count == 0:
        return [], by_kind
    ts = rng.integers(ts_lo, ts_hi + 1, size=count).tolist()
    if len(user_id):  # borrow real ids so only the planted defect is wrong
        rows = rng.integers(0, len(user_id), size=count)
        users, items = user_id[rows].tolist(), item_id[rows].tolist()
    else:
        users = items = [1] * count
    out = []
    for k in range(count):
        kind, topic = MALFORMED_KINDS[k % len(MALFORMED_KINDS)]
        bad_id = f"syn{seed}-bad-{k:09d}"
        value = _malformed_value(kind, bad_id, ts[k], users[k], items[k])
        key = None if k % 5 == 4 else bad_id.encode()
        out.append(RawMessage(topic_kind=topic, ts=ts[k], key=key, value=value))
        by_kind[kind] += 1
    return out, by_kind


def _top_share(ids: np.ndarray, fraction: float = 0.01) -> tuple[int, float]:
    """(distinct ids, share of rows taken by the top ``fraction`` most frequent distinct ids)."""
    if len(ids) == 0:
        return 0, float("nan")
    counts = np.unique(ids, return_counts=True)[1]
    top = max(1, int(math.ceil(fraction * len(counts))))
    return len(counts), float(np.sort(counts)[::-1][:top].sum() / len(ids))


# --------------------------------------------------------------------------------------------------


def build_synthetic(
    s: SyntheticSettings, delay: ClickDelay, seed: int, limit: int | None = None
) -> EventTable:
    """Build the synthetic feed: ``min(s.impressions, limit)`` impressions and their clicks.

    Deterministic in ``seed``; memory and time are O(impressions), whatever ``s.users``/``s.items``.
    User and item ids are int64 columns (returning users and items in ``[0, 2**62)``, brand-new users
    ``2**62 + k``). ``table.stats`` holds the ground truth (see the module docstring).
    """
    n = s.impressions if limit is None else min(limit, s.impressions)
    _check(s, n)
    rng = np.random.Generator(np.random.PCG64(seed))

    # --- event time: Poisson arrivals ----------------------------------------------------------
    gaps = rng.exponential(1.0 / s.impressions_per_s, size=n)
    if n:
        gaps[0] = 0.0
    offset_ms = np.rint(np.cumsum(gaps) * 1000.0)
    del gaps
    if n and not s.start_ts_ms + offset_ms[-1] <= MAX_TS_MS:  # (a float: past int64 it would wrap negative)
        raise ConfigError(f"[synthetic] {n:,} impressions at impressions_per_s {s.impressions_per_s:g} from "
                          f"start_ts_ms {s.start_ts_ms} run past {MAX_TS_MS} (2100-01-01), the last event time an "
                          "event may have: lower start_ts_ms or the impressions, or raise impressions_per_s")
    ts = s.start_ts_ms + offset_ms.astype(np.int64)

    # --- users: returning (Zipf) and brand-new (bursts or sessions) --------------------------------
    n_new = int(round(s.new_user_share * n))
    new_pos, new_group = _new_user_slots(rng, n, n_new, s.new_user_impressions,
                                         s.new_user_session_s * s.impressions_per_s)
    is_new = np.zeros(n, dtype=bool)
    is_new[new_pos] = True
    user_id = np.empty(n, dtype=np.int64)
    user_id[new_pos] = NEW_USER_BASE + new_group
    returning = ~is_new
    user_id[returning] = _rank_to_id(
        _zipf_ranks(rng, s.users, s.zipf_exponent, n - n_new), seed, _SALT_USER_RANK
    )
    n_new_users = int(new_group[-1]) + 1 if n_new else 0
    del new_pos, new_group

    # --- items ----------------------------------------------------------------------------------
    item_id = _rank_to_id(_zipf_ranks(rng, s.items, s.zipf_exponent, n), seed, _SALT_ITEM_RANK)

    # --- planted click model ----------------------------------------------------------------------
    device = _device_of(user_id, seed)
    z = _interaction_logit(user_id, item_id, device, s, seed)
    intercept = _calibrate_intercept(z, s.base_ctr)
    p = _sigmoid(intercept + z)
    del z
    label = rng.random(n) < p
    oracle_auc = rank_auc(p, label)
    del p

    # --- clicks ---------------------------------------------------------------------------------
    window_ms = int(round(s.attribution_window_s * 1000.0))
    pos = np.flatnonzero(label)
    n_pos = len(pos)
    delays = draw_click_delays_ms(delay, n_pos, rng)
    n_late_forced = int(round(s.late_click_share * n_pos))
    late_idx = rng.choice(n_pos, size=n_late_forced, replace=False)
    delays[late_idx] = window_ms + rng.integers(1_000, max(window_ms, 1_000) + 1, size=n_late_forced)
    first_click_ts = ts[pos] + delays
    n_on_time = int((delays <= window_ms).sum())

    n_dup = int(round(s.duplicate_click_share * n_pos))
    dup_idx = rng.choice(n_pos, size=n_dup, replace=False)
    dup_ts = first_click_ts[dup_idx] + rng.integers(
        _DUPLICATE_GAP_MS[0], _DUPLICATE_GAP_MS[1] + 1, size=n_dup
    )

    n_orphan = int(round(s.orphan_click_share * n_pos))
    ts_lo = int(ts[0]) if n else s.start_ts_ms
    ts_hi = int(ts[-1]) if n else s.start_ts_ms
    orphan_ts = rng.integers(ts_lo, ts_hi + 1, size=n_orphan)

    impression_id = np.empty(n, dtype=object)
    impression_id[:] = [f"syn{seed}-{k:09d}" for k in range(n)]
    orphan_id = np.empty(n_orphan, dtype=object)
    orphan_id[:] = [f"syn{seed}-orphan-{k}" for k in range(n_orphan)]
    click_impression_id = np.concatenate([impression_id[pos], impression_id[pos[dup_idx]], orphan_id])
    # at most the last event time an event may have (as the event log's): a long delay's click is not one the decoder
    # refuses (the impressions' own times are refused past it above)
    click_ts = np.minimum(np.concatenate([first_click_ts, dup_ts, orphan_ts]).astype(np.int64), MAX_TS_MS)
    order = np.argsort(click_ts, kind="stable")
    click_impression_id, click_ts = click_impression_id[order], click_ts[order]

    # --- malformed messages (added on top of the valid ones) ------------------------------------
    n_valid = n + len(click_ts)
    n_malformed = int(round(s.malformed_share * n_valid / (1.0 - s.malformed_share)))
    raw, malformed_by_kind = _malformed(rng, n_malformed, seed, ts_lo, ts_hi, user_id, item_id)

    # --- summary ----------------------------------------------------------------------------------
    users_distinct, top_users = _top_share(user_id[returning])
    items_distinct, top_items = _top_share(item_id)
    stats: dict[str, Any] = {
        "source": "synthetic",
        "seed": seed,
        "impressions": n,
        "users_cardinality": s.users,
        "items_cardinality": s.items,
        "zipf_exponent": s.zipf_exponent,
        "users_distinct": users_distinct + n_new_users,
        "returning_users_distinct": users_distinct,
        "items_distinct": items_distinct,
        "top1pct_users_share": top_users,
        "top1pct_items_share": top_items,
        "new_users": n_new_users,
        "new_user_impressions": n_new,
        "start_ts_ms": ts_lo,
        "end_ts_ms": ts_hi,
        "span_s": (ts_hi - ts_lo) / 1000.0,
        "base_ctr": s.base_ctr,
        "intercept": intercept,
        "planted_ctr": float(label.mean()) if n else float("nan"),
        "oracle_auc": oracle_auc,
        "positives": n_pos,
        "clicks": len(click_ts),
        "clicks_on_time": n_on_time,
        "late_clicks": n_pos - n_on_time,
        "duplicate_clicks": n_dup,
        "orphan_clicks": n_orphan,
        "attribution_window_s": s.attribution_window_s,
        "malformed": n_malformed,
        "malformed_by_kind": malformed_by_kind,
    }
    return EventTable(
        impression_id=impression_id,
        ts=ts,
        user_id=user_id,
        item_id=item_id,
        context=_context_parts(ts, device, item_id, seed),
        click_impression_id=click_impression_id,
        click_ts=click_ts,
        raw=raw,
        stats=stats,
    )
