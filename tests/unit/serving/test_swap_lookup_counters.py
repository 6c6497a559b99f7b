"""The lookup counters (``streamrec_serving_embedding_lookups_total{tier}``, ``streamrec_serving_id_lookups_total{field,
row}`` and the hot-cache hit rate made of the first) across an artifact swap (serving/swap.py ``_maybe_swap``,
serving/metrics.py ``_LookupCollector``): complete, since requests still running on the old model count, and
monotonic, since a scrape in the middle of a swap reading less than the one before is a counter reset to Prometheus
(a false spike in ``rate()``). Real artifacts, the real updater; the scrape in the middle is forced by hooks."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import torch
from prometheus_client.parser import text_string_to_metric_families

from cache_refresh.publish import publish
from serving.metrics import ServingMetrics
from serving.request import parse_request
from serving.swap import LiveModel, ModelHolder, ModelUpdater
from tests.unit.serving.test_unknown_ids import trained_artifact

REQUEST = {"user_id": "alice", "items": [1, 2, 3]}
COUNTERS = ("streamrec_serving_embedding_lookups_total", "streamrec_serving_id_lookups_total")


def lookup_totals(metrics: ServingMetrics) -> dict[tuple[str, ...], float]:
    """What a scrape of /metrics reads of the lookup counters: (sample name, *label values) -> value."""
    return {(s.name, *s.labels.values()): s.value
            for fam in text_string_to_metric_families(metrics.render().decode())
            for s in fam.samples if s.name in COUNTERS}


def score_on(live: LiveModel) -> None:
    """What a request that read ``live`` does (serving/app.py ``_run``): ids mapped to rows, the rows read."""
    values, offsets, dense = live.encoder.encode(parse_request(REQUEST, max_candidates=10), [])
    live.model.score_request(torch.from_numpy(values), torch.from_numpy(offsets), torch.from_numpy(dense))


class ScrapedHolder(ModelHolder):
    """A holder whose ``on_swap`` runs as a new model is assigned, before the assignment: a scrape at that moment."""

    on_swap: Any = None

    @property  # type: ignore[override]
    def live(self) -> LiveModel | None:
        return self._live

    @live.setter
    def live(self, new: LiveModel | None) -> None:
        if self.on_swap is not None:
            self.on_swap()
        self._live = new


def publish_next(root: Path) -> None:
    """Publish a new version (users 0..39 and items 0..29 admitted, the other ids on their hash buckets)."""
    publish(root, trained_artifact(root), keep=30)


def serving(root: Path) -> tuple[ScrapedHolder, ServingMetrics, ModelUpdater]:
    publish_next(root)
    holder = ScrapedHolder()
    metrics = ServingMetrics(holder.model)
    updater = ModelUpdater(holder, metrics, root, None, device="cpu")
    updater.check_now()
    return holder, metrics, updater


def test_a_scrape_in_the_middle_of_a_swap_never_reads_a_lookup_counter_lower_than_the_scrape_before(
        tmp_path: Path) -> None:
    """The swap assigned the new model and then retired the old one: a scrape between the two found the old model's
    counts neither live nor retired, and every lookup counter dropped to the new model's zero."""
    holder, metrics, updater = serving(tmp_path)
    old = holder.live
    assert old is not None
    for _ in range(3):
        score_on(old)
    scrapes = [lookup_totals(metrics)]
    holder.on_swap = lambda: scrapes.append(lookup_totals(metrics))  # as the new model is assigned
    retire = metrics.lookups.retire

    def scrape_then_retire(model: Any) -> None:  # as the old model is retired
        scrapes.append(lookup_totals(metrics))
        retire(model)

    metrics.lookups.retire = scrape_then_retire  # type: ignore[method-assign]
    publish_next(tmp_path)
    updater.check_now()
    scrapes.append(lookup_totals(metrics))
    assert holder.live is not None and holder.live is not old and len(scrapes) == 4
    assert scrapes[0][("streamrec_serving_embedding_lookups_total", "hot")] > 0
    for before, after in zip(scrapes, scrapes[1:], strict=False):
        assert all(after.get(key, 0.0) >= n for key, n in before.items()), (before, after)
    assert scrapes[-1] == scrapes[0]  # no lookup since: every count kept, none counted twice


def test_lookups_made_on_the_old_model_after_the_swap_are_counted(tmp_path: Path) -> None:
    """A request that read ``holder.live`` before the swap finishes on the old model after it: its lookups went to
    the retired model's counts after they were summed into the retired totals, and were never read."""
    holder, metrics, updater = serving(tmp_path)
    old = holder.live
    assert old is not None
    score_on(old)
    publish_next(tmp_path)
    updater.check_now()
    assert holder.live is not None and holder.live is not old
    before, (hot, cold, ids) = lookup_totals(metrics), (old.model.hot_lookups, old.model.cold_lookups,
                                                        old.model.id_lookups)
    score_on(old)  # in flight across the swap
    after = lookup_totals(metrics)
    made = {("streamrec_serving_embedding_lookups_total", "hot"): old.model.hot_lookups - hot,
            ("streamrec_serving_embedding_lookups_total", "cold"): old.model.cold_lookups - cold}
    made.update({("streamrec_serving_id_lookups_total", *key): n - ids.get(key, 0)
                 for key, n in old.model.id_lookups.items()})
    assert made[("streamrec_serving_embedding_lookups_total", "hot")] > 0
    assert made[("streamrec_serving_id_lookups_total", "user_id", "bucket")] == 1  # alice is unknown to the maps
    assert {key: after[key] - before.get(key, 0.0) for key in after} == {key: made.get(key, 0) for key in after}


def test_a_freed_models_lookups_stay_counted_once_over_later_swaps(tmp_path: Path) -> None:
    """The collector keeps a retired model's counts, not the model: the model is freed, and its counts (folded with
    the other freed models' at the next swap) are neither lost nor counted twice."""
    holder, metrics, updater = serving(tmp_path)
    assert holder.live is not None
    score_on(holder.live)
    first = weakref.ref(holder.live.model)
    counted = lookup_totals(metrics)
    publish_next(tmp_path)
    updater.check_now()
    second = holder.live.model
    gc.collect()
    assert first() is None, "the retired model is still referenced"
    publish_next(tmp_path)
    updater.check_now()  # retires the second model: the first one's counts are folded
    assert holder.live is not None and holder.live.model is not second
    assert lookup_totals(metrics) == counted
    score_on(holder.live)
    hot = ("streamrec_serving_embedding_lookups_total", "hot")
    assert lookup_totals(metrics)[hot] == counted[hot] + holder.live.model.hot_lookups > counted[hot]
