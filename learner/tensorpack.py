"""A checksummed container of tensors and JSON metadata that loads without unpickling anything.

Used for the learner's serving deltas (``learner/deltas.py``): a delta crosses from the learner to
serving through a directory, so serving must be able to tell a damaged or foreign file from a good one
before a single value of it reaches the live model. ``torch.save`` files are pickles (and carry no
checksum); this format is plain bytes, in the spirit of safetensors (which holds flat tensors only; a
delta is a tree of them with metadata)::

    offset  size  field
    0       8     magic  b"SRPACK\\x00\\x01" (container format 1)
    8       32    sha256 of every byte after this field (header length, header, data)
    40      8     header length H, unsigned little-endian
    48      H     header, UTF-8 JSON: {"tree": <value>, "tensors": [[dtype, shape, offset, nbytes], ...]}
    48 + H  ...   data: the tensors' raw little-endian bytes, at ``offset`` from the start of the data

:func:`pack` pads the header (JSON whitespace) and each tensor's offset to a multiple of :data:`ALIGN` bytes
from the start of the file, so a reader that holds the file in a writable, aligned buffer (``learner/deltas.py``'s
:func:`~learner.deltas.load_delta`) gets tensors that are views of it (``torch.frombuffer``: no copy); readers of
packs written before the padding, and of read-only ``bytes``, copy each tensor as before.

Container format 2 (``b"SRPACK\\x00\\x02"``) is format 1 signed: the same fields with an HMAC-SHA256 under
the deployment's signing key (:class:`SigningKey`, ``signing_key_file`` in the settings) between the
checksum and the header length::

    0       8     magic  b"SRPACK\\x00\\x02"
    8       32    sha256 of every byte after this field (HMAC, header length, header, data)
    40      32    HMAC-SHA256(key, every byte after this field: header length, header, data)
    72      8     header length H
    80      H     header, then data, as in format 1

:func:`pack` writes format 1 without a key and format 2 with one. :func:`unpack` without a key reads
both (a signature it cannot check is not checked; the checksum still is); with a key it reads only a
format-2 pack whose HMAC matches (:class:`SignatureError` otherwise: an unsigned pack, or one signed
with another key or altered and re-checksummed), so a reader with a key accepts nothing its writer's
key did not sign.

A ``<value>`` is JSON (objects with string keys, lists, strings, finite numbers, booleans, null), where
``{"$tensor": i}`` stands for tensor ``i`` of the table and ``{"$float": "inf" | "-inf" | "nan"}`` for a
non-finite float (JSON has none). Keys starting with ``$`` are reserved; tuples come back as lists.
Dtypes: bool, uint8, int8, int16, int32, int64, float16, float32, float64.

:func:`unpack` checks, in this order, and raises :class:`PackError` (a ``ValueError``) naming the first
problem: length, magic, checksum, signature (with a key), header size, UTF-8, JSON (no key repeated in an
object), header shape, every tensor's dtype, shape, offset and size against the data, bool bytes in {0, 1},
and every ``$`` reference.
It never raises anything else for any input bytes (``tests/integration/test_serving_faults.py`` fuzzes it). Values
are not checked for finiteness here: that is the caller's rule (a delta must be finite, an id map may hold ``-inf``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import stat
import struct
import sys
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch

from stream.errors import BadMessage, ConfigError, StreamrecError
from stream.events import count_keys, reject_duplicate_keys
from stream.files import MAX_SETTINGS_FILE_BYTES, read_regular_stat
from stream.secrets import TIGHTEN_MODE, loose_mode, register

MAGIC = b"SRPACK\x00\x01"  # container format 1: unsigned
MAGIC_SIGNED = b"SRPACK\x00\x02"  # container format 2: signed with an HMAC-SHA256
_PREFIX = 48  # magic + sha256 + header length
_PREFIX_SIGNED = 80  # magic + sha256 + HMAC + header length
MIN_KEY_BYTES = 16
_MAX_HEADER = 64 << 20
_MAX_DEPTH = 32
_MAX_DIMS = 8
_DTYPES: dict[str, np.dtype] = {name: np.dtype(name).newbyteorder("<") for name in
                                ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64")}
_TORCH = {torch.bool: "bool", torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16", torch.int32: "int32",
          torch.int64: "int64", torch.float16: "float16", torch.float32: "float32", torch.float64: "float64"}
_TORCH_OF = {name: dtype for dtype, name in _TORCH.items()}
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
ALIGN = 64  # file offset of the data and of every tensor in it, a multiple of this (pack pads)
_NATIVE = sys.byteorder == "little"  # tensors are stored little-endian: views only where that is native
log = logging.getLogger(__name__)


class PackError(StreamrecError, ValueError):
    """Bytes that are not a complete, intact tensor pack; the message says what was wrong."""


class SignatureError(PackError):
    """A pack a reader with a signing key refuses: unsigned, or its HMAC does not match that key."""


# -- the signing key -------------------------------------------------------------------------------
class SigningKey:
    """An HMAC-SHA256 key: the bytes of ``signing_key_file``, read once at startup (:func:`load_signing_key`).

    Never printed: ``str``/``repr`` are masked, it refuses to be pickled, and its text (when it is text) is
    registered with ``stream.secrets`` so :func:`stream.secrets.redact` scrubs it from logs."""

    __slots__ = ("_key", "source")

    def __init__(self, key: bytes, source: str = "") -> None:
        key = bytes(key)
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"a signing key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self._key = key
        self.source = source  # where it was read from (a path), for messages
        try:
            register(key.decode("utf-8"))
        except UnicodeDecodeError:
            pass  # binary keys never appear in text

    def digest(self, data: bytes | bytearray | memoryview) -> bytes:
        """HMAC-SHA256 of ``data`` (32 bytes)."""
        return hmac.new(self._key, data, hashlib.sha256).digest()

    def sign(self, data: bytes | bytearray | memoryview) -> str:
        """HMAC-SHA256 of ``data``, hex (64 digits)."""
        return self.digest(data).hex()

    def verify(self, data: bytes | bytearray | memoryview, signature: str | bytes) -> bool:
        """Whether ``signature`` (hex, or the 32 raw bytes) is this key's HMAC of ``data`` (constant time)."""
        want = self.digest(data)
        if isinstance(signature, str):
            try:
                signature = bytes.fromhex(signature)
            except ValueError:
                return False
        return hmac.compare_digest(want, bytes(signature))

    def __repr__(self) -> str:
        return "SigningKey(***)"

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:
        raise TypeError("a SigningKey is not pickled (it would write the key into the file)")


def load_signing_key(path: Path | str | None) -> SigningKey | None:
    """The key in ``path`` (``signing_key_file``; None: no key). A trailing newline is dropped, as for every
    secret file. ConfigError naming the file when it cannot be read or is shorter than 16 bytes, and for an
    empty path (a missing secret path must not turn signing off: None is how to say "no key"). A key file other
    users can read or write (mode bits o+r, o+w, g+w) is loaded with a warning (refusing it would stop every process
    on a secret volume mounted 0644, Kubernetes' default); one only its group reads is the way to share it."""
    if path is None:
        return None
    if str(path).strip() == "":
        raise ConfigError("signing_key_file is empty: give the key file's path, or leave the setting out to run "
                          "without a signing key")
    p = Path(path)
    try:  # a FIFO or a device in place of the key would hang the process or read without end: refused unread
        raw, st = read_regular_stat(p, MAX_SETTINGS_FILE_BYTES)
    except OSError as exc:
        raise ConfigError(f"signing_key_file {p}: cannot read it ({exc.strerror or exc}); mount the key file or "
                          "unset signing_key_file") from None
    risks = loose_mode(st.st_mode, " (and sign deltas and manifests serving accepts)",
                       " (and choose the key a restarted process trusts)")
    if risks:  # loaded all the same: a secret volume mounted 0644 must still start
        log.warning("signing_key_file %s has mode %04o: %s; %s", p, stat.S_IMODE(st.st_mode), " and ".join(risks),
                    TIGHTEN_MODE)
    raw = raw.rstrip(b"\r\n")
    if len(raw) < MIN_KEY_BYTES:
        raise ConfigError(f"signing_key_file {p}: {len(raw)} bytes, a signing key needs at least {MIN_KEY_BYTES} "
                          "(make one with `openssl rand -hex 32 > FILE`, the same file for the learner, the "
                          "refresh and serving)")
    return SigningKey(raw, str(p))


# -- writing ---------------------------------------------------------------------------------------
def pack(tree: Any, key: SigningKey | None = None) -> bytes:
    """The bytes of ``tree`` (dicts with str keys, lists/tuples, str, int, float, bool, None, CPU tensors,
    numpy arrays); signed (format 2) with ``key``. Raises ``TypeError``/``ValueError`` for anything else (a
    bug in the writer)."""
    specs: list[list[Any]] = []
    chunks: list[bytes] = []
    size = 0

    def enc(v: Any, depth: int) -> Any:
        nonlocal size
        if depth > _MAX_DEPTH:
            raise ValueError(f"pack: nested deeper than {_MAX_DEPTH}")
        if isinstance(v, torch.Tensor):
            if v.dtype not in _TORCH:
                raise TypeError(f"pack: tensor dtype {v.dtype} is not supported; use one of {sorted(_DTYPES)}")
            v = v.detach().cpu().contiguous().numpy()
        if isinstance(v, np.ndarray):
            name = v.dtype.name
            if name not in _DTYPES:
                raise TypeError(f"pack: array dtype {v.dtype} is not supported; use one of {sorted(_DTYPES)}")
            raw = np.ascontiguousarray(v, dtype=_DTYPES[name]).tobytes()
            pad = -size % ALIGN
            if pad:
                chunks.append(bytes(pad))
                size += pad
            specs.append([name, list(v.shape), size, len(raw)])
            chunks.append(raw)
            size += len(raw)
            return {"$tensor": len(specs) - 1}
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                if not isinstance(k, str) or k.startswith("$"):
                    raise ValueError(f"pack: key {k!r}: keys must be strings not starting with '$'")
                out[k] = enc(x, depth + 1)
            return out
        if isinstance(v, (list, tuple)):
            return [enc(x, depth + 1) for x in v]
        if isinstance(v, float) and not math.isfinite(v):
            return {"$float": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if isinstance(v, (np.integer, np.floating, np.bool_)):
            return enc(v.item(), depth)
        if v is None or isinstance(v, (str, bool, int, float)):
            return v
        raise TypeError(f"pack: cannot store a {type(v).__name__}")

    header = json.dumps({"tree": enc(tree, 0), "tensors": specs}, allow_nan=False,
                        separators=(",", ":")).encode()
    header += b" " * (-((_PREFIX_SIGNED if key is not None else _PREFIX) + len(header)) % ALIGN)  # data aligned
    body = struct.pack("<Q", len(header)) + header + b"".join(chunks)
    if key is not None:
        body = key.digest(body) + body
        return MAGIC_SIGNED + hashlib.sha256(body).digest() + body
    return MAGIC + hashlib.sha256(body).digest() + body


# -- reading ---------------------------------------------------------------------------------------
def _tensor(i: int, spec: Any, data: memoryview) -> torch.Tensor:
    if not (isinstance(spec, list) and len(spec) == 4):
        raise PackError(f"tensor {i}: spec {str(spec)[:80]} is not [dtype, shape, offset, nbytes]")
    name, shape, offset, nbytes = spec
    if not isinstance(name, str) or name not in _DTYPES:
        raise PackError(f"tensor {i}: dtype {str(name)[:40]!r} is not one of {', '.join(_DTYPES)}")
    if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(type(d) is int and d >= 0 for d in shape)):
        raise PackError(f"tensor {i}: shape {str(shape)[:80]} is not a list of at most {_MAX_DIMS} sizes >= 0")
    if not (type(offset) is int and type(nbytes) is int and offset >= 0 and nbytes >= 0):
        raise PackError(f"tensor {i}: offset {offset!r} and nbytes {nbytes!r} must be integers >= 0")
    dt = _DTYPES[name]
    count = math.prod(shape)
    if count * dt.itemsize != nbytes:
        raise PackError(f"tensor {i}: shape {shape} of {name} needs {count * dt.itemsize} bytes, the header says "
                        f"{nbytes}")
    if offset + nbytes > len(data):
        raise PackError(f"tensor {i}: bytes [{offset}, {offset + nbytes}) lie beyond the data ({len(data)} bytes): "
                        "the file is truncated")
    try:
        arr = np.frombuffer(data, dtype=dt, count=count, offset=offset).reshape(shape)
    except ValueError as exc:  # guarded above; kept so that no input escapes as another error
        raise PackError(f"tensor {i}: {exc}") from None
    if name == "bool" and arr.view(np.uint8).max(initial=0) > 1:
        raise PackError(f"tensor {i}: bool bytes other than 0 and 1")
    if _NATIVE and not data.readonly and arr.flags.aligned and count:
        # a view of the caller's writable buffer (no copy); it keeps the buffer alive
        return torch.frombuffer(data, dtype=_TORCH_OF[name], count=count, offset=offset).reshape(shape)
    return torch.from_numpy(arr.astype(dt.newbyteorder("="), copy=True))


def _tree(v: Any, tensors: list[torch.Tensor | None], specs: list[Any], data: memoryview, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise PackError(f"tree nested deeper than {_MAX_DEPTH}")
    if isinstance(v, dict):
        if any(k.startswith("$") for k in v):
            if set(v) == {"$tensor"}:
                i = v["$tensor"]
                if type(i) is not int or not 0 <= i < len(specs):
                    raise PackError(f"tensor reference {str(i)[:40]} is not an index into {len(specs)} tensors")
                t = tensors[i]
                if t is None:
                    t = tensors[i] = _tensor(i, specs[i], data)
                return t
            if set(v) == {"$float"} and v["$float"] in _NONFINITE:
                return _NONFINITE[v["$float"]]
            raise PackError(f"reserved key in {str(v)[:80]}: only {{'$tensor': i}} and {{'$float': ...}} are known")
        return {k: _tree(x, tensors, specs, data, depth + 1) for k, x in v.items()}
    if isinstance(v, list):
        return [_tree(x, tensors, specs, data, depth + 1) for x in v]
    return v


def is_signed(raw: bytes | bytearray | memoryview) -> bool:
    """Whether ``raw`` starts like a signed (format 2) pack; says nothing about whether it is intact."""
    return bytes(raw[:8]) == MAGIC_SIGNED


def unpack(raw: bytes | bytearray | memoryview, key: SigningKey | None = None) -> Any:
    """The tree stored in ``raw``; :class:`PackError` for any bytes that are not an intact pack, and with
    ``key`` :class:`SignatureError` for a pack that is unsigned or not signed with ``key``.

    ``raw`` is not copied: from a writable buffer (a ``bytearray``, a writable ``memoryview``) the tensors of an
    aligned pack are views of it (module docstring), so the caller must not reuse it; from ``bytes`` they are
    copies."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise PackError(f"expected bytes, got {type(raw).__name__}")
    raw = memoryview(raw).cast("B") if not isinstance(raw, bytes) else raw
    return _unpack(raw, memoryview(raw), key)


def _unpack(raw: Any, view: memoryview, key: SigningKey | None) -> Any:
    """:func:`unpack` of ``raw`` (bytes, or a byte memoryview), ``view`` a memoryview of it."""
    if len(raw) < _PREFIX:
        raise PackError(f"{len(raw)} bytes: shorter than the {_PREFIX}-byte prefix (truncated or empty)")
    magic = bytes(raw[:8])
    signed = magic == MAGIC_SIGNED
    if magic != MAGIC and not signed:
        hint = " (a torch.save zip file: an older, unchecked format)" if magic[:4] == b"PK\x03\x04" else ""
        raise PackError(f"magic {magic!r} is not {MAGIC!r} or {MAGIC_SIGNED!r}: not a streamrec tensor pack{hint}")
    if key is not None and not signed:
        raise SignatureError("unsigned (container format 1), and this reader has a signing key: it reads only "
                             "packs signed with that key; give the writer the same signing_key_file")
    prefix = _PREFIX_SIGNED if signed else _PREFIX
    if len(raw) < prefix:
        raise PackError(f"{len(raw)} bytes: shorter than the {prefix}-byte prefix of a signed pack (truncated)")
    body = view[40:]
    digest = hashlib.sha256(body).hexdigest()
    if digest != raw[8:40].hex():
        raise PackError(f"sha256 {digest[:16]}... does not match the stored {raw[8:40].hex()[:16]}...: "
                        "the file is corrupt (a flipped byte, a torn or foreign write)")
    if key is not None and not key.verify(view[72:], bytes(raw[40:72])):
        raise SignatureError("its HMAC-SHA256 does not match this reader's signing key: the file was altered, or "
                             "signed with another key (the writer's signing_key_file must be the reader's)")
    (hlen,) = struct.unpack("<Q", raw[prefix - 8:prefix])
    if hlen > min(_MAX_HEADER, len(raw) - prefix):
        raise PackError(f"header length {hlen} exceeds the {len(raw) - prefix} bytes after the prefix "
                        f"(or the {_MAX_HEADER}-byte limit)")
    try:
        text = bytes(raw[prefix:prefix + hlen])
        header = json.loads(text.decode("utf-8"))
        reject_duplicate_keys(text, count_keys(header))  # json keeps the last of repeated keys silently
    except BadMessage as exc:
        raise PackError(f"header: {exc}") from None
    except UnicodeDecodeError as exc:
        raise PackError(f"header is not UTF-8 ({exc})") from None
    except (ValueError, RecursionError) as exc:
        raise PackError(f"header is not JSON ({str(exc)[:120]})") from None
    if not isinstance(header, dict) or set(header) != {"tree", "tensors"} or not isinstance(header["tensors"], list):
        raise PackError("header is not an object {tree, tensors: [...]}")
    data = view[prefix + hlen:]
    specs = header["tensors"]
    return _tree(header["tree"], [None] * len(specs), specs, data, 0)
