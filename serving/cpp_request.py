"""A scoring request as the C++ loader's input files (serving/cpp/score.cpp): the scorer's row tensors as .npy.

The C++ program (``streamrec_score score VERSION_DIR REQUEST_DIR``) does what
``serving.model.ScoringModel.score_request`` does from the row tensors on; everything before them (request
parsing, BLAKE2b feature hashing, the artifact's id maps) stays here, in the Python that serving runs.
:func:`encode_request` turns a request into exactly what ``serving/app.py`` hands the model, :func:`write_inputs`
writes it (the scorer's user-row layout, ``learner/scorer.py``)::

    REQUEST_DIR/values.npy   (N,) int64               global rows: the user row's bags, then the candidates'
    REQUEST_DIR/offsets.npy  (F + F * B + 1,) int64   bag starts (include_last_offset layout): bag f is field f
                                                      of the user row, bag F + f * B + b field f of candidate b
    REQUEST_DIR/dense.npy    (B, Dd) float32          dense features in the feature config's order

Plain little-endian, C-order .npy (format 1.0): the C++ side maps them with a ~60-line reader, the same one
that maps the artifact's ``cold_rows.npy``.

    python -m serving.cpp_request VERSION_DIR REQUEST_JSON OUT_DIR [--history ITEM ...] [--scores]

writes the files for a JSON request (a file, or ``-`` for stdin) with the user's clicked items (raw ids,
oldest first: what the joiner keeps in Redis, hashed here); ``--scores`` also prints the Python scores, one
per line in the C++ program's format, for comparison.
"""

from __future__ import annotations

import argparse
import io
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from tokenize import TokenError
from typing import Any, NoReturn

import numpy as np
import torch

from serving.features import FeatureEncoder
from serving.model import ScoringModel
from serving.request import parse_request, read_request
from stream.errors import ConfigError, quoted
from stream.features import hash_value
from stream.files import read_regular, write_atomic

LAYOUT = {"values.npy": ("<i8", 1), "offsets.npy": ("<i8", 1), "dense.npy": ("<f4", 2)}  # dtype, dimensions
FILES = tuple(LAYOUT)
MAX_REQUEST_FILE_BYTES = 64 << 20  # the request file: far above any body serving accepts (max_body_bytes)
# One of FILES: a request's row tensors (1000 candidates x a few hundred rows, int64) are far under this.
MAX_INPUT_FILE_BYTES = 256 << 20


def encode_request(model: ScoringModel, body: bytes | dict[str, Any], history: Sequence[int],
                   max_candidates: int = 1000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(values, offsets, dense)`` for one request, as ``ScoringApp._run`` computes them.

    ``history``: the user's clicked items' hashes, oldest first (what ``stream.history.UserHistory`` reads)."""
    req = read_request(body, max_candidates) if isinstance(body, bytes) else parse_request(body, max_candidates)
    return FeatureEncoder(model).encode(req, list(history))


def write_inputs(out_dir: Path, values: np.ndarray, offsets: np.ndarray, dense: np.ndarray) -> Path:
    """Write the scorer's inputs as the C++ loader reads them; returns ``out_dir``. Each file replaces what is at its
    name (:func:`stream.files.write_atomic`): a FIFO there made the write wait for a reader for good, a symlink was
    written through."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arrays = (np.ascontiguousarray(values, dtype="<i8"), np.ascontiguousarray(offsets, dtype="<i8"),
              np.ascontiguousarray(dense, dtype="<f4"))
    for name, arr in zip(FILES, arrays, strict=True):
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        write_atomic(out_dir / name, buf.getvalue())
    return out_dir


def read_inputs(in_dir: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(values, offsets, dense)`` as :func:`write_inputs` wrote them into ``in_dir``.

    Each file is read with :func:`stream.files.read_regular` (at most ``MAX_INPUT_FILE_BYTES``): a FIFO in its place
    hung the reader for good, ``/dev/zero`` read without end. That, a missing or unreadable file, or one that is not
    what :func:`write_inputs` writes (.npy format 1.0, C-order, its :data:`LAYOUT` dtype and dimensions, its data
    exactly the size its header says; not a pickle, not an .npz) is a :class:`ConfigError` naming the file. The header
    is checked before any array is made: a float64 or big-endian file decoded as other numbers, and an empty file,
    or a header cut short or nested past the parser, escaped as EOFError, tokenize.TokenError or RecursionError.
    Then the three must be one request's (:func:`_check_fit`)."""
    arrays = []
    for name, (dtype, ndim) in LAYOUT.items():
        path = Path(in_dir) / name
        try:
            data = read_regular(path, MAX_INPUT_FILE_BYTES, "a request's .npy input")
            buf = io.BytesIO(data)
            if np.lib.format.read_magic(buf) != (1, 0):
                raise ValueError("not .npy format 1.0")
            shape, fortran, dt = np.lib.format.read_array_header_1_0(buf)
            if dt != np.dtype(dtype) or fortran or len(shape) != ndim:
                raise ValueError(f"a {'Fortran' if fortran else 'C'}-order {dt.str} array of shape {shape}, not "
                                 f"a C-order {dtype} array of {ndim} dimension(s)")
            if math.prod(shape) * dt.itemsize != len(data) - buf.tell():
                raise ValueError(f"{len(data) - buf.tell()} bytes of data for shape {shape}")
            arrays.append(np.load(io.BytesIO(data), allow_pickle=False))
        except (OSError, ValueError, EOFError, SyntaxError, TokenError, RecursionError) as exc:
            raise ConfigError(f"request input {path} (REQUEST_DIR/{name}) cannot be read: {quoted(str(exc), 300)}"
                              ) from None
    values, offsets, dense = arrays
    _check_fit(in_dir, values, offsets, dense)
    return values, offsets, dense


def _check_fit(in_dir: Path, values: np.ndarray, offsets: np.ndarray, dense: np.ndarray) -> None:
    """Refuse three files that are each well formed but not one request (files of two requests, or hand-edited ones):
    offsets past the values or running backwards crashed the scorer (Python or C++), and offsets of F fields read
    against B candidates of another request scored rows as the wrong fields, silently. A :class:`ConfigError` names
    the files that disagree and how."""
    b = dense.shape[0]  # candidates: dense (B, Dd), offsets (F + F * B + 1,)
    if len(offsets) == 0 or offsets[0] != 0 or bool(np.any(np.diff(offsets) < 0)):
        _misfit(in_dir, ("offsets.npy",), "offsets must start at 0 and never decrease (bag starts)")
    if offsets[-1] != len(values):
        _misfit(in_dir, ("offsets.npy", "values.npy"),
                f"the last offset is {offsets[-1]}, not the {len(values)} values")
    bags = len(offsets) - 1
    if b == 0 or bags == 0 or bags % (b + 1):
        _misfit(in_dir, ("offsets.npy", "dense.npy"), f"{bags} bags are not F fields (F >= 1) for the user row and "
                                                      f"each of the {b} candidates (F + F * B bags, B >= 1)")


def _misfit(in_dir: Path, names: tuple[str, ...], why: str) -> NoReturn:
    files = " and ".join(f"{Path(in_dir) / name} (REQUEST_DIR/{name})" for name in names)
    raise ConfigError(f"request input{'s' if len(names) > 1 else ''} {files} do not fit: {why}; write all three files "
                      "from one request (write_inputs)")


def python_scores(model: ScoringModel, values: np.ndarray, offsets: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """(B,) float32: what serving answers for these inputs (``ScoringModel.score_request``)."""
    return model.score_request(torch.from_numpy(values), torch.from_numpy(offsets), torch.from_numpy(dense)).numpy()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.cpp_request",
                                 description="Write a scoring request's row tensors for serving/cpp's streamrec_score.")
    ap.add_argument("version_dir", type=Path, help="an artifact version directory (contains manifest.json)")
    ap.add_argument("request", help="the JSON request body (POST /v1/score), a file or - for stdin")
    ap.add_argument("out_dir", type=Path, help="where values.npy, offsets.npy and dense.npy go")
    ap.add_argument("--history", nargs="*", default=[], metavar="ITEM",
                    help="the user's clicked item ids, oldest first (raw ids, hashed like the joiner's)")
    ap.add_argument("--scores", action="store_true", help="also print the Python scores (%%.9g, one per line)")
    args = ap.parse_args(argv)
    try:  # a FIFO named as the file hung the tool (give - and pipe it instead), /dev/zero read without end
        body = sys.stdin.buffer.read() if args.request == "-" else read_regular(args.request, MAX_REQUEST_FILE_BYTES,
                                                                                 "a request body")
    except OSError as exc:
        ap.error(f"request file {args.request}: {exc}")
    model = ScoringModel.load(args.version_dir)
    history = [hash_value(item) for item in args.history]
    values, offsets, dense = encode_request(model, body, history)
    write_inputs(args.out_dir, values, offsets, dense)
    if args.scores:
        for p in python_scores(model, values, offsets, dense):
            print(f"{float(p):.9g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
