"""Which failures give a message strikes (``stream.strikes.is_infrastructure``): a Redis error reply to what the
message carried is the message's fault, one that says what state the server is in is the infrastructure's.

The errors are made as redis-py makes them from the wire (``BaseParser.parse_error`` of the reply's text), so each
has the class and ``status_code`` a real reply gets."""

from __future__ import annotations

import pytest
import redis
from redis._parsers.base import BaseParser

from stream.strikes import is_infrastructure

SERVER_STATE = [
    "OOM command not allowed when used memory > 'maxmemory'.",
    "READONLY You can't write against a read only replica.",
    "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
    "LOADING Redis is loading the dataset in memory",
    "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
    "NOREPLICAS Not enough good replicas to write.",
    "CLUSTERDOWN The cluster is down",
    "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "TRYAGAIN Multiple keys request during rehashing of slot",
    "MOVED 3999 127.0.0.1:6381",
    "ASK 3999 127.0.0.1:6381",
    "NOSCRIPT No matching script. Please use EVAL.",
    "NOPERM this user has no permissions to run the 'evalsha' command",
    # Redis 6: a command a script called, inside the script's error
    "ERR Error running script (call to f_0123): @user_script:1: @user_script: 1: -READONLY You can't write against "
    "a read only replica.",
    "@user_script: 1: -OOM command not allowed when used memory > 'maxmemory'.",
    "ERR Error running script (call to f_aa19): @user_script:1: READONLY You can't write against a read only replica.",
    "Command # 1 (EVAL return redis.call('set', KEYS[1], 'x') 1 k) of pipeline caused error: Error running script "
    "(call to f_ee5b): @user_script:1: @user_script: 1: -OOM command not allowed when used memory > 'maxmemory'.",
]

MESSAGE_DATA = [
    "WRONGTYPE Operation against a key holding the wrong kind of value",
    "ERR value is not an integer or out of range",
    "ERR increment or decrement would overflow",
    "ERR Error running script (call to f_0123): @user_script:1: user_script:1: attempt to compare nil with number",
    "ERR user_script:3: Script attempted to access nonexistent global variable 'x' script: 0123, on @user_script:3.",
    "CROSSSLOT Keys in request don't hash to the same slot",
    "EXECABORT Transaction discarded because of previous errors.",
    "ERR Error running script (call to f_0123): @user_script:1: @user_script: 1: -WRONGTYPE Operation against a key "
    "holding the wrong kind of value",
    "ERR Error running script (call to f_aa19): @user_script:1: WRONGTYPE Operation against a key holding the wrong "
    "kind of value",
]


@pytest.mark.parametrize("reply", SERVER_STATE)
def test_a_redis_reply_that_is_the_servers_state_gives_no_strike(reply: str) -> None:
    exc = BaseParser.parse_error(reply)
    assert isinstance(exc, redis.RedisError)  # a ResponseError but LOADING's (redis-py: a ConnectionError)
    assert is_infrastructure(exc)
    assert is_infrastructure(redis.ResponseError(reply))  # the reply's text only (re-raised from a script's result)


@pytest.mark.parametrize("reply", MESSAGE_DATA)
def test_a_redis_reply_to_what_the_message_carried_gives_strikes(reply: str) -> None:
    exc = BaseParser.parse_error(reply)
    assert isinstance(exc, redis.ResponseError)
    assert not is_infrastructure(exc)
    assert not is_infrastructure(redis.ResponseError(reply))


def test_a_value_redis_py_cannot_encode_gives_strikes_and_an_unreachable_redis_none() -> None:
    assert not is_infrastructure(redis.DataError("Invalid input of type: 'NoneType'."))
    assert is_infrastructure(redis.ConnectionError("Error 111 connecting to localhost:6379. Connection refused."))
    assert is_infrastructure(redis.TimeoutError("Timeout reading from socket"))
    assert is_infrastructure(BaseParser.parse_error("ERR max number of clients reached"))
    assert is_infrastructure(BaseParser.parse_error("WRONGPASS invalid username-password pair"))


def test_a_redis_failure_line_is_judged_by_the_error_it_wraps() -> None:
    # stream.redis_client.failure() wraps a Redis error in one line (the learner's delta notify raises it): an outage
    # behind it is the infrastructure's, a refused value the message's, refused credentials a setting's (no strikes)
    from stream.config import RedisSettings
    from stream.redis_client import failure

    def wrapped(exc: BaseException) -> BaseException:
        try:
            raise failure(exc, RedisSettings()) from exc
        except Exception as out:  # noqa: BLE001 - the wrapped error, with its __cause__ as raised
            return out

    assert is_infrastructure(wrapped(redis.ConnectionError("Connection refused")))
    assert is_infrastructure(wrapped(redis.TimeoutError("Timeout reading from socket")))
    assert is_infrastructure(wrapped(redis.AuthenticationError("invalid username-password pair")))
    assert not is_infrastructure(wrapped(BaseParser.parse_error(
        "WRONGTYPE Operation against a key holding the wrong kind of value")))
