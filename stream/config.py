"""How every stage talks to Kafka and Redis: the two configs shared across the pipeline.

Frozen dataclasses with the embedded defaults (a local stack on loopback); ``streamrec/settings.py``
fills them from a file, the environment and flags at the process edge, and nothing below reads
``os.environ``."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, TypeVar

from stream.errors import ConfigError

C = TypeVar("C", bound="Choice")


class Choice(str, enum.Enum):
    """A setting with a fixed set of values (a driver, a device, a format): a ``str`` that prints as its value.

    Settings dataclasses call :meth:`of` in ``__post_init__``, so a wrong value is a :class:`ConfigError`
    where the dataclass is built (file, environment, flag or code) and everything below compares members.
    Stored state (checkpoints, manifests) keeps the plain ``.value``.
    """

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def of(cls: type[C], value: Any, setting: str) -> C:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"{setting}: got {value!r}, expected one of {', '.join(m.value for m in cls)}") from None


@dataclass(frozen=True)
class KafkaSettings:
    """How every streamrec process talks to Kafka (or the local Kafka-protocol broker)."""

    bootstrap_servers: str = "127.0.0.1:19092"
    # The local Tansu broker takes about half the session timeout to complete a group join, so the
    # local default is short. Real Kafka deployments may raise it (compose/ uses 10000).
    session_timeout_ms: int = 6000
    impressions_topic: str = "impressions"
    clicks_topic: str = "clicks"
    samples_topic: str = "samples"
    dlq_suffix: str = ".dlq"
    partitions: int = 4
    replication_factor: int = 1
    client_id: str = "streamrec"

    def dlq_topic(self, topic: str) -> str:
        return topic + self.dlq_suffix


@dataclass(frozen=True)
class RedisSettings:
    url: str = "redis://127.0.0.1:16379/0"
    prefix: str = "streamrec"  # every key streamrec writes starts with this
    counts_ttl_days: int = 8  # per-day count keys live this long
    history_len: int = 50  # recent clicked items kept per user

    # The pub/sub channels, named from the prefix here only: the writer and the reader of a channel must
    # agree, whatever prefix a deployment uses.
    @property
    def artifact_channel(self) -> str:
        """The refresh PUBLISHes each new artifact version here; serving subscribes."""
        return f"{self.prefix}:model-updates"

    @property
    def deltas_channel(self) -> str:
        """The learner PUBLISHes each new delta's seq here; serving subscribes."""
        return f"{self.prefix}:model-deltas"
