"""``python -m serving.cpp_request``'s request file is read with ``stream.files.read_regular``: a FIFO (or a device)
named as the file is a usage error (exit 2) naming it, where a blocking open of an unfed FIFO hung the tool. The FIFO
here is fed a request by a writer thread (``tests.fifos``), so the old code read it and fails on the assertion."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving import cpp_request
from stream.errors import ConfigError
from tests.fifos import fed_fifo


def test_a_request_file_that_is_a_fifo_is_a_usage_error_naming_it(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with fed_fifo(tmp_path / "req.json", b'{"user_id": "a", "items": [1]}') as path, \
            pytest.raises(SystemExit) as exit_:
        cpp_request.main([str(tmp_path / "no-version"), str(path), str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"request file {path}" in err and "not a regular file" in err


def inputs(path: Path) -> Path:
    """A request directory as ``write_inputs`` writes it."""
    return cpp_request.write_inputs(path, np.arange(4), np.array([0, 2, 4]), np.zeros((1, 3), np.float32))


def test_the_written_inputs_read_back(tmp_path: Path) -> None:
    values, offsets, dense = cpp_request.read_inputs(inputs(tmp_path / "req"))
    assert values.tolist() == [0, 1, 2, 3] and offsets.tolist() == [0, 2, 4] and dense.dtype == np.float32


@pytest.mark.parametrize("name", cpp_request.FILES)
def test_an_input_file_that_is_a_fifo_is_refused_unread_naming_it(tmp_path: Path, name: str) -> None:
    """Fed, the FIFO would be read (and the load succeed) by a reader that opens it; one without a writer hangs."""
    req = inputs(tmp_path / "req")
    good = (req / name).read_bytes()
    (req / name).unlink()
    with fed_fifo(req / name, good) as path, pytest.raises(ConfigError, match=rf"{path}.*not a regular file"):
        cpp_request.read_inputs(req)


@pytest.mark.parametrize("kind", ["device", "directory", "missing", "too large", "not npy", "pickle", "npz"])
def test_an_input_file_that_is_no_npy_array_is_a_config_error_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    req = inputs(tmp_path / "req")
    path = req / "dense.npy"
    path.unlink()
    if kind == "device":
        path.symlink_to("/dev/zero")  # read without end
    elif kind == "directory":
        path.mkdir()
    elif kind == "too large":
        monkeypatch.setattr(cpp_request, "MAX_INPUT_FILE_BYTES", 300)  # the others: 160 bytes
        np.save(path, np.zeros(100, np.float32))
    elif kind == "not npy":
        path.write_bytes(b"not an array")
    elif kind == "pickle":
        np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    elif kind == "npz":
        with path.open("wb") as fh:
            np.savez(fh, a=np.zeros(3))
    with pytest.raises(ConfigError, match=r"request input .*dense\.npy \(REQUEST_DIR/dense\.npy\)"):
        cpp_request.read_inputs(req)


def test_an_input_written_over_a_fifo_replaces_it_rather_than_waiting_for_a_reader(tmp_path: Path) -> None:
    """np.save opened the name for writing: a FIFO there blocked the tool until a reader came. A reader end is held
    open here so that such a write does not hang the test but leaves the FIFO in place (and fails below)."""
    req = tmp_path / "req"
    req.mkdir()
    os.mkfifo(req / "values.npy")
    reader = os.open(req / "values.npy", os.O_RDONLY | os.O_NONBLOCK)
    try:
        cpp_request.write_inputs(req, np.arange(4), np.array([0, 2, 4]), np.zeros((1, 3), np.float32))
    finally:
        os.close(reader)
    assert stat.S_ISREG((req / "values.npy").lstat().st_mode)
    assert cpp_request.read_inputs(req)[0].tolist() == [0, 1, 2, 3]


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _header(text: str) -> bytes:
    """A .npy 1.0 file of just this header text (padded as np.save pads), no data."""
    n = len(text) + 1
    pad = -(10 + n) % 64
    return b"\x93NUMPY\x01\x00" + (n + pad).to_bytes(2, "little") + text.encode() + b" " * pad + b"\n"


_GOOD_VALUES = _npy(np.arange(4, dtype="<i8"))


@pytest.mark.parametrize(("name", "data"), [
    ("values.npy", b""),  # EOFError escaped
    ("values.npy", _header("{'descr': '<i8', 'fortran_order': False, 'shape': (4")),  # tokenize.TokenError escaped
    ("values.npy", _header("-" * 5000 + "1")),  # RecursionError escaped
    ("values.npy", _GOOD_VALUES[:-1]),  # truncated data
    ("values.npy", _GOOD_VALUES + b"\0" * 8),  # more data than the header says
    ("values.npy", _npy(np.arange(4.0))),  # float64 read as the rows
    ("values.npy", _npy(np.arange(4, dtype=">i8"))),  # big-endian: the C++ reader maps little-endian
    ("values.npy", _npy(np.arange(4, dtype=np.int32))),
    ("values.npy", _npy(np.zeros((2, 2), np.int64))),  # 2-D rows
    ("offsets.npy", _npy(np.int64(3))),  # 0-D
    ("dense.npy", _npy(np.zeros(3, np.float32))),  # 1-D dense
    ("dense.npy", _npy(np.asfortranarray(np.zeros((3, 2), np.float32)))),  # Fortran order
    ("dense.npy", _npy(np.zeros((1, 3), np.float64))),
    ("values.npy", _header("{'descr': '|O', 'fortran_order': False, 'shape': (1,)}") + b"\0" * 8),  # object
])
def test_an_input_of_another_layout_or_cut_short_is_a_config_error_naming_it(
        tmp_path: Path, name: str, data: bytes) -> None:
    """Each file must be what write_inputs writes (C-order little-endian int64 (N,), int64 (F + F * B + 1,), float32
    (B, Dd), its data exactly the header's size): other files decoded as something else, or escaped as EOFError,
    tokenize.TokenError or RecursionError."""
    req = inputs(tmp_path / "req")
    (req / name).write_bytes(data)
    with pytest.raises(ConfigError, match=rf"request input .*{name} \(REQUEST_DIR/{name}\)"):
        cpp_request.read_inputs(req)


@given(st.sampled_from(cpp_request.FILES), st.one_of(
    st.binary(max_size=200),
    st.builds(lambda cut: _GOOD_VALUES[:cut], st.integers(0, len(_GOOD_VALUES))),
    st.builds(lambda at, byte: _GOOD_VALUES[:at] + bytes([byte]) + _GOOD_VALUES[at + 1:],
              st.integers(0, len(_GOOD_VALUES) - 1), st.integers(0, 255))))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_input_bytes_read_as_the_written_layout_or_are_a_config_error(tmp_path: Path, name: str,
                                                                          data: bytes) -> None:
    req = inputs(tmp_path / "req")
    (req / name).write_bytes(data)
    try:
        arrays = cpp_request.read_inputs(req)
    except ConfigError as exc:
        assert f"REQUEST_DIR/{name}" in str(exc)
        return
    for arr, (dtype, ndim) in zip(arrays, cpp_request.LAYOUT.values(), strict=True):
        assert arr.dtype == np.dtype(dtype) and arr.ndim == ndim and arr.flags.c_contiguous


@pytest.mark.parametrize(("values", "offsets", "dense", "names", "why"), [
    (np.arange(4), np.array([0, 2, 5]), np.zeros((1, 3)), ["offsets", "values"], "last offset is 5, not the 4"),
    (np.arange(4), np.array([0, 2, 3]), np.zeros((1, 3)), ["offsets", "values"], "last offset is 3, not the 4"),
    (np.arange(4), np.array([0, 3, 2, 4]), np.zeros((1, 3)), ["offsets"], "never decrease"),
    (np.arange(4), np.array([1, 2, 4]), np.zeros((1, 3)), ["offsets"], "start at 0"),
    (np.arange(4), np.array([], np.int64), np.zeros((1, 3)), ["offsets"], "start at 0"),
    (np.arange(4), np.array([0, 1, 2, 4]), np.zeros((1, 3)), ["offsets", "dense"], "3 bags .* 1 candidates"),
    (np.arange(4), np.array([0, 2, 4]), np.zeros((2, 3)), ["offsets", "dense"], "2 bags .* 2 candidates"),
    (np.arange(4), np.array([0, 4]), np.zeros((0, 3)), ["offsets", "dense"], "1 bags .* 0 candidates"),
    (np.arange(0), np.array([0]), np.zeros((1, 3)), ["offsets", "dense"], "0 bags"),
])
def test_inputs_that_do_not_fit_each_other_are_a_config_error_naming_the_files_and_the_misfit(
        tmp_path: Path, values: np.ndarray, offsets: np.ndarray, dense: np.ndarray, names: list[str],
        why: str) -> None:
    """Each file well formed, the three not one request's: offsets past the values crashed the scorer, offsets of
    another field count or another candidate count scored rows as the wrong fields without a word."""
    req = cpp_request.write_inputs(tmp_path / "req", values, offsets, dense)
    files = r" and ".join(rf"{req}/{n}\.npy \(REQUEST_DIR/{n}\.npy\)" for n in names)
    with pytest.raises(ConfigError, match=rf"request inputs? {files} do not fit: .*{why}"):
        cpp_request.read_inputs(req)


def test_inputs_of_several_fields_and_candidates_that_fit_read_back(tmp_path: Path) -> None:
    """F = 2 fields, B = 2 candidates: 2 + 2 * 2 bags, some of them empty."""
    offsets = np.array([0, 1, 1, 3, 3, 4, 6])
    req = cpp_request.write_inputs(tmp_path / "req", np.arange(6), offsets, np.zeros((2, 1), np.float32))
    assert cpp_request.read_inputs(req)[1].tolist() == offsets.tolist()
