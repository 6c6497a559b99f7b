"""The monitor over a torchrun job: every rank's /metrics is a source, and each exports its own samples, lag and
memory under the same names. The ranks label their series with their rank (learner.distributed.metrics_registry), so
the monitor keeps them apart (it reads the first source of a series exported twice), and the default rules read the
job's sums or each rank's series: a rank that stops counting, or blows up its memory, is seen."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, generate_latest

from learner.distributed import RankContext, RankLabelled, metrics_registry
from monitor.rule_engine import RuleEngine
from monitor.rules import load_rules
from monitor.scrape import Snapshot


class Rank:
    """One rank's metrics, as its process's registry holds them, served as its /metrics serves them."""

    def __init__(self, rank: int) -> None:
        self.registry = CollectorRegistry()
        self.samples = Counter("streamrec_learner_samples_total", "Samples trained.", registry=self.registry)
        self.lag = Gauge("streamrec_learner_lag_samples", "Lag.", ["partition"], registry=self.registry)
        self.growth = Gauge("streamrec_learner_memory_growth_bytes_per_hour", "Growth.", ["memory"],
                            registry=self.registry)
        self.exported = RankLabelled(rank, self.registry)

    def text(self) -> str:
        return generate_latest(self.exported).decode()  # type: ignore[arg-type]


def snapshot(ranks: list[Rank]) -> Snapshot:
    return Snapshot.from_texts({f"learner{i}": r.text() for i, r in enumerate(ranks)})


def evaluate(rule: str, ranks: list[Rank], advance: list[tuple[int, float]]) -> list[str]:
    """The default rule ``rule`` over ``ranks`` scraped every 60 s for 40 minutes, rank i's samples counter advanced
    by n per scrape for each (i, n) of ``advance``: the states of its series at the end, by label set."""
    config = load_rules()
    chosen = [r for r in config.rules if r.name == rule]
    engine = RuleEngine(chosen, config.history_s)
    for t in range(0, 2400, 60):
        for i, n in advance:
            ranks[i].samples.inc(n)
        engine.evaluate(snapshot(ranks), float(t))
    return [f"{dict(lb)}: {st.state.value}" for lb, st in sorted(engine.states[rule].items())]


def test_trains_nothing_does_not_fire_while_another_rank_trains() -> None:
    """Rank 0's samples counter stands still (its partitions drained) while rank 1 trains with input waiting: the
    job trains, and learner_trains_nothing (the sum over the ranks) holds not. Read as one series, the first rank's
    alone, it fired."""
    ranks = [Rank(0), Rank(1)]
    ranks[0].lag.labels("0").set(0)
    ranks[1].lag.labels("1").set(200)
    assert evaluate("learner_trains_nothing", ranks, [(1, 100)]) == ["{}: inactive"]


def test_trains_nothing_fires_when_no_rank_trains() -> None:
    ranks = [Rank(0), Rank(1)]
    ranks[1].lag.labels("1").set(200)
    assert evaluate("learner_trains_nothing", ranks, []) == ["{}: firing"]


def test_memory_growth_of_one_rank_fires_for_that_rank() -> None:
    """Rank 1's memory grows, rank 0's not: the alert fires for rank 1, named (it read rank 0's only, and stayed
    silent)."""
    ranks = [Rank(0), Rank(1)]
    ranks[0].growth.labels("rss").set(0)
    ranks[1].growth.labels("rss").set(2 ** 31)
    assert evaluate("memory_growth", ranks, []) == ["{'memory': 'rss', 'rank': '0'}: inactive",
                                                    "{'memory': 'rss', 'rank': '1'}: firing"]


def test_rank_label_only_under_torchrun() -> None:
    """One process keeps its series unlabelled (its rules' series and its alerts' fingerprints as they were)."""
    assert metrics_registry(RankContext()) is REGISTRY
    texts = [generate_latest(metrics_registry(RankContext(rank=r, world_size=2))).decode() for r in (0, 1)]
    assert all(f'rank="{r}"' in t for r, t in zip((0, 1), texts, strict=True))
