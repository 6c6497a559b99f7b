"""DeepFM with its embedding table sharded row-wise over the ranks by TorchRec's DistributedModelParallel.

Imported only in the distributed mode (``WORLD_SIZE > 1``): TorchRec and fbgemm are the optional
``distributed`` extra, and the single-process learner imports none of this.

    ShardedSparseArch  one TorchRec ``EmbeddingBagCollection`` table of ``num_rows`` rows (the single-process
                       fused table's rows: ``learner/features.py``'s blocks, history sharing item_id's), one
                       feature per field, mean pooling; each row holds ``D`` embedding values, 1 first-order
                       weight and ``W - D - 1`` padding columns (fbgemm's kernels need a width divisible by 4)
    FMInteraction, DenseArch   ``learner/model.py``'s own modules
    ShardedDeepFM      bias + first order + FM + MLP -> one raw logit per sample (no calibration: see below)

:func:`shard` wraps it in ``DistributedModelParallel``: the planner is told row-wise for the table (TorchRec's
``EmbeddingBagCollectionSharder`` lists row-wise for CUDA only; its CPU kernels and gloo collectives run it, so
:class:`RowWiseSharder` offers it on CPU too), the table's optimizer is fbgemm's fused ``EXACT_ROWWISE_ADAGRAD``
(applied inside the backward), and DMP wraps the dense part in DDP (gradients all-reduced, averaged over ranks).

The row-wise Adagrad is ``learner/optim.py``'s update, with one difference in bookkeeping: fbgemm averages the
squared gradient over the row's ``W`` columns, the single-process optimizer over its ``D + 1``; the padding
columns never get a gradient, so fbgemm's sum is ``c = (D + 1) / W`` times ours. :func:`shard` therefore gives
fbgemm ``lr * sqrt(c)``, ``eps * sqrt(c)`` and a starting sum of ``initial_accumulator * c``, which makes every
update equal (``lr' g / (sqrt(c s) + eps') = lr g / (sqrt(s) + eps)``), and checkpoints store the state divided
by ``c`` (``learner/sharded_checkpoint.py``), the single-process optimizer's ``sum``. The boost of young rows
(``boost > 0``) has no fbgemm counterpart: ``learner/sharded_boost.py`` applies it around the fused update.

Shapes: B samples (padded to the round's step size on every rank), F fields, D embedding dim, W padded width,
Dd dense features.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingType

from learner.batch import TensorBatch
from learner.distributed import all_gather_objects
from learner.features import FeatureConfig
from learner.model import DenseArch, FMInteraction

TABLE = "table"
TABLE_KEY = f"sparse.ebc.embedding_bags.{TABLE}.weight"  # the table in the model's state dict
INIT_CHUNK_ROWS = 65_536  # rows drawn per seeded generator: each rank draws only the chunks its shard holds


def padded_width(dim: int) -> int:
    """Columns of a row: ``dim`` embedding values + 1 first-order weight, rounded up to a multiple of 4."""
    return 4 * math.ceil((dim + 1) / 4)


def feature_names(cfg: FeatureConfig) -> list[str]:
    """One TorchRec feature per field, in the config's (field-major) order."""
    return [f.name for f in cfg.fields]


class ShardedSparseArch(nn.Module):
    def __init__(self, cfg: FeatureConfig, device: torch.device) -> None:
        super().__init__()
        self.num_fields, self.dim = cfg.num_fields, cfg.embedding_dim
        self.width = padded_width(cfg.embedding_dim)
        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name=TABLE, embedding_dim=self.width, num_embeddings=cfg.num_rows, feature_names=feature_names(cfg),
            pooling=PoolingType.MEAN)], device=device)

    def forward(self, kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(kjt).values()  # (B, F * W), features in the config's order
        pooled = pooled.view(-1, self.num_fields, self.width)  # (B, F, W)
        emb, first, _ = pooled.split([self.dim, 1, self.width - self.dim - 1], dim=2)  # (B, F, D), (B, F, 1), pad
        return emb, first.squeeze(2)  # (B, F, D), (B, F)


class ShardedDeepFM(nn.Module):
    """``learner.model.DeepFM`` over a TorchRec table; the dense part's parameters carry DeepFM's names
    (``dense_arch.*``, ``bias``), so a checkpoint maps onto a single-process DeepFM by name."""

    def __init__(self, cfg: FeatureConfig, mlp: tuple[int, ...], dropout: float, seed: int,
                 autocast_dtype: torch.dtype | None, table_device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        with torch.random.fork_rng(devices=[]):  # the MLP's init from ``seed``; DDP then copies rank 0's to all
            torch.default_generator.manual_seed(seed)  # the CPU's alone: torch.manual_seed reseeded the CUDA ones too
            self.dense_arch = DenseArch(cfg.num_fields * cfg.embedding_dim + len(cfg.dense), mlp, dropout)
        self.sparse = ShardedSparseArch(cfg, table_device)
        self.fm = FMInteraction()
        self.bias = nn.Parameter(torch.zeros(1))
        self.autocast_dtype = autocast_dtype

    def forward(self, kjt: KeyedJaggedTensor, dense: torch.Tensor) -> torch.Tensor:
        """(B,) raw logits."""
        emb, first = self.sparse(kjt)  # (B, F, D), (B, F)
        with torch.autocast(emb.device.type, dtype=self.autocast_dtype or torch.float32,
                            enabled=self.autocast_dtype is not None):
            x = torch.cat([emb.flatten(1), dense], dim=1) if dense.shape[1] else emb.flatten(1)  # (B, F*D + Dd)
            deep = self.dense_arch(x)  # (B,)
            fm = self.fm(emb)  # (B,)
        return self.bias + first.sum(dim=1) + fm.float() + deep.float()  # (B,)


class RowWiseSharder(EmbeddingBagCollectionSharder):
    """TorchRec's sharder, offering row-wise sharding on CPU as well (module docstring)."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [ShardingType.ROW_WISE.value]


def shard(model: ShardedDeepFM, world_size: int, device: torch.device, lr: float, eps: float,
          initial_accumulator: float, seed: int) -> DistributedModelParallel:
    """``model`` (its table on the meta device) as a DMP: the table row-wise over ``world_size`` ranks with fused
    row-wise Adagrad (hyperparameters rescaled to the single-process update, module docstring), the dense part
    in DDP; the local rows drawn deterministically from ``seed`` (:func:`init_local_rows`)."""
    with _torchrec_advice_quiet():
        dmp = _plan_and_wrap(model, world_size, device, lr, eps)
    init_local_rows(dmp, model.cfg.embedding_dim, seed)
    c = state_scale(model.cfg.embedding_dim)
    for t in fused_state(dmp).values():  # fbgemm starts the sums at 0; ours at initial_accumulator
        for _, sums in local_pieces(t):
            sums.fill_(initial_accumulator * c)
    return dmp


# TorchRec 1.8 advises, on every rank at every start, about its own planner and DDP internals (how its Topology was
# built, its storage estimate in dry runs, a DDP argument it passes itself): nothing a streamrec user can act on.
_TORCHREC_ADVICE_LOGGERS = ("torchrec.distributed.planner.types", "torchrec.distributed.planner.storage_reservations")


@contextlib.contextmanager
def _torchrec_advice_quiet() -> Iterator[None]:
    """TorchRec's FutureWarnings and its planner's advice warnings silenced while the model is planned and wrapped."""
    loggers = [logging.getLogger(name) for name in _TORCHREC_ADVICE_LOGGERS]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchrec\.")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)


def _plan_and_wrap(model: ShardedDeepFM, world_size: int, device: torch.device, lr: float,
                   eps: float) -> DistributedModelParallel:
    """The planner told row-wise for the table, its plan agreed by every rank, and the model wrapped in a DMP."""
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    c = state_scale(model.cfg.embedding_dim)
    sharder = RowWiseSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                           "learning_rate": lr * math.sqrt(c), "eps": eps * math.sqrt(c)})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device=device.type),
        constraints={TABLE: ParameterConstraints(sharding_types=[ShardingType.ROW_WISE.value])})
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=device, plan=plan, sharders=[sharder])


def state_scale(dim: int) -> float:
    """``c``: fbgemm's row-wise sum over the padded width is ``c`` times the single-process optimizer's."""
    return (dim + 1) / padded_width(dim)


def table_weight(dmp: DistributedModelParallel) -> Any:
    """The table: a ShardedTensor (num_rows, W) whose local shards are this rank's rows."""
    return dmp.state_dict()[TABLE_KEY]


def local_pieces(sharded: Any) -> list[tuple[int, torch.Tensor]]:
    """(first global row, this rank's rows) of each local shard of a row-wise ``ShardedTensor`` (the table: rows
    (R, W); a row-wise state: (R,)); the tensors are views, written in place."""
    return [(int(s.metadata.shard_offsets[0]), s.tensor) for s in sharded.local_shards()]


def row_ranges(sharded: Any) -> list[tuple[int, int, int]]:
    """(rank, first row, end row) of every shard of a row-wise ``ShardedTensor``, on every rank, ordered by row."""
    out = []
    for md in sharded.metadata().shards_metadata:
        lo = int(md.shard_offsets[0])
        out.append((int(md.placement.rank()), lo, lo + int(md.shard_sizes[0])))
    return sorted(out, key=lambda r: r[1])


# (first global row, this rank's rows (R, W) (a view), local indices of the step's rows among them (t,), their copy
# (t, W) from before the step)
TouchedRows = list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]


def touched_rows(dmp: DistributedModelParallel, values: torch.Tensor) -> TouchedRows:
    """Collective, before a step's backward: every rank's step rows (an all-gather of each rank's ``values`` (N,),
    the rows its step looks up), and of those this rank holds, a copy as they are before the update (the boost's
    ``w0``, the update norm's "before"). Costs the step's rows, not the table."""
    mine = torch.unique(values).cpu().numpy() if len(values) else np.zeros(0, np.int64)  # (U,)
    touched = np.unique(np.concatenate(all_gather_objects(mine)))  # (T,) every rank's step rows
    out = []
    for start, rows in local_pieces(table_weight(dmp)):  # rows: (R, W) this rank's shard
        sel = touched[(touched >= start) & (touched < start + rows.shape[0])] - start
        idx = torch.from_numpy(sel).to(rows.device)
        out.append((start, rows, idx, rows[idx].clone()))  # (t, W) before the update
    return out


def fused_state(dmp: DistributedModelParallel) -> dict[str, Any]:
    """The fused optimizer's state: ``{"momentum1": ShardedTensor (num_rows,)}`` (fbgemm's row-wise sums)."""
    state = dmp.fused_optimizer.state_dict()["state"][TABLE_KEY]
    return {k.removeprefix(f"{TABLE}."): v for k, v in state.items()}


@torch.no_grad()
def init_local_rows(dmp: DistributedModelParallel, dim: int, seed: int) -> None:
    """Rows N(0, 0.01), first-order weights and padding 0, drawn per chunk of ``INIT_CHUNK_ROWS`` rows from a
    generator seeded with ``(seed, chunk)``: the same table whatever the world size, each rank drawing only the
    chunks that overlap its rows."""
    for start, local in local_pieces(table_weight(dmp)):  # local: (rows on this rank, W)
        end = start + local.shape[0]
        for chunk in range(start // INIT_CHUNK_ROWS, -(-end // INIT_CHUNK_ROWS)):
            c0 = chunk * INIT_CHUNK_ROWS
            g = torch.Generator().manual_seed((seed * 1_000_003 + chunk) % 2**63)
            rows = torch.empty(INIT_CHUNK_ROWS, dim).normal_(0.0, 0.01, generator=g)
            lo, hi = max(start, c0), min(end, c0 + INIT_CHUNK_ROWS)
            local[lo - start:hi - start].zero_()
            local[lo - start:hi - start, :dim] = rows[lo - c0:hi - c0].to(local.device)


def padded_inputs(batch: TensorBatch, rows: int, keys: list[str], device: torch.device,
                  ) -> tuple[KeyedJaggedTensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch`` (B <= rows samples) as ``rows`` samples: (KJT, dense (rows, Dd), labels (rows,), mask (rows,)).
    Padding samples have empty bags in every field (no lookups, a pooled 0) and mask 0."""
    b, f = len(batch), len(keys)
    lengths = torch.zeros(f, rows, dtype=torch.int64)  # (F, rows), field-major like the batch
    if b:
        lengths[:, :b] = (batch.offsets[1:] - batch.offsets[:-1]).view(f, b)
    kjt = KeyedJaggedTensor(keys=keys, values=batch.values, lengths=lengths.reshape(-1)).to(device)
    dense = torch.zeros(rows, batch.dense.shape[1])
    dense[:b] = batch.dense
    labels = torch.zeros(rows)
    labels[:b] = batch.labels
    mask = torch.zeros(rows)
    mask[:b] = 1.0
    return kjt, dense.to(device), labels.to(device), mask.to(device)
