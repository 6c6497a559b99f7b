"""Dynamic ids on N ranks (``learner/sharded_ids.py``): 1 and 2 gloo ranks in processes of their own, each mapping
its share of every round, end with the rows, row-wise sums and id maps that the single-process ``RowMapper``
makes from the same rounds (every rank's batch concatenated in rank order): admission with the bucket's vector and
with zeros, LRU eviction of a full map, the reset optimizer state, bucket decay, a history that only reads."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from learner.batch import TensorBatch, concat, to_tensors
from learner.features import FeatureConfig, FieldSpec
from learner.model import DeepFM
from learner.optim import make_optimizers
from learner.row_mapper import RowMapper
from stream.samples import SampleBatch

B = 6
# rows: item_id [0, 22), user_id [22, 40), ctx.device [40, 60); 2 ranks hold [0, 30) and [30, 60): most new user
# rows start as a bucket vector that lives on the other rank
CFG = FeatureConfig((FieldSpec("item_id", "single", B, capacity=16, admit_after=1, init="zero"),
                     FieldSpec("history", "sequence", 1, shares="item_id"),
                     FieldSpec("user_id", "single", B, capacity=12, admit_after=2, bucket_half_life_s=30.0),
                     FieldSpec("ctx.device", "single", 20)), embedding_dim=4)
ROUNDS = 12
ACC0 = 0.1


def rank_batch(rnd: int, rank: int, world: int) -> TensorBatch:
    """Rank ``rank``'s batch of round ``rnd`` (rank 1 of 2 has none in round 3: a rank may bring no rows)."""
    if world > 1 and rank == 1 and rnd == 3:
        return to_tensors(SampleBatch.from_columns(
            impression_id=[], ts=np.zeros(0, np.int64), label=np.zeros(0), label_delay_ms=np.zeros(0),
            user_id=np.zeros(0, np.int64), item_id=np.zeros(0, np.int64), history=[], context={"device": []}), CFG)
    rng = np.random.default_rng(100 * rnd + rank)
    n = 7
    users = rng.integers(0, 40, n)  # more users than own rows: the map fills and evicts
    items = rng.integers(0, 30, n)
    return to_tensors(SampleBatch.from_columns(
        impression_id=[f"r{rnd}-{rank}-{k}" for k in range(n)], ts=(rnd * 20_000 + np.arange(n)) * 1,
        label=np.arange(n) % 2, label_delay_ms=np.zeros(n), user_id=users, item_id=items,
        history=[list(rng.integers(0, 30, 2)) for _ in range(n)], context={"device": rng.integers(0, 3, n)}), CFG)


def start_weights() -> tuple[torch.Tensor, torch.Tensor]:
    """The table (num_rows, D + 1) and row-wise sums (num_rows,) both runs start from: random, so that every reset
    and copy shows."""
    g = torch.Generator().manual_seed(3)
    return torch.randn(CFG.num_rows, CFG.embedding_dim + 1, generator=g), torch.rand(CFG.num_rows, generator=g) + 1


def reference(world: int) -> dict[str, object]:
    """The single-process mapper over each round's batches concatenated in rank order."""
    model = DeepFM(CFG, mlp=(4,), seed=0, autocast_dtype=None)
    sparse, _ = make_optimizers(model, 0.1, 0.01, initial_accumulator=ACC0)
    w, s = start_weights()
    table = model.sparse.bag.weight
    with torch.no_grad():
        table.copy_(w)
    sparse.state[table]["sum"] = s.clone()
    mapper, values = RowMapper(CFG), []
    now = float("-inf")
    for rnd in range(ROUNDS):
        tb = concat([rank_batch(rnd, r, world) for r in range(world)], CFG.num_fields)
        now = max(now, float(tb.ts.max()) / 1000.0)
        mapper.apply(tb, now, model=model, sparse_opt=sparse)
        values.append(tb.values.clone())
    return {"table": table.detach().clone(), "sums": sparse.state[table]["sum"].clone(), "values": values,
            "maps": mapper.state_dict()}


def rank_main(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from learner.sharded_ids import ShardedRowMapper
    from learner.sharded_model import ShardedDeepFM, fused_state, shard, state_scale, table_weight

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        model = ShardedDeepFM(CFG, (4,), 0.0, 0, None, table_device=torch.device("meta"))
        dmp = shard(model, world, torch.device("cpu"), 0.1, 1e-8, ACC0, seed=0)
        c = state_scale(CFG.embedding_dim)
        w, s = start_weights()
        d = CFG.embedding_dim
        with torch.no_grad():
            for sh in table_weight(dmp).local_shards():
                lo = int(sh.metadata.shard_offsets[0])
                sh.tensor.zero_()
                sh.tensor[:, :d + 1] = w[lo:lo + len(sh.tensor)]
            for sh in fused_state(dmp)["momentum1"].local_shards():
                lo = int(sh.metadata.shard_offsets[0])
                sh.tensor.copy_(s[lo:lo + len(sh.tensor)] * c)
        ids = ShardedRowMapper(RowMapper(CFG), ACC0 * c)
        values = []
        for rnd in range(ROUNDS):
            tb = rank_batch(rnd, rank, world)
            ids.apply(tb, dmp)
            values.append(tb.values.clone())
        ids.decay_idle(dmp)  # a checkpoint's: the same on every rank, the maps stay equal
        shards = [(int(sh.metadata.shard_offsets[0]), sh.tensor.clone()) for sh in table_weight(dmp).local_shards()]
        sums = [(int(sh.metadata.shard_offsets[0]), sh.tensor.clone() / c)
                for sh in fused_state(dmp)["momentum1"].local_shards()]
        Path(out).write_bytes(pickle.dumps({"values": values, "shards": shards, "sums": sums,
                                            "state": ids.state_dict()}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_ranks_mapping_their_shares_end_like_one_process_mapping_the_whole_rounds(world: int, tmp_path: Path) -> None:
    outs = [str(tmp_path / f"rank{r}.pkl") for r in range(world)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, world, str(tmp_path / "store"), outs[r])) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * world
    got = [pickle.loads(Path(o).read_bytes()) for o in outs]
    ref = reference(world)
    # the reference brought its buckets up to date too (what a checkpoint does), so the tables compare
    model = DeepFM(CFG, mlp=(4,), seed=0, autocast_dtype=None)
    mapper = RowMapper(CFG)
    mapper.load_state_dict(ref["maps"])  # type: ignore[arg-type]
    with torch.no_grad():
        model.sparse.bag.weight.copy_(ref["table"])  # type: ignore[arg-type]
    now = max(float(rank_batch(ROUNDS - 1, r, world).ts.max()) / 1000.0 for r in range(world))
    mapper.decay_idle_buckets(model, now)
    d = CFG.embedding_dim
    table = torch.zeros(CFG.num_rows, d + 1)
    sums = torch.zeros(CFG.num_rows)
    for g in got:
        for lo, t in g["shards"]:
            table[lo:lo + len(t)] = t[:, :d + 1]
            assert not t[:, d + 1:].any()  # padding untouched
        for lo, t in g["sums"]:
            sums[lo:lo + len(t)] = t
    for rnd in range(ROUNDS):  # each rank's rows are its slice of the whole round's
        mine = torch.cat([g["values"][rnd] for g in got]) if world == 1 else None
        if world == 1:
            assert torch.equal(mine, ref["values"][rnd])  # type: ignore[arg-type,index]
    if world == 2:  # field-major bags: compare per field via the concatenation of the ranks' batches
        for rnd in range(ROUNDS):
            tbs = [rank_batch(rnd, r, world) for r in range(world)]
            for tb, g in zip(tbs, got, strict=True):
                tb.values.copy_(g["values"][rnd])
            assert torch.equal(concat(tbs, CFG.num_fields).values, ref["values"][rnd])  # type: ignore[index]
    assert torch.allclose(table, model.sparse.bag.weight.detach(), atol=1e-6)
    assert torch.allclose(sums, ref["sums"], atol=1e-6)  # type: ignore[arg-type]
    stats = mapper.stats()
    assert stats["user_id"]["admissions"] > 0 and stats["user_id"]["evictions"] > 0  # the cases were exercised
    assert stats["item_id"]["admissions"] > 0
    for g in got:  # every rank holds the same maps as the single process
        replica = RowMapper(CFG)
        replica.load_state_dict(g["state"]["id_maps"])
        assert replica.stats() == stats
        keys = np.arange(0, 40, dtype=np.int64)  # the samples carry these ids as their keys
        for f in (0, 2):
            assert np.array_equal(replica.rows(f, keys), mapper.rows(f, keys))
            first, buckets = CFG.blocks[f]
            assert (mapper.rows(f, keys) >= first + buckets).any()  # some of them on own rows
