"""stream/redis_client.py: ``PlainPacker`` packs what redis-py's own packer packs, byte for byte, and hands anything
it does not pack alike (floats, memoryviews, bools, a first argument with a space) to redis-py's packer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis._parsers.encoders import Encoder
from redis.connection import HiredisRespSerializer, PythonRespSerializer
from redis.exceptions import DataError

from stream.config import RedisSettings
from stream.redis_client import PlainPacker, connect, plain_packer

ARGS = st.one_of(st.text(max_size=12), st.integers(-(2**80), 2**80), st.binary(max_size=12))
NAMES = st.sampled_from(["EVALSHA", "ZINCRBY", "GET", "SET", "HSETNX"])


def redis_py_packer() -> HiredisRespSerializer:
    """What redis-py builds for a connection with hiredis and the default encoding
    (``Connection._construct_command_packer``)."""
    encode = Encoder("utf-8", "strict", False).encode
    return HiredisRespSerializer(PythonRespSerializer(6000, encode).pack, encode)


def packed_or_error(packer, args: tuple) -> tuple[str, object]:
    try:
        return "packed", b"".join(packer.pack(*args))
    except Exception as exc:  # noqa: BLE001 - the two must fail alike too
        return "error", type(exc)


@settings(max_examples=400, deadline=None)
@given(NAMES, st.lists(ARGS, max_size=8))
def test_plain_commands_pack_to_redis_pys_bytes(name: str, args: list) -> None:
    command = (name, *args)
    assert packed_or_error(PlainPacker(), command) == packed_or_error(redis_py_packer(), command)


@pytest.mark.parametrize("command", [
    ("SET", "k", 1.5),  # a float: redis-py's repr
    ("SET", "k", -0.0),
    ("SET", memoryview(b"k"), b"v"),
    ("CLIENT SETNAME", "joiner"),  # redis-py splits a first argument with a space
    (b"CLIENT SETNAME", "joiner"),
    ("SET", "k", "\udc80"),  # a lone surrogate: the same UnicodeEncodeError
])
def test_what_hiredis_would_pack_otherwise_goes_to_redis_pys_packer(command: tuple) -> None:
    assert packed_or_error(PlainPacker(), command) == packed_or_error(redis_py_packer(), command)


@pytest.mark.parametrize("command", [
    ("GET\t", "k"),  # redis-py splits the first argument at any ASCII whitespace (bytes.split()), not only a space
    ("CLIENT\tSETNAME", "joiner"),
    ("CLIENT\nSETNAME", "joiner"),
    ("GET\x0b", "k"),
    ("", "k"),  # and drops an empty one: hiredis sent it as an empty command name
])
def test_a_first_argument_redis_py_splits_or_drops_packs_as_redis_py_packs_it(command: tuple) -> None:
    assert packed_or_error(PlainPacker(), command) == packed_or_error(redis_py_packer(), command)


def test_a_bool_is_refused_as_redis_py_refuses_it() -> None:
    with pytest.raises(DataError, match="bool"):
        PlainPacker().pack("SET", "k", True)


def test_the_plain_packer_is_set_only_for_hiredis_encoding_and_never_over_another_packer() -> None:
    for kwargs in ({}, {"encoding": "utf-8"}, {"encoding": "UTF8", "encoding_errors": "strict"}):
        plain_packer(kwargs)
        assert isinstance(kwargs["command_packer"], PlainPacker)
    for kwargs in ({"encoding": "latin-1"}, {"encoding_errors": "replace"}, {"command_packer": "theirs"}):
        before = dict(kwargs)
        plain_packer(kwargs)
        assert kwargs == before


def test_a_single_node_client_from_connect_packs_with_the_plain_packer() -> None:
    client = connect(RedisSettings(url="redis://127.0.0.1:6399/0"))
    try:
        conn = client.connection_pool.make_connection()
        assert isinstance(conn._command_packer, PlainPacker)
        assert conn.pack_command("SET", "k", 1) == redis_py_packer().pack("SET", "k", 1)
    finally:
        client.close()
