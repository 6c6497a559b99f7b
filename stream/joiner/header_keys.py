"""Header keys that are not UTF-8 in the faust driver's fetches: each such record a dead letter, not a crash loop.

Kafka's header keys are bytes on the wire; another producer may write any. aiokafka (0.14) decodes every key as UTF-8
while it reads a fetched record batch, and its compiled reader raises UnicodeDecodeError out of ``getmany``: faust's
Fetcher crashed the worker (exit 1), and at every restart the same fetch raised again. :func:`read_leniently` makes
the fetcher read each record batch through :class:`_Batch`: the compiled reader as before (a generator step more per
record), and where it raises, the batch read again by aiokafka's Python reader with such keys decoded with
``surrogateescape`` (the records already handed on are skipped by the fetcher, by offset). :func:`checked` then finds
those keys (they cannot be encoded back) and gives the record the ``bad_header`` :class:`BadMessage` that the
pipeline dead-letters, its headers not kept, as the kafka driver does (``stream.kafka.headers_of``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import aiokafka.consumer.fetcher as aiokafka_fetcher
from aiokafka.record.default_records import DefaultRecordBatch, _DefaultRecordBatchPy
from aiokafka.record.memory_records import _MemoryRecordsPy

from stream.errors import BadMessage
from stream.kafka import Headers, header_key_not_utf8


class _KeyBytes(bytearray):
    """A slice of a record batch whose ``decode`` keeps bytes that are not UTF-8 (as lone surrogates)."""

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:  # noqa: ARG002 - bytearray's signature
        return super().decode(encoding, "surrogateescape")


class _LenientBuffer(bytearray):
    """A record batch's bytes whose slices are :class:`_KeyBytes` (the Python reader decodes header keys from them)."""

    def __getitem__(self, i: Any) -> Any:
        got = super().__getitem__(i)
        return _KeyBytes(got) if isinstance(i, slice) else got


class _LenientBatch(_DefaultRecordBatchPy):
    """aiokafka's Python reader of a record batch, header keys that are not UTF-8 decoded with ``surrogateescape``."""

    def _maybe_uncompress(self) -> None:
        super()._maybe_uncompress()
        buffer: bytearray = self._buffer  # type: ignore[has-type]  # (aiokafka's own is not annotated)
        if not isinstance(buffer, _LenientBuffer):
            self._buffer = _LenientBuffer(buffer)


class _Batch:
    """A record batch as aiokafka's fetcher reads it (delegated), its records read again leniently where the compiled
    reader raised for a header key (module docstring)."""

    def __init__(self, batch: Any, raw: memoryview) -> None:
        self._batch, self._raw = batch, raw

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)

    def __next__(self) -> Any:  # the fetcher reads a control batch's record so
        return next(self._batch)

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self._batch
        except UnicodeDecodeError:
            yield from _LenientBatch(self._raw)


class _Records(_MemoryRecordsPy):  # type: ignore[misc]  # final to type checkers only
    """aiokafka's Python reader of a fetch response: each record batch a :class:`_Batch` (one Python call a batch)."""

    def next_batch(self, *args: Any, **kwargs: Any) -> Any:
        raw = self._next_slice
        batch = super().next_batch(*args, **kwargs)
        return _Batch(batch, raw) if isinstance(batch, DefaultRecordBatch) and raw is not None else batch


def read_leniently() -> None:
    """Make aiokafka's fetcher (every consumer of this process: the faust driver's is its only one) read record
    batches through :class:`_Batch`."""
    aiokafka_fetcher.MemoryRecords = _Records  # type: ignore[misc]


def checked(headers: Sequence[tuple[str, bytes | None]]) -> Headers | BadMessage:
    """``headers`` of a fetched record, or the ``bad_header`` :class:`BadMessage` where a key was not UTF-8."""
    try:
        for key, _ in headers:
            key.encode()
    except UnicodeEncodeError:
        return header_key_not_utf8()
    return headers
