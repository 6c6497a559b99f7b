"""The layered deployment's rows in Redis (``serving/stored_versions.py``) that a refresh cleans up, best effort: the
rows of a write that failed, of versions killed runs began to write, of a version a run wrote and did not publish,
and of versions the publish root no longer holds (pruned), never those of the live version. The write itself is the
run's ``embedding_store`` stage (``cache_refresh/job.py`` ``_store_rows``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import redis

from cache_refresh.redis_client import _redis
from cache_refresh.settings import RefreshSettings
from learner import artifact_versions
from serving import row_codec, stored_versions
from stream.config import RedisSettings

log = logging.getLogger("streamrec.refresh")


def _may_be_live(root: Path, version: str) -> bool:
    """Whether ``CURRENT`` names ``version``, or cannot be read (not known): a failed run then keeps the version's
    embedding-store rows. publish() raises nothing once ``CURRENT`` names its version, but a run's failure path must
    never delete what the live version needs on the word of an exception alone: rows kept for a version that is not
    live are deleted by the next publish (:func:`_prune_stored`: the version is not in the publish root)."""
    try:
        live = artifact_versions.current_version(root) == version
    except artifact_versions.ArtifactError as exc:
        log.warning("refresh: %s; the rows of %s are kept in the embedding store (the next publish deletes them if "
                    "it is not live)", exc, version)
        return True
    if live:
        log.error("refresh: the run failed, but CURRENT names %s: it is live, and its embedding store rows are "
                  "kept", version)
    return live


def _owner(rs: RefreshSettings) -> str:
    """Who wrote a version's rows: this publish root (a refresh prunes only its own versions' rows)."""
    return str(Path(rs.publish_root).resolve())


def _may_hold(client: Any, rds: RedisSettings, version: str, exc: BaseException) -> bool:
    """Whether Redis may hold keys of ``version`` after its write raised ``exc``. After a Redis error reply (OOM at
    maxmemory, NOPERM) every command sent before it was applied, and no row is written before the writer marker: no
    marker, nothing of it. Else (the connection lost, a timeout, any other error), or not known: it may."""
    try:
        return not isinstance(exc, redis.ResponseError) or bool(
            client.exists(row_codec.writer_key(rds.prefix, version)))
    except Exception:  # noqa: BLE001 - not known: the delete decides
        return True


def _cleanup_failed(message: str, on_error: Callable[[str], None] | None) -> None:
    """A best-effort Redis cleanup's error: logged, and given to ``on_error`` (the run's ``RunProgress.saw``: these
    steps and the ones after them wait up to redis_timeout_s a command on that Redis, and a run a stop abandoned
    there said "last error it saw: none"). None in a failed run's cleanup: its failure stays what it saw."""
    log.warning("%s", message)
    if on_error is not None:
        on_error(message)


def _delete_unfinished(client: Any, rds: RedisSettings, version: str, why: str = "whose write failed",
                       on_error: Callable[[str], None] | None = None) -> None:
    """Best effort: delete the rows a failed write left. Rows without ``meta`` are never served, and never pruned
    either (pruning finds a version by its meta), so without this each failed run would leak a table into Redis."""
    try:
        n = stored_versions.delete_version(client, rds.prefix, version)
        log.info("refresh: deleted %d embedding store keys of %s, %s", n, version, why)
    except Exception as exc:  # noqa: BLE001 - Redis is failing anyway: say what is left behind
        _cleanup_failed(f"refresh: could not delete the rows of {version}, {why} ({exc}); delete the keys "
                        f"{row_codec.version_prefix(rds.prefix, version)}* by hand (they are never served)",
                        on_error)


def _delete_abandoned(client: Any, rds: RedisSettings, owner: str, on_error: Callable[[str], None] | None = None,
                      between: Callable[[], object] = lambda: None, published: frozenset[str] | set[str] = frozenset(),
                      ) -> None:
    """Best effort, before this run writes its rows: delete the rows of this publish root's versions that a killed run
    began to write and never finished (``stored_versions.unfinished_versions``: a writer marker, no meta). Their
    writer is gone: this run holds the publish root's lock, so no other refresh of this root is writing. Without this
    they stayed in Redis for ever (no meta, so pruning never found them), a table per killed run. ``between`` (the
    run's stop check) after each version's delete, which stays whole: a stop ends the cleanup between versions.
    ``published``: the versions the publish root holds, never deleted here: a marker and no meta there is a published
    version whose meta Redis evicted (read once, at load: allkeys-lru evicts it first), which rankers may serve; once
    its files are pruned it is deleted here like any other."""
    try:
        for version in sorted(stored_versions.unfinished_versions(client, rds.prefix, owner) - published):
            _delete_unfinished(client, rds, version, "a killed refresh began to write and never finished", on_error)
            between()
    except Exception as exc:  # noqa: BLE001 - not this run's rows: nothing here may fail it
        _cleanup_failed(f"refresh: could not look for rows killed refreshes left in the embedding store ({exc}); the "
                        "next layered run looks again", on_error)


def _discard_stored(rs: RefreshSettings, rds: RedisSettings, version: str, why: str,
                    on_error: Callable[[str], None] | None = None) -> None:
    """Best effort: delete the rows this run wrote for ``version`` when it did not publish it (a scheduled run held by
    a rollback pin, a publish that failed). No ranker ever loads such a version; its rows were otherwise left in
    Redis, a whole table each night a pin lasted, until a later run published and pruned them."""
    try:
        client = _redis(rds, rs)
    except Exception as exc:  # noqa: BLE001 - nothing here may mask the run's own outcome
        _cleanup_failed(f"refresh: could not delete the rows of {version}, {why} ({exc}); the next publish prunes "
                        "them", on_error)
        return
    try:
        _delete_unfinished(client, rds, version, why, on_error)
    finally:
        client.close()


def _prune_stored(rs: RefreshSettings, rds: RedisSettings, root: Path, previous: str | None,
                  on_error: Callable[[str], None] | None = None, served: Collection[str] = ()) -> None:
    """Delete the embedding store's rows of this publish root's versions that it no longer holds (pruned; best
    effort: logged). Versions another publish root wrote under the same prefix are left alone.

    ``previous`` (the version CURRENT named before this publish) keeps its rows even when ``keep_versions``
    pruned its files: rankers serve it until they have loaded the new version, and a ranker whose rows were
    deleted under it would serve hash-bucket fallbacks (and fire ``embedding_store_errors``) meanwhile. The
    next refresh deletes them. ``served`` (the versions live scoring processes serve, ``job._served``) keep their
    rows too. ``on_error``: its error (:func:`_cleanup_failed`)."""
    try:
        client = _redis(rds, rs)
        try:
            keep = set(artifact_versions.list_versions(root)) | ({previous} if previous else set()) | set(served)
            for version in sorted(stored_versions.version_names(client, rds.prefix, owner=_owner(rs)) - keep):
                n = stored_versions.delete_version(client, rds.prefix, version)
                log.info("refresh: deleted %d embedding store keys of pruned version %s", n, version)
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 - published already: nothing here may fail the run
        _cleanup_failed(f"refresh: could not delete pruned versions' rows from the embedding store ({exc}); the "
                        "next refresh tries again", on_error)
