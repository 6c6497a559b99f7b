"""A real Redis's error replies, classed by ``stream.strikes.is_infrastructure``: what a message carried (a key of the
wrong type, a value that is no integer, a script's error on a value) gives strikes, so the joiner isolates and
dead-letters the message instead of failing its batch forever; a Redis out of memory gives none (good data must never
be dead-lettered for it)."""

from __future__ import annotations

import re
import uuid

import pytest
import redis

from stream.errors import ConfigError
from stream.history import UserHistory
from stream.redis_client import wrong_type
from stream.strikes import RedisStrikes, Strikes, is_infrastructure
from streamrec.stack import LocalStack


def _reply(call) -> redis.RedisError:  # noqa: ANN001 - a callable
    with pytest.raises(redis.RedisError) as info:
        call()
    return info.value


def test_redis_error_replies_to_a_messages_data_give_strikes_and_out_of_memory_gives_none(
        redis_client: redis.Redis) -> None:
    prefix = f"strikes-{uuid.uuid4().hex[:8]}"
    text_key = f"{prefix}:text"
    redis_client.set(text_key, "not a number")
    try:
        for exc in [
            _reply(lambda: redis_client.lpush(text_key, "x")),  # WRONGTYPE
            _reply(lambda: redis_client.incr(text_key)),  # ERR value is not an integer or out of range
            _reply(lambda: redis_client.eval("return redis.call('incr', KEYS[1])", 1, text_key)),
            _reply(lambda: redis_client.eval("return tonumber(ARGV[1]) + 1", 0, "x")),  # a Lua error on a value
        ]:
            assert isinstance(exc, redis.ResponseError) and not is_infrastructure(exc), repr(exc)
        # The joiner's click-history write on a user whose key is not a list: the reply re-raised from the
        # script's result (stream/history.py), its text only.
        history = UserHistory(redis_client, prefix=prefix)
        redis_client.set(history.key(7), "not a list")
        exc = _reply(lambda: history.append_many([7], [1], [1000]))
        assert "WRONGTYPE" in str(exc) and not is_infrastructure(exc)
        limit = str(redis_client.config_get("maxmemory")["maxmemory"])
        redis_client.config_set("maxmemory", 1)
        try:
            exc = _reply(lambda: redis_client.set(f"{prefix}:more", "x"))
            exc_pcall = _reply(lambda: history.append_many([8], [1], [1000]))  # redis.pcall: the script's result
            exc_call = _reply(lambda: redis_client.eval("return redis.call('set', KEYS[1], 'x')", 1, f"{prefix}:k"))
        finally:
            redis_client.config_set("maxmemory", limit)
        assert isinstance(exc, redis.exceptions.OutOfMemoryError) and is_infrastructure(exc)
        assert is_infrastructure(exc_pcall) and is_infrastructure(exc_call), (str(exc_pcall), str(exc_call))
    finally:
        redis_client.delete(*redis_client.keys(f"{prefix}:*"))


def test_a_command_the_acl_denies_inside_a_script_is_infrastructure_not_the_messages_fault(
        stack: LocalStack, redis_client: redis.Redis) -> None:
    """An ACL user allowed to run scripts but not a command they call (``+@all -lpush``; ``+@read +@scripting``
    without ``+@write``): Redis 6 answers ``ERR ... The user executing the script can't run this command or
    subcommand``, with no NOPERM code, and every message was struck and then dead-lettered for the ACL's fault (all of
    them: the same call fails for each). Denied outside a script the same command is NOPERM, infrastructure already."""
    prefix = f"strikes-acl-{uuid.uuid4().hex[:8]}"
    user, password = f"{prefix}-user", uuid.uuid4().hex
    redis_client.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "+@all", "-lpush")
    limited = redis.Redis.from_url(stack.redis_url, username=user, password=password)
    try:
        history = UserHistory(limited, prefix=prefix)
        exc_pcall = _reply(lambda: history.append_many([7], [1], [1000]))  # redis.pcall: the script's result
        exc_call = _reply(lambda: limited.eval("return redis.call('lpush', KEYS[1], 'x')", 1, f"{prefix}:k"))
        exc_plain = _reply(lambda: limited.lpush(f"{prefix}:k", "x"))
        assert is_infrastructure(exc_plain), str(exc_plain)
        assert is_infrastructure(exc_pcall) and is_infrastructure(exc_call), (str(exc_pcall), str(exc_call))
    finally:
        limited.close()
        redis_client.execute_command("ACL", "DELUSER", user)
        if keys := redis_client.keys(f"{prefix}:*"):
            redis_client.delete(*keys)


def test_a_history_read_the_acl_denies_fails_as_infrastructure_not_as_empty_histories(
        stack: LocalStack, redis_client: redis.Redis) -> None:
    """The history read's script turned every error of its LRANGE into one malformed entry, meant for a key of the
    wrong type: under an ACL denying LRANGE (``+@write +@scripting`` without ``+@read``) every user read as having no
    history, and the joiner emitted every sample without its history feature, counted only as malformed entries. A key
    of the wrong type still reads as malformed (no history, the others' histories read)."""
    prefix = f"strikes-acl-{uuid.uuid4().hex[:8]}"
    user, password = f"{prefix}-user", uuid.uuid4().hex
    redis_client.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "+@all", "-lrange")
    limited = redis.Redis.from_url(stack.redis_url, username=user, password=password)
    try:
        UserHistory(redis_client, prefix=prefix).append_many([7], [11], [1000])
        redis_client.set(UserHistory(redis_client, prefix=prefix).key(8), "not a list")
        assert UserHistory(redis_client, prefix=prefix).as_of([7, 8], [2000, 2000]) == [[11], []]
        exc = _reply(lambda: UserHistory(limited, prefix=prefix).as_of([7, 8], [2000, 2000]))
        assert isinstance(exc, redis.ResponseError) and is_infrastructure(exc), str(exc)
    finally:
        limited.close()
        redis_client.execute_command("ACL", "DELUSER", user)
        if keys := redis_client.keys(f"{prefix}:*"):
            redis_client.delete(*keys)


def test_a_strikes_key_of_another_redis_type_refuses_the_start_naming_the_key_and_the_fix(
        redis_client: redis.Redis) -> None:
    # an operator's SET, an older tool: Strikes() raised a bare WRONGTYPE at every start; starting without strikes
    # instead would let a poison message stop the joiner at every restart (its strikes cannot be written)
    key = f"strikes-{uuid.uuid4().hex[:10]}:strikes:app"
    redis_client.set(key, "not a hash")
    try:
        with pytest.raises(ConfigError, match=rf"WRONGTYPE.*redis-cli DEL {re.escape(key)}"):
            Strikes(RedisStrikes(redis_client, key))
    finally:
        redis_client.delete(key)


def test_a_stored_strike_count_below_one_is_no_strike(redis_client: redis.Redis) -> None:
    # a count of -100 another client wrote let the message fail its batch 100 more times before it was isolated
    key = f"strikes-{uuid.uuid4().hex[:10]}:strikes:app"
    redis_client.hset(key, mapping={"t:0:5": "-100 boom", "t:0:6": "0 boom", "t:0:7": "2 boom"})
    try:
        assert Strikes(RedisStrikes(redis_client, key)).counts == {("t", 0, 7): (2, "boom")}
    finally:
        redis_client.delete(key)


def test_wrong_type_knows_a_real_wrongtype_raised_alone_raised_from_a_pipeline_and_returned_in_its_replies(
        redis_client: redis.Redis) -> None:
    # one definition for the readers of a key of another type in Python (strikes, keyspace markers, layered rows)
    key = f"wt-{uuid.uuid4().hex[:10]}"
    redis_client.set(key, "a string")
    try:
        with pytest.raises(redis.ResponseError) as alone:
            redis_client.hgetall(key)
        pipe = redis_client.pipeline(transaction=False)
        pipe.lpush(key, 1)
        with pytest.raises(redis.ResponseError) as piped:
            pipe.execute()
        assert "caused error" in str(piped.value)  # redis-py's preamble before the code
        pipe = redis_client.pipeline(transaction=False)
        pipe.hget(key, "f")
        pipe.incr(key)  # ERR value is not an integer: a refusal, but not of the key's type
        returned, other = pipe.execute(raise_on_error=False)
        with pytest.raises(redis.ResponseError) as scripted:  # a script's call: "@user_script:1: WRONGTYPE ..."
            redis_client.eval("return redis.call('LPUSH', KEYS[1], 1)", 1, key)
        assert [wrong_type(e) for e in (alone.value, piped.value, returned, scripted.value, other)] == [
            True, True, True, True, False]
    finally:
        redis_client.delete(key)
