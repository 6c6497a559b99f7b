"""The scorer: DeepFM's dense half plus the hot rows of the fused table, as one ``nn.Module`` that serving runs.

The scorer is DeepFM's dense half (bias + first order + FM + MLP, ``learner/model.py``'s parts) plus the
HOT rows of the fused embedding table as buffers (``hot_ids`` sorted (H + 1,) with a sentinel,
``hot_vectors`` (H + 1, D + 1)), placed on the scoring device (the GPU when there is one). Rows that are
not hot are gathered by the caller (``serving.model.ScoringModel``, from the artifact's memory-mapped cold
rows) and handed in, in the REQUEST layout (``input_layout`` 2, :data:`USER_ROW_LAYOUT`)::

    Scorer.forward(values (N,) int64 global rows, offsets (F + F*B + 1,) int64 bag starts,
                   dense (B, Dd) float32, given_rows (N, D + 1) float32, given_mask (N,) bool) -> (B,) probs

The bags are a USER ROW first (bags ``0 .. F-1``: field ``f``'s bag shared by every candidate: the user, the
history, the shared context) and then the candidates' bags, field-major (bag ``F + f*B + b``: field ``f`` of
candidate ``b``: the item, per-item context). A field's bag lies on one side only: the other side's bag is empty
(a zero vector), so the pooled bags are ``user (1, F, D + 1) + candidates (B, F, D + 1)``, broadcast: the user's
rows are looked up and pooled ONCE per request instead of once per candidate (~96% of a request's rows were the
user's bags repeated; bench/serving.py ``--profile``). A training batch (``learner.batch.TensorBatch``: every
bag per sample, offsets (F*B + 1,)) is the same layout with an empty user row (:func:`with_empty_user_row`).
Scorers written before this layout (manifest ``scorer.input_layout`` absent: :data:`CANDIDATE_ROWS_LAYOUT`)
take the training batch's layout; ``serving.model.ScoringModel`` keeps loading them (their TorchScript or
export program carries that layout; the other formats are rebuilt from tensors by this code, in this layout).

``given_mask[i]`` says "use ``given_rows[i]``" (a cold row or a delta override); otherwise the row is
looked up among the hot rows with a vectorized ``searchsorted``. Pooling is ``F.embedding_bag``: each bag's sum
over its hot rows plus its given rows, divided by its length, so bags are pooled as the learner's fused
``nn.EmbeddingBag`` (mean) pools them, up to float rounding (~1e-7); a bag pooled in the user row is the same
sum as the same bag pooled per candidate (bit for bit: tests/unit/learner/test_scorer_layout.py).

The same ``Scorer`` class is stored seven ways behind one interface (``learner/scorer_files.py``: ``save_scorer``,
``load_scorer``):

* ``torchscript`` (default) - ``torch.jit.script`` + ``torch.jit.save``;
* ``export`` - ``torch.export.export`` with dynamic N and B, ``torch.export.save`` (the forward-looking
  format: TorchScript is deprecated in torch 2.13);
* ``eager`` - a state dict, rebuilt into a plain ``nn.Module`` (the baseline ``bench/serving.py`` compares);
* ``safetensors`` - the same state dict as a safetensors file (a JSON header and raw tensor bytes), rebuilt
  into a plain ``nn.Module`` from the manifest's typed :class:`ScorerSpec`: loading it unpickles nothing
  and runs no stored code (TorchScript and export load code the artifact carries; ``eager`` is a
  weights-only pickle). The format of a deployment that trusts nothing but the bytes of tensors;
* ``onnx`` - the gather, the pooling and the dense part (FM + MLP) as one ONNX graph run by ONNX Runtime, one call
  per request (input layout 3, :data:`POOLING_GRAPH_LAYOUT`; the hot rows a graph input), the tensors as safetensors
  beside it (``learner/onnx_scorer.py``; ``pip install 'streamrec[onnx]'``);
  ``onnx_int8`` the same with the dense graph dynamically quantized to INT8: not exact, so the refresh checks its
  fp32 weights against the learner and its holdout AUC against its own fp32 scores (``max_int8_auc_drop``);
  ``onnx_int8_static`` statically quantized instead (fixed activation scales calibrated at build time on samples:
  :data:`CALIBRATED_FORMATS`), validated as ``onnx_int8``;
* ``safetensors_bf16`` - the ``safetensors`` file (fp32 tensors, nothing unpickled), its MLP run in bf16
  (:class:`Bf16Scorer`: a bf16 copy of the MLP's weights made at load and after each dense delta; pooling, first
  order, FM and the output in fp32). For CPUs with native bf16 matmuls (AVX512-BF16 or AMX,
  ``learner.model.native_cpu_bf16``): the MLP is most of a request's compute, and bf16 halves it there
  (bench/serving.py). Not exact: validated like INT8 (its fp32 path against the learner, its holdout AUC against
  that path's, ``max_int8_auc_drop``); bench/serving.py ``--precision`` measures the cost.

Scoring runs in fp32 (but for the two inexact formats above). The learner's forward may run its dense part under
bf16 autocast; the reference an artifact must equal (``cache_refresh/validate.py``) is the learner's eager DeepFM in
fp32, which it matches to ~1e-7 on probabilities (tests/unit/learner/test_artifact.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from learner.calibration import add_calibration, calibrated
from learner.config import ArtifactFormat
from learner.model import DenseArch, FMInteraction

FORMATS = tuple(f.value for f in ArtifactFormat)
SCORER_FILES = {"torchscript": "scorer.pt", "export": "scorer.pt2", "eager": "scorer_state.pt",
                "safetensors": "scorer.safetensors", "onnx": "scorer.onnx", "onnx_int8": "scorer_int8.onnx",
                "onnx_int8_static": "scorer_int8_static.onnx", "safetensors_bf16": "scorer.safetensors"}
# Files a format reads beside SCORER_FILES[fmt] (listed and checked in the manifest like it): ``onnx`` keeps the
# scorer's tensors (hot rows, dense weights) as safetensors next to the dense graph (learner/onnx_scorer.py).
SCORER_EXTRA_FILES: dict[str, tuple[str, ...]] = {"onnx": ("scorer.safetensors",), "onnx_int8": ("scorer.safetensors",),
                                                   "onnx_int8_static": ("scorer.safetensors",)}
# formats whose every file loads without unpickling
PICKLE_FREE_FORMATS = ("safetensors", "onnx", "onnx_int8", "onnx_int8_static", "safetensors_bf16")
# Not exact (reduced precision: INT8, and bf16 alike): validated by their holdout AUC cost (cache_refresh/validate.py)
REDUCED_PRECISION_FORMATS = ("onnx_int8", "onnx_int8_static", "safetensors_bf16")
# Quantized with activation scales calibrated on samples at build time (``build_artifact``'s ``calibration``: the
# refresh job's older holdout samples, cache_refresh/validate.py ``calibration_split``)
CALIBRATED_FORMATS = ("onnx_int8_static",)
_SENTINEL = torch.iinfo(torch.int64).max  # a row id no table reaches: keeps searchsorted in bounds
# The scorer's input layouts (manifest ``scorer.input_layout``; module docstring):
CANDIDATE_ROWS_LAYOUT = 1  # every bag per candidate, offsets (F*B + 1,): artifacts from before issue 17
USER_ROW_LAYOUT = 2  # the user row's F bags, then the candidates' F*B bags: offsets (F + F*B + 1,)
# The user-row layout, with the pooling inside the stored ONNX graph (learner/onnx_scorer.py's RequestHead): what the
# onnx formats write since issue 17's lean request path. A server from before it refuses the manifest (the number is
# new to it) instead of failing on the graph's inputs.
POOLING_GRAPH_LAYOUT = 3
SCORER_LAYOUTS = (CANDIDATE_ROWS_LAYOUT, USER_ROW_LAYOUT, POOLING_GRAPH_LAYOUT)
ONNX_FORMATS = ("onnx", "onnx_int8", "onnx_int8_static")
INT8_FORMATS = ("onnx_int8", "onnx_int8_static")  # ONNX graphs quantized to INT8


# -- the scorer ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScorerSpec:
    """What it takes to rebuild a Scorer (stored in the manifest)."""

    num_fields: int
    dim: int
    num_dense: int
    mlp: tuple[int, ...]
    dropout: float
    # The layout of the stored scorer's inputs: what this code builds is USER_ROW_LAYOUT; a manifest without the
    # key is from before it (CANDIDATE_ROWS_LAYOUT).
    input_layout: int = USER_ROW_LAYOUT

    def to_dict(self) -> dict[str, Any]:
        return {"num_fields": self.num_fields, "dim": self.dim, "num_dense": self.num_dense,
                "mlp": list(self.mlp), "dropout": self.dropout, "input_layout": self.input_layout}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScorerSpec:
        return cls(int(d["num_fields"]), int(d["dim"]), int(d["num_dense"]), tuple(int(x) for x in d["mlp"]),
                   float(d["dropout"]), int(d.get("input_layout", CANDIDATE_ROWS_LAYOUT)))


class Scorer(nn.Module):
    """DeepFM's dense half + the hot rows. Parameter names match DeepFM's (``dense_arch.*``, ``bias``)."""

    def __init__(self, spec: ScorerSpec, hot_ids: torch.Tensor, hot_vectors: torch.Tensor) -> None:
        super().__init__()
        self.num_fields, self.dim = spec.num_fields, spec.dim
        self.fm = FMInteraction()
        self.dense_arch = DenseArch(spec.num_fields * spec.dim + spec.num_dense, spec.mlp, spec.dropout)
        self.bias = nn.Parameter(torch.zeros(1))
        add_calibration(self)  # the (2,) buffer of DeepFM's (a, b): a * logit + b
        self.register_buffer("hot_ids", hot_ids)  # (H + 1,) int64 sorted, last = sentinel
        self.register_buffer("hot_vectors", hot_vectors)  # (H + 1, D + 1) float32, last = zeros

    def pool(self, values: torch.Tensor, offsets: torch.Tensor, given_rows: torch.Tensor,
             given_mask: torch.Tensor) -> torch.Tensor:
        """The mean-pooled bags (B, F, D + 1) of a request-layout input (the user row's F bags, then F*B): hot rows
        looked up, ``given_rows`` where ``given_mask``; the user row pooled once and broadcast to the candidates."""
        hot_ids, hot_vectors = self.hot_ids, self.hot_vectors
        assert isinstance(hot_ids, torch.Tensor) and isinstance(hot_vectors, torch.Tensor)  # buffers (for mypy)
        pos = torch.searchsorted(hot_ids, values)  # (N,) in [0, H]: the sentinel keeps it in range
        given = given_mask.to(hot_vectors.dtype)  # (N,) 1.0 where given_rows holds the row, else 0.0
        index = torch.ones_like(values).cumsum(0) - 1  # arange(N) on values' device (no device constant)
        # Sum each bag straight from the hot table (weight 0 where the row is given) plus from given_rows (weight 0
        # where it is hot), then divide by the bag's length: no (N, D + 1) gather-and-select in between (~30% less
        # time than gathering, selecting and mean-pooling; the same mean up to float rounding, ~1e-7).
        summed = (F.embedding_bag(pos, hot_vectors, offsets, mode="sum", per_sample_weights=1.0 - given,
                                  include_last_offset=True)
                  + F.embedding_bag(index, given_rows, offsets, mode="sum", per_sample_weights=given,
                                    include_last_offset=True))  # (F + F*B, D + 1)
        lengths = (offsets[1:] - offsets[:-1]).clamp(min=1).to(summed.dtype).unsqueeze(1)  # (F + F*B, 1); empty: 0
        pooled = summed / lengths  # (F + F*B, D + 1) means
        user = pooled[: self.num_fields].unsqueeze(0)  # (1, F, D + 1): the user row
        cand = pooled[self.num_fields:].view(self.num_fields, -1, self.dim + 1).transpose(0, 1)  # (B, F, D + 1)
        # A field's bag is on one side, the other side's is empty (exactly 0): the sum is the bag's mean, exactly.
        return cand + user  # (B, F, D + 1)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor,
                given_rows: torch.Tensor, given_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(values, offsets, given_rows, given_mask), dense)

    def head(self, pooled: torch.Tensor, dense: torch.Tensor, fp32: bool = False) -> torch.Tensor:
        """Probabilities (B,) from the pooled bags (B, F, D + 1) and the dense features (B, Dd); ``fp32``: the MLP
        in fp32 whatever :meth:`deep` runs it in."""
        cal = self.calibration
        assert isinstance(cal, torch.Tensor)
        emb, first = pooled[:, :, : self.dim], pooled[:, :, self.dim]  # (B, F, D), (B, F)
        x = torch.cat([emb.flatten(1), dense], dim=1)  # (B, F*D + Dd)
        deep = self.dense_arch(x) if fp32 else self.deep(x)  # (B,)
        logits = self.bias + first.sum(dim=1) + self.fm(emb) + deep  # (B,)
        return torch.sigmoid(calibrated(logits, cal))  # as DeepFM serves in eval mode

    def deep(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP (B, F*D + Dd) -> (B,)."""
        return self.dense_arch(x)


class Held:
    """A scorer's runtime form of its weights (the bf16 MLP copy, an ONNX Runtime session), held outside its
    submodules and so outside its state dict; a deepcopy of the scorer (serving's dense delta) shares it until the
    copy's ``rebuild_session`` makes its own from the updated weights."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __deepcopy__(self, memo: dict[int, Any]) -> Held:
        return self


class Bf16Scorer(Scorer):
    """A :class:`Scorer` whose MLP runs in bf16: the ``safetensors_bf16`` format.

    The stored (and delta-updated) tensors stay the fp32 ones of :class:`Scorer` (same names, same state dict);
    the MLP's bf16 copy is made by :meth:`rebuild_session` (at load, and by serving after a delta replaced the
    dense weights, as for the ONNX scorer). :meth:`torch_forward` is the same scorer in fp32 (the refresh's
    reference for an inexact format)."""

    def __init__(self, spec: ScorerSpec, hot_ids: torch.Tensor, hot_vectors: torch.Tensor) -> None:
        super().__init__(spec, hot_ids, hot_vectors)
        self._bf16 = Held(None)

    def rebuild_session(self) -> None:
        """Re-make the MLP's bf16 copy from this module's (updated) fp32 weights."""
        mlp = copy.deepcopy(self.dense_arch).to(torch.bfloat16).eval()
        for p in mlp.parameters():
            p.requires_grad_(False)
        self._bf16 = Held(mlp)

    def deep(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self._bf16.value
        if mlp is None:  # not rebuilt yet (a scorer just constructed): fp32
            return self.dense_arch(x)
        return mlp(x.to(torch.bfloat16)).float()  # (B,)

    def torch_forward(self, values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor,
                      given_rows: torch.Tensor, given_mask: torch.Tensor) -> torch.Tensor:
        """The same scores with the MLP in fp32 (an inexact format's reference)."""
        return self.head(self.pool(values, offsets, given_rows, given_mask), dense, fp32=True)


def with_empty_user_row(offsets: torch.Tensor, num_fields: int) -> torch.Tensor:
    """A training batch's offsets (F*B + 1,) (every bag per sample) as the request layout's (F + F*B + 1,): F empty
    bags in front (the user row, pooled to zeros), the same bags after."""
    return torch.cat([offsets.new_zeros(num_fields), offsets])  # offsets[0] == 0: F empty bags, then the batch's


def to_candidate_rows(values: np.ndarray, offsets: np.ndarray, num_fields: int) -> tuple[np.ndarray, np.ndarray]:
    """A request-layout input (values (N,), offsets (F + F*B + 1,)) in the layout of scorers from before it
    (:data:`CANDIDATE_ROWS_LAYOUT`): every candidate's bag of field ``f`` is the user row's bag ``f`` followed by the
    candidate's own (one of the two is empty), so the user's rows are repeated per candidate as they used to be.
    Returns (values (N',), offsets (F*B + 1,))."""
    f = num_fields
    lengths = np.diff(offsets)  # (F + F*B,)
    b = (len(lengths) - f) // f
    u_len = np.repeat(lengths[:f], b)  # (F*B,): the user row's bag of the candidate's field
    c_len = lengths[f:]  # (F*B,)
    seg_len = np.stack([u_len, c_len], axis=1).ravel()  # (2*F*B,): user part, candidate part, per output bag
    seg_src = np.stack([np.repeat(offsets[:f], b), offsets[f:-1]], axis=1).ravel()  # (2*F*B,) where each starts
    seg_dst = np.cumsum(seg_len) - seg_len  # (2*F*B,) where each lands
    idx = np.arange(int(seg_len.sum()), dtype=np.int64) + np.repeat(seg_src - seg_dst, seg_len)  # (N',)
    out_offsets = np.zeros(f * b + 1, np.int64)
    np.cumsum(u_len + c_len, out=out_offsets[1:])
    return values[idx], out_offsets


def hot_buffers(table: torch.Tensor, hot_rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The scorer's hot buffers for global rows ``hot_rows`` of ``table`` (num_rows, D + 1): sorted ids (H + 1,)
    ending in the sentinel, and their vectors (H + 1, D + 1) ending in zeros. ValueError for rows outside it."""
    rows = np.unique(np.asarray(hot_rows, dtype=np.int64))  # sorted, unique
    if len(rows) and (rows[0] < 0 or rows[-1] >= table.shape[0]):
        raise ValueError(f"hot rows must lie in [0, {table.shape[0]}), got [{rows[0]}, {rows[-1]}]")
    ids = torch.from_numpy(np.append(rows, _SENTINEL))  # (H + 1,)
    vectors = torch.cat([table[torch.from_numpy(rows)], torch.zeros(1, table.shape[1])])  # (H + 1, D + 1)
    return ids, vectors.contiguous()


def hot_problem(hot_ids: np.ndarray, hot_vectors: tuple[int, ...] | None, num_rows: int, dim: int) -> str | None:
    """Why a loaded scorer's hot buffers are not what :func:`hot_buffers` makes for a table of ``num_rows`` rows of
    ``dim + 1`` values, or None: ``hot_ids`` (H + 1,) int64, distinct rows of the table in increasing order, then the
    sentinel; ``hot_vectors`` (its shape; None: a program that does not expose it) (H + 1, D + 1). Every lookup
    searches them: without the sentinel last, or a vector short, a row past the last hot one indexed past their end
    (an IndexError for each request holding one), and unsorted ids missed rows they hold."""
    if hot_ids.ndim != 1 or len(hot_ids) < 1 or hot_ids.dtype != np.int64:
        return f"hot_ids is {hot_ids.dtype} {tuple(hot_ids.shape)}, expected int64 (H + 1,)"
    if int(hot_ids[-1]) != _SENTINEL:
        return f"hot_ids ends in {int(hot_ids[-1])}, not the sentinel {_SENTINEL}"
    rows = hot_ids[:-1]
    if len(rows) and not (bool(np.all(rows[1:] > rows[:-1])) and rows[0] >= 0 and rows[-1] < num_rows):
        return f"hot_ids are not distinct rows of [0, {num_rows}) in increasing order"
    if hot_vectors is not None and tuple(hot_vectors) != (len(hot_ids), dim + 1):
        return f"hot_vectors is {tuple(hot_vectors)}, expected ({len(hot_ids)}, {dim + 1}): one row per hot id"
    return None
