"""stream.redis_client.verify's scripting probe (SCRIPT LOAD, EVALSHA) asks the ACL, and nothing else."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from redis.exceptions import NoPermissionError, NoScriptError

from stream.config import RedisSettings
from stream.redis_client import RedisAuthError, verify


class ScriptCacheFlushedAfterLoad:
    """A single node whose script cache is flushed between a SCRIPT LOAD and the EVALSHA after it (an operator's
    SCRIPT FLUSH, a failover to a replica that never loaded it): that EVALSHA answers NOSCRIPT; ``denied`` commands
    answer NOPERM, as an ACL does."""

    def __init__(self, denied: frozenset[str] = frozenset()) -> None:
        self.denied = denied
        self.calls: list[str] = []

    def ping(self) -> bool:
        return True

    def script_load(self, script: str) -> Any:
        return self.execute_command("SCRIPT LOAD", script)

    def evalsha(self, sha: str, numkeys: int, *args: Any) -> Any:
        return self.execute_command("EVALSHA", sha, numkeys, *args)

    def execute_command(self, name: str, *args: Any) -> Any:
        self.calls.append(name)
        if name in self.denied:
            raise NoPermissionError(f"this user has no permissions to run the '{name.split()[0].lower()}' command")
        if name == "SCRIPT LOAD":
            return hashlib.sha1(str(args[0]).encode()).hexdigest()
        raise NoScriptError("No matching script. Please use EVAL.")


def test_the_start_check_passes_when_the_script_cache_is_flushed_between_its_load_and_its_call() -> None:
    # NOSCRIPT answered the probe's EVALSHA: verify raised it as a RedisFailure ("cannot be reached": the joiner's
    # start refused) though Redis had let the user load and call scripts, all the probe asks
    client = ScriptCacheFlushedAfterLoad()
    assert verify(client, RedisSettings(url="redis://127.0.0.1:1/0")) is True
    assert client.calls == ["SCRIPT LOAD", "EVALSHA"]


@pytest.mark.parametrize("denied", ["SCRIPT LOAD", "EVALSHA"])
def test_the_start_check_still_refuses_a_user_the_acl_denies_either_script_command(denied: str) -> None:
    with pytest.raises(RedisAuthError, match=r"\+@scripting"):
        verify(ScriptCacheFlushedAfterLoad(frozenset({denied})), RedisSettings(url="redis://127.0.0.1:1/0"))
