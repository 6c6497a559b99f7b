"""Dynamic ids on N ranks (``learner/sharded_ids.py``: each field's id map sharded with its rows), with 1 and 2 gloo
ranks in processes of their own:

* while no share is full, ranks mapping their shares end with every id on a row holding the vector and row-wise
  sum that one process's ``RowMapper`` gives it over the same rounds (admission from a bucket that lives on the
  other rank and with zeros, TTL eviction, reset optimizer state, bucket decay, a history that only reads), and
  one rank is that process exactly (the same rows);
* a full share evicts its own least recently seen ids: each rank's map is the ``IdMap`` of its share fed the
  keys it owns, and holds only its share (the maps are not replicated);
* a restore onto another world size moves the ids whose owner changed, with their vectors and sums."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from learner.batch import TensorBatch, concat, to_tensors
from learner.event_clock import EventClock
from learner.features import FeatureConfig, FieldSpec
from learner.id_map import IdMap
from learner.model import DeepFM
from learner.optim import make_optimizers
from learner.row_mapper import RowMapper, field_spans, mapped_slots
from stream.samples import SampleBatch
from tests.unit.learner.gloo_ranks import in_turn, run_gloo_ranks

B = 6
# rows: item_id [0, 262), user_id [262, 668), ctx.device [668, 688); 2 ranks hold [0, 344) and [344, 688): the
# user field's own rows are split over both ranks and its buckets live on rank 0
ROOMY = FeatureConfig((FieldSpec("item_id", "single", B, capacity=256, admit_after=1, init="zero"),
                       FieldSpec("history", "sequence", 1, shares="item_id"),
                       FieldSpec("user_id", "single", B, capacity=400, admit_after=2, ttl_s=50.0,
                                 bucket_half_life_s=30.0),
                       FieldSpec("ctx.device", "single", 20)), embedding_dim=4)
# a user map of 12 rows for 40 users: both shares fill and evict
FULL = FeatureConfig((FieldSpec("item_id", "single", B, capacity=16, admit_after=1, init="zero"),
                      FieldSpec("history", "sequence", 1, shares="item_id"),
                      FieldSpec("user_id", "single", B, capacity=12, admit_after=2, bucket_half_life_s=30.0),
                      FieldSpec("ctx.device", "single", 20)), embedding_dim=4)
CFGS = {"roomy": ROOMY, "full": FULL}
ROUNDS = 12
ACC0 = 0.1
USERS = np.arange(40, dtype=np.int64)  # the samples carry these ids as their keys


def rank_batch(cfg: FeatureConfig, rnd: int, rank: int, world: int) -> TensorBatch:
    """Rank ``rank``'s batch of round ``rnd`` (rank 1 of 2 has none in round 3: a rank may bring no rows)."""
    if world > 1 and rank == 1 and rnd == 3:
        return to_tensors(SampleBatch.from_columns(
            impression_id=[], ts=np.zeros(0, np.int64), label=np.zeros(0), label_delay_ms=np.zeros(0),
            user_id=np.zeros(0, np.int64), item_id=np.zeros(0, np.int64), history=[], context={"device": []}), cfg)
    rng = np.random.default_rng(100 * rnd + rank)
    n = 7
    users = rng.integers(0, 20 if rnd < 6 else 40, n)  # the later rounds bring new users, some go idle
    items = rng.integers(0, 30, n)
    return to_tensors(SampleBatch.from_columns(
        impression_id=[f"r{rnd}-{rank}-{k}" for k in range(n)], ts=(rnd * 20_000 + np.arange(n)) * 1,
        label=np.arange(n) % 2, label_delay_ms=np.zeros(n), user_id=users, item_id=items,
        history=[list(rng.integers(0, 30, 2)) for _ in range(n)], context={"device": rng.integers(0, 3, n)}), cfg)


def start_weights(cfg: FeatureConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The table (num_rows, D + 1) and row-wise sums (num_rows,) the runs start from: random, so that every reset,
    copy and move shows."""
    g = torch.Generator().manual_seed(3)
    return torch.randn(cfg.num_rows, cfg.embedding_dim + 1, generator=g), torch.rand(cfg.num_rows, generator=g) + 1


def reference(cfg: FeatureConfig, world: int) -> dict[str, Any]:
    """One process's mapper over each round's batches concatenated in rank order; buckets decayed at the end (what
    a checkpoint does)."""
    model = DeepFM(cfg, mlp=(4,), seed=0, autocast_dtype=None)
    sparse, _ = make_optimizers(model, 0.1, 0.01, initial_accumulator=ACC0)
    w, s = start_weights(cfg)
    table = model.sparse.bag.weight
    with torch.no_grad():
        table.copy_(w)
    sparse.state[table]["sum"] = s.clone()
    mapper, values, stats = RowMapper(cfg), [], []
    now, clock = float("-inf"), EventClock()
    for rnd in range(ROUNDS):
        tb = concat([rank_batch(cfg, rnd, r, world) for r in range(world)], cfg.num_fields)
        now = max(now, clock.advance_s(tb.ts))
        stats.append(mapper.apply(tb, now, model=model, sparse_opt=sparse))
        values.append(tb.values.clone())
    mapper.decay_idle_buckets(model, now)
    return {"table": table.detach().clone(), "sums": sparse.state[table]["sum"].clone(), "values": values,
            "mapper": mapper, "stats": stats}


def rank_work(rank: int, world: int, out: str, cfg_name: str, rounds: int, load: str | None) -> None:
    """One rank (run by ``gloo_rank``): the table from ``start_weights`` (or from ``load``'s dump, with its maps'
    states restored), then ``rounds`` rounds of ``rank_batch``, a checkpoint's decay; dumps what it holds."""
    from learner.sharded_boost import ShardedBoost
    from learner.sharded_ids import ShardedRowMapper
    from learner.sharded_model import ShardedDeepFM, fused_state, local_pieces, shard, state_scale, table_weight

    cfg = CFGS[cfg_name]
    model = ShardedDeepFM(cfg, (4,), 0.0, 0, None, table_device=torch.device("meta"))
    dmp = shard(model, world, torch.device("cpu"), 0.1, 1e-8, ACC0, seed=0)
    c = state_scale(cfg.embedding_dim)
    earlier = pickle.loads(Path(load).read_bytes()) if load else None
    w, s = (earlier["table"], earlier["sums"]) if earlier else start_weights(cfg)
    d = cfg.embedding_dim
    with torch.no_grad():
        for sh in table_weight(dmp).local_shards():
            lo = int(sh.metadata.shard_offsets[0])
            sh.tensor.zero_()
            sh.tensor[:, :d + 1] = w[lo:lo + len(sh.tensor)]
        for sh in fused_state(dmp)["momentum1"].local_shards():
            lo = int(sh.metadata.shard_offsets[0])
            sh.tensor.copy_(s[lo:lo + len(sh.tensor)] * c)
    ids = ShardedRowMapper.of(cfg, dmp, ACC0 * c)
    ids.counts = ShardedBoost(dmp, 1.0, 1.0).counts  # the boost's update counts: reset and moved with rows
    for lo, t in local_pieces(ids.counts):
        t.copy_(earlier["counts"][lo:lo + len(t)] if earlier else torch.arange(lo, lo + len(t)) % 1000 + 1)
    if earlier:
        ids.load_state_dict(earlier["states"], dmp)
    values, stats = [], []
    for rnd in range(rounds):
        tb = rank_batch(cfg, rnd, rank, world)
        stats.append(ids.apply(tb, dmp))
        values.append(tb.values.clone())
    ids.decay_idle(dmp)  # a checkpoint's: the same on every rank
    if rounds:  # a serving delta: it carries the whole maps, merged on rank 0 from every rank's shares
        from learner.delta_writer import DeltaWriter
        from learner.sharded_deltas import ShardedDeltas

        writer = DeltaWriter(Path(out).with_suffix(".deltas"), cfg.num_rows, 1.0, id_maps_every_s=0.0) \
            if rank == 0 else None
        deltas = ShardedDeltas(cfg.num_rows, d, 1.0, writer)
        deltas.id_maps = (cfg, ids.state_dict)
        deltas.mark(values[-1])
        deltas.write(dmp, model, samples=rounds)
    shards = [(int(sh.metadata.shard_offsets[0]), sh.tensor.clone()) for sh in table_weight(dmp).local_shards()]
    sums = [(int(sh.metadata.shard_offsets[0]), sh.tensor.clone() / c)
            for sh in fused_state(dmp)["momentum1"].local_shards()]
    counts = [(lo, t.clone()) for lo, t in local_pieces(ids.counts)]
    shares = {n: f.shares for n, f in ids.fields.items()}
    Path(out).write_bytes(pickle.dumps({"values": values, "shards": shards, "sums": sums, "counts": counts,
                                        "stats": stats, "state": ids.state_dict(), "shares": shares,
                                        "nbytes": ids.nbytes(), "occupancy": dict(ids.occupancy)}))


def run_ranks(world: int, tmp_path: Path, runs: dict[str, tuple[str, int, Path | None]]) -> dict[str, dict[str, Any]]:
    """``rank_work`` on ``world`` spawned ranks for each of ``runs`` (tag: (cfg_name, rounds, load)), in turn on
    the same ranks (one spawn: ``gloo_ranks.in_turn``); per tag, what :func:`gathered` makes of the ranks' dumps."""
    def works(r: int) -> tuple[list[tuple[Any, tuple]]]:
        return ([(rank_work, (str(tmp_path / f"{tag}rank{r}.pkl"), cfg_name, rounds, str(load) if load else None))
                 for tag, (cfg_name, rounds, load) in runs.items()],)

    assert run_gloo_ranks(world, str(tmp_path / "store"), in_turn, works, timeout_s=300) == [0] * world
    return {tag: gathered(world, tmp_path, tag, cfg_name) for tag, (cfg_name, _, _) in runs.items()}


def gathered(world: int, tmp_path: Path, tag: str, cfg_name: str) -> dict[str, Any]:
    """The dumps of run ``tag``'s ranks, the whole table, sums and maps they hold, and rank 0's deltas directory."""
    got = [pickle.loads((tmp_path / f"{tag}rank{r}.pkl").read_bytes()) for r in range(world)]
    from learner.sharded_ids import whole_maps

    cfg = CFGS[cfg_name]
    d = cfg.embedding_dim
    table, sums = torch.zeros(cfg.num_rows, d + 1), torch.zeros(cfg.num_rows)
    counts = torch.zeros(cfg.num_rows, dtype=torch.int32)
    for g in got:
        for lo, t in g["counts"]:
            counts[lo:lo + len(t)] = t
        for lo, t in g["shards"]:
            table[lo:lo + len(t)] = t[:, :d + 1]
            assert not t[:, d + 1:].any()  # padding untouched
        for lo, t in g["sums"]:
            sums[lo:lo + len(t)] = t
    states = [g["state"] for g in got]
    return {"ranks": got, "table": table, "sums": sums, "counts": counts, "states": states,
            "mapper": RowMapper.from_state(cfg, whole_maps(cfg, states)), "deltas": tmp_path / f"{tag}rank0.deltas"}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One spawned rank's ROOMY run, read by the tests below (none writes to it)."""
    return run_ranks(1, tmp_path_factory.mktemp("one_rank"), {"roomy": ("roomy", ROUNDS, None)})


@pytest.fixture(scope="module")
def two_ranks(one_rank: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory,
              ) -> dict[str, dict[str, Any]]:
    """Two spawned ranks' runs, read by the tests below: ROOMY, FULL, and ``restored``: :func:`one_rank`'s maps and
    table restored onto both ranks (no rounds)."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    one, dump = one_rank["roomy"], tmp / "one.pkl"
    dump.write_bytes(pickle.dumps({"table": one["table"], "sums": one["sums"], "counts": one["counts"],
                                   "states": one["states"]}))
    return run_ranks(2, tmp, {"roomy": ("roomy", ROUNDS, None), "full": ("full", ROUNDS, None),
                              "restored": ("roomy", 0, dump)})


def admitted(mapper: RowMapper, field: int, keys: np.ndarray) -> np.ndarray:
    first, buckets = ROOMY.blocks[field]
    return keys[mapper.rows(field, keys) >= first + buckets]


@pytest.mark.parametrize("world", [1, 2])
def test_ranks_mapping_their_shares_give_every_id_one_processs_vector_and_state(
        world: int, request: pytest.FixtureRequest) -> None:
    got = request.getfixturevalue("one_rank" if world == 1 else "two_ranks")["roomy"]
    ref = reference(ROOMY, world)
    mapper, want = got["mapper"], ref["mapper"]
    stats = want.stats()
    assert stats["user_id"]["admissions"] > 0 and stats["user_id"]["evictions_ttl"] > 0  # the cases were exercised
    assert stats["item_id"]["admissions"] > 0 and stats["user_id"]["evictions_lru"] == 0
    for name in ("item_id", "user_id"):  # the whole maps' counts are one process's
        for key in ("admissions", "evictions", "lookups", "bucket_share", "live_rows"):
            assert mapper.stats()[name][key] == pytest.approx(stats[name][key]), (name, key)
    delays = [np.sort(st.time_to_admission["user_id"]).tolist() for st in ref["stats"]]
    assert any(d and max(d) > 0 for d in delays)  # admit_after 2 over rounds 20 s apart: some wait
    for g in got["ranks"]:  # every rank's round stats (rank 0's are published) report one process's delays
        assert [np.sort(st.time_to_admission["user_id"]).tolist() for st in g["stats"]] == delays
        # and its lookups, of the owning fields' own keys only (the bucket share): not history's reads of item rows
        assert [(st.lookups, st.bucket_lookups) for st in g["stats"]] == [
            (st.lookups, st.bucket_lookups) for st in ref["stats"]]
    assert [st.lookups["item_id"] for st in ref["stats"]] == [  # one item per sample
        sum(len(rank_batch(ROOMY, rnd, r, world)) for r in range(world)) for rnd in range(ROUNDS)]
    for f, keys in ((0, np.arange(30, dtype=np.int64)), (2, USERS)):
        assert np.array_equal(admitted(mapper, f, keys), admitted(want, f, keys))  # the same ids on own rows
        rows, ref_rows = mapper.rows(f, keys), want.rows(f, keys)
        assert torch.allclose(got["table"][rows], ref["table"][ref_rows], atol=1e-6)  # each id's vector
        assert torch.allclose(got["sums"][rows], ref["sums"][ref_rows], atol=1e-6)  # and its row-wise sum
        if world == 1:  # one rank is one process, row for row
            assert np.array_equal(rows, ref_rows)
        first, buckets = ROOMY.blocks[f]
        own = rows[rows >= first + buckets]
        assert own.size and not got["counts"][own].any()  # rows handed to new ids: the boost's counts start again
    untouched = torch.arange(ROOMY.num_rows)[ROOMY.blocks[3][0]:]  # ctx.device: no id map
    assert torch.equal(got["counts"][untouched], untouched.to(torch.int32) % 1000 + 1)
    first, buckets = ROOMY.blocks[2]
    assert torch.allclose(got["table"][first:first + buckets], ref["table"][first:first + buckets], atol=1e-6)
    own = torch.zeros(ROOMY.num_rows, dtype=torch.bool)  # (num_rows,) the dynamic fields' own rows
    for f in (0, 2):
        first, buckets = ROOMY.blocks[f]
        own[first + buckets:first + buckets + ROOMY.fields[f].capacity] = True
    for rnd in range(ROUNDS):  # each round: the same samples on buckets and on own rows, one row per id
        tbs = [rank_batch(ROOMY, rnd, r, world) for r in range(world)]
        for tb, g in zip(tbs, got["ranks"], strict=True):
            tb.values.copy_(g["values"][rnd])
        mine, theirs = concat(tbs, ROOMY.num_fields).values, ref["values"][rnd]
        assert torch.equal(own[mine], own[theirs])
        assert torch.equal(mine[~own[mine]], theirs[~own[theirs]])
        pairs = torch.unique(torch.stack([mine[own[mine]], theirs[own[theirs]]]), dim=1)  # (2, P)
        assert len(torch.unique(pairs[0])) == len(torch.unique(pairs[1])) == pairs.shape[1]  # a bijection
    from learner.deltas import list_deltas, load_delta

    (_, _, path), = list_deltas(got["deltas"])
    served = RowMapper.from_state(ROOMY, load_delta(path).id_maps)  # what serving maps ids with
    for f, keys in ((0, np.arange(30, dtype=np.int64)), (2, USERS)):
        assert np.array_equal(served.rows(f, keys), mapper.rows(f, keys))
    if world == 2:  # the user map is split over both ranks, each holding its share only
        shares = got["ranks"][0]["shares"]["user_id"]
        assert [s.rank for s in shares] == [0, 1] and sum(s.count for s in shares) == 400
        for g in got["ranks"]:
            part = g["state"]["id_shards"]["user_id"]["map"]
            assert len(part["row_key"]) < 400


def test_a_full_share_evicts_its_own_least_recently_seen_ids(two_ranks: dict[str, dict[str, Any]]) -> None:
    """Each rank's map is the IdMap of its share (capacity: its own rows) fed, round by round, the keys it owns."""
    from learner.sharded_ids import owner_index

    got = two_ranks["full"]
    shares = got["ranks"][0]["shares"]["user_id"]
    assert len(shares) == 2
    user = [f.name for f in FULL.fields].index("user_id")
    slot = [i for i, *_ in mapped_slots(FULL)].index(user)
    maps = [IdMap(s.count, B, admit_after=2) for s in shares]
    for rnd in range(ROUNDS):
        tbs = [rank_batch(FULL, rnd, r, 2) for r in range(2)]
        keys = np.concatenate([tb.keys[slice(*field_spans(tb, mapped_slots(FULL))[slot])] for tb in tbs if len(tb)])
        now = max(float(tb.ts.max()) / 1000.0 for tb in tbs if len(tb))
        who = owner_index(keys, shares)
        for si, m in enumerate(maps):
            if (who == si).any():
                m.lookup(keys[who == si], now)
    lru = 0
    for si, (s, m) in enumerate(zip(shares, maps, strict=True)):
        part = got["ranks"][s.rank]["state"]["id_shards"]["user_id"]
        assert part["start"] == s.start
        st = m.state_dict()
        r = np.flatnonzero(st["row_key"].numpy() >= 0)  # the share's own rows in use, and their keys
        k = st["row_key"].numpy()[r]
        assert np.array_equal(np.asarray(part["map"]["row_key"]), st["row_key"].numpy()), si
        lru += m.stats()["evictions_lru"]
        # the whole map puts the share's ids on the share's rows
        first, buckets = FULL.blocks[user]
        assert np.array_equal(got["mapper"].rows(user, k), first + buckets + s.start + r)
    assert lru > 0  # both shares were full at some point
    assert got["mapper"].stats()["user_id"]["evictions_lru"] == lru
    # every rank reports every rank's rows given to other ids (rank 0's delta writer holds them: ShardedDeltas.hold)
    for rnd in range(ROUNDS):
        mine, theirs = (np.sort(g["stats"][rnd].reassigned) for g in got["ranks"])
        assert np.array_equal(mine, theirs), rnd
    first, buckets = FULL.blocks[user]
    given = np.concatenate([st.reassigned for st in got["ranks"][0]["stats"]]) - first - buckets
    for s in shares:  # rows of both shares, each handed out by the rank that holds it
        assert ((given >= s.start) & (given < s.start + s.count)).any(), s


def test_a_restore_on_another_world_size_keeps_every_ids_vector_and_sum(one_rank: dict[str, dict[str, Any]],
                                                                        two_ranks: dict[str, dict[str, Any]]) -> None:
    """1 rank's maps restored onto 2 ranks: the ids whose new owner's share does not hold their row move there
    with their vector and row-wise sum; the whole maps' ids are the same, and so is everything that did not move."""
    one, two = one_rank["roomy"], two_ranks["restored"]
    moved = 0
    for f, keys in ((0, np.arange(30, dtype=np.int64)), (2, USERS)):
        assert np.array_equal(admitted(two["mapper"], f, keys), admitted(one["mapper"], f, keys))
        a, b = one["mapper"].rows(f, keys), two["mapper"].rows(f, keys)
        moved += int(np.count_nonzero(a != b))
        assert torch.equal(two["table"][b], one["table"][a])
        assert torch.equal(two["sums"][b], one["sums"][a])
        assert torch.equal(two["counts"][b], one["counts"][a])  # the boost's counts move with their rows
    assert moved > 0  # some user ids changed rank
    whole_one, whole_two = one["mapper"].stats(), two["mapper"].stats()
    assert whole_two["user_id"]["admissions"] == whole_one["user_id"]["admissions"]


def test_the_shards_first_seen_times_survive_the_merge_and_an_old_shards_parts_load_as_unknown() -> None:
    from learner.sharded_ids import whole_maps

    spec = ROOMY.fields[2]  # user_id: admit after 2
    parts: list[dict[str, Any]] = []
    for start, count, user in ((0, 150, 11), (150, 250, 12)):  # two ranks' shares, each counted one user once
        m = IdMap(count, spec.num_buckets, admit_after=spec.admit_after, ttl_s=spec.ttl_s)
        m.lookup(np.array([user]), now=1000.0 + user)
        parts.append({"id_shards": {"user_id": {"start": start, "map": m.state_dict()}}})
    old = parts[1]["id_shards"]["user_id"]["map"]
    for k in [k for k in old if k.endswith("_first_seen")]:  # rank 1's part written before first-seen times
        del old[k]
    whole = RowMapper.from_state(ROOMY, whole_maps(ROOMY, parts))
    res = whole.maps["user_id"].lookup(np.array([11, 12]), now=2000.0)
    assert res.admitted_rows.size == 2
    assert sorted(res.admitted_delay_s.tolist(), key=np.isnan)[0] == 989.0 and np.isnan(res.admitted_delay_s).sum() == 1


def test_a_restored_share_sweeps_expired_ids_at_the_event_time_an_uninterrupted_share_does() -> None:
    """Each share sweeps at its own lookups, so the shares' sweep clocks differ; a restore on the same plan gave
    every share the largest of them: rank 1's share, which last swept at 100 s, restored as if at 105 s, skipped the
    sweep at 106.5 s that the uninterrupted share made, and kept an expired id on its row for one more interval."""
    from learner.sharded_ids import ShardedRowMapper, owner_index

    ranges = [(0, 0, 344), (1, 344, 688)]
    ranks = [ShardedRowMapper(ROOMY, ranges, r, ACC0) for r in (0, 1)]
    shares = ranks[0].fields["user_id"].shares
    keys = np.arange(1000, 1100, dtype=np.int64)
    owner = owner_index(keys, shares)
    k0, k1, later = keys[owner == 0][0], keys[owner == 1][0], keys[owner == 1][1]
    maps = [r.fields["user_id"].map for r in ranks]
    assert maps[0] is not None and maps[1] is not None
    maps[1].lookup(np.array([k1, k1]), now=52.0)  # admitted (admit after 2), seen at 52 s: expires after 102 s
    maps[1].lookup(np.array([k1]), now=52.0)
    maps[1].lookup(np.array([later]), now=100.0)  # rank 1's share sweeps at 100 s (every ttl_s / 8 = 6.25 s)
    maps[0].lookup(np.array([k0]), now=105.0)  # rank 0's at 105 s
    restored = ShardedRowMapper(ROOMY, ranges, 1, ACC0)
    restored.load_state_dict([r.state_dict() for r in ranks], dmp=None)
    again = restored.fields["user_id"].map
    assert again is not None
    went = maps[1].lookup(np.array([later]), now=106.5).evicted_rows
    assert went.size == 1  # the uninterrupted share swept k1 out at 106.5 s
    assert again.lookup(np.array([later]), now=106.5).evicted_rows.tolist() == went.tolist()


def test_a_restored_share_hands_out_its_free_rows_in_the_order_an_uninterrupted_share_does() -> None:
    """A share's free rows are a stack: rows freed by a sweep (or an LRU eviction) go on top and are handed out
    first, highest victim first. A restore on the same plan rebuilt every share's stack lowest row first
    (``IdMap.load_entries``), so after a sweep a restarted rank put newly admitted ids on other rows than the
    uninterrupted one, and its later LRU ties (lowest row first) evicted other ids."""
    from learner.sharded_ids import ShardedRowMapper, owner_index

    ranges = [(0, 0, 344), (1, 344, 688)]
    ranks = [ShardedRowMapper(ROOMY, ranges, r, ACC0) for r in (0, 1)]
    shares = ranks[0].fields["user_id"].shares
    keys = np.arange(1000, 1200, dtype=np.int64)
    mine = keys[owner_index(keys, shares) == 1]
    old, kept, new = mine[[0, 2, 4]], mine[[1, 3]], mine[5:7]
    share = ranks[1].fields["user_id"].map
    assert share is not None
    for t, ids in ((0.0, old), (40.0, kept)):  # admitted on their second sighting (admit after 2)
        share.lookup(np.repeat(ids, 2), now=t)
    assert share.lookup(kept, now=60.0).evicted_rows.size == 3  # the sweep at 60 s frees old's rows (ttl 50 s)
    restored = ShardedRowMapper(ROOMY, ranges, 1, ACC0)
    restored.load_state_dict([r.state_dict() for r in ranks], dmp=None)
    again = restored.fields["user_id"].map
    assert again is not None
    want = share.lookup(np.repeat(new, 2), now=61.0).rows
    assert again.lookup(np.repeat(new, 2), now=61.0).rows.tolist() == want.tolist()


@pytest.mark.parametrize("now", [True, "5", float("nan"), float("inf")])
def test_a_checkpointed_ids_now_that_is_no_event_time_is_refused_at_load_naming_it(now: object) -> None:
    """A rank state's ``ids_now`` (the maps' event time, s) of ``true`` was read through ``float()`` as 1.0 s, and
    ``"5"`` as 5.0 s: a damaged or edited state, refused naming the rank and the field (the restore takes a
    ValueError for damage and uses the checkpoint before it)."""
    from learner.sharded_ids import ShardedRowMapper

    ranges = [(0, 0, 344), (1, 344, 688)]
    states = [ShardedRowMapper(ROOMY, ranges, r, ACC0).state_dict() for r in (0, 1)]
    states[1]["ids_now"] = now
    with pytest.raises(ValueError, match=r"rank 1's ids_now is .*, not an event time in seconds"):
        ShardedRowMapper(ROOMY, ranges, 0, ACC0).load_shares(states)


def _states_giving_a_key_two_rows(across_parts: bool) -> list[dict[str, Any]]:
    """Two ranks' states (user_id: three ids admitted in rank 1's share) damaged so that one admitted id has a second
    row: in the same rank's part, or in rank 0's part too (each part's free stack left consistent with its rows)."""
    from learner.sharded_ids import ShardedRowMapper, owner_index

    ranges = [(0, 0, 344), (1, 344, 688)]
    ranks = [ShardedRowMapper(ROOMY, ranges, r, ACC0) for r in (0, 1)]
    shares = ranks[0].fields["user_id"].shares
    keys = np.arange(1000, 1100, dtype=np.int64)
    mine = keys[owner_index(keys, shares) == 1][:3]
    share = ranks[1].fields["user_id"].map
    assert share is not None
    share.lookup(np.repeat(mine, 2), now=1.0)  # admitted (admit after 2)
    states = [r.state_dict() for r in ranks]
    part = states[0 if across_parts else 1]["id_shards"]["user_id"]["map"]
    row_key = part["row_key"].clone()
    free = np.flatnonzero(row_key.numpy() < 0)
    row_key[int(free[0])] = int(mine[0])
    part["row_key"], part["free"] = row_key, torch.from_numpy(free[1:][::-1].copy())
    return states


@pytest.mark.parametrize("across_parts", [False, True], ids=["one_part", "two_parts"])
def test_a_rank_part_giving_an_id_a_second_row_is_refused_at_restore_and_unshard(across_parts: bool) -> None:
    """A checkpoint whose parts give an admitted id two rows (damaged) is refused, as one process's load refuses such
    a state: merged through ``IdMap.load_entries`` unchecked, the restored share held the id on two rows (one
    leaked, the live count one too many) and every delta's whole maps then carried it, which serving refuses ("gives
    a key more than one row"), so no delta with the maps applied there again."""
    from learner.sharded_ids import ShardedRowMapper, whole_maps

    states = _states_giving_a_key_two_rows(across_parts)
    ranges = [(0, 0, 344), (1, 344, 688)]
    with pytest.raises(ValueError, match="distinct hashed ids >= 0, got a key on more than one row"):
        ShardedRowMapper(ROOMY, ranges, 1, ACC0).load_shares(states)
    with pytest.raises(ValueError, match="distinct hashed ids >= 0, got a key on more than one row"):
        whole_maps(ROOMY, states)


@pytest.mark.parametrize("start", [398, -1])
def test_a_rank_part_whose_rows_leave_the_fields_own_rows_is_refused_at_restore(start: int) -> None:
    """A damaged part whose start puts its rows past the field's own rows (or before them): its ids on rows outside
    every share were moved, from global rows of the next field's block (ctx.device's row 668, its vector and row-wise
    sum copied onto a user's row) or of the field's buckets, in silence."""
    from learner.sharded_ids import ShardedRowMapper, owner_index

    ranges = [(0, 0, 344), (1, 344, 688)]
    ranks = [ShardedRowMapper(ROOMY, ranges, r, ACC0) for r in (0, 1)]
    keys = np.arange(1000, 1100, dtype=np.int64)
    mine = keys[owner_index(keys, ranks[0].fields["user_id"].shares) == 1][:3]
    share = ranks[1].fields["user_id"].map
    assert share is not None
    share.lookup(np.repeat(mine, 2), now=1.0)  # admitted on own rows 76-78 (share 1's first), i.e. its rows 0-2
    states = [r.state_dict() for r in ranks]
    states[1]["id_shards"]["user_id"]["start"] = start  # rows 398-400 of a field of 400 own rows; or -1 to 1
    with pytest.raises(ValueError, match=r"user_id's id map part at own row -?\d+ has 324 rows, outside the field's "
                                         r"400 own rows"):
        ShardedRowMapper(ROOMY, ranges, 1, ACC0).load_shares(states)
