"""Replay settings (``[replay]``, ``[synthetic]``) and the click-delay distribution replays draw from."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from stream.config import check_counts, check_durations, check_ports
from stream.errors import ConfigError

# The bounds of a click-delay distribution: a median of a year is far past any attribution window, and a lognormal's
# sigma of 5 already spreads its 99.9th percentile to e^15 (3 million) times the median. Beyond them (or NaN, inf) the
# draws overflowed the cast to milliseconds and every click came 1 ms after its impression, silently; a negative
# sigma was a traceback once the data set was loaded.
MAX_CLICK_DELAY_MEDIAN_S = 365 * 86_400.0
MAX_CLICK_DELAY_SIGMA = 5.0
# [replay] broker_wait_s: its default, and librdkafka's largest message.timeout.ms (2**31 - 1 ms, ~24.8 days)
BROKER_WAIT_S = 120.0
MAX_BROKER_WAIT_S = 2_147_483.0
# streamrec replay --resume (stream/replay/resume.py)
RESUME_HELP = ("send only the events the topics do not hold yet (found by the content, key and value, of each "
               "partition's last messages): rerun a replay stopped part way (an error, SIGTERM, SIGKILL, a broker "
               "gone) with the same data set and settings (the pace may differ). A partition whose last messages are "
               "not this run's events is exit 2; dead letters (<topic>.dlq) are sent again")


def check_click_delay(median_s: object, sigma: object, median_name: str, sigma_name: str) -> None:
    """A :class:`ConfigError` naming the setting unless the median is in [0, a year] s and sigma in [0, 5]."""
    bounds = ((median_name, median_s, MAX_CLICK_DELAY_MEDIAN_S), (sigma_name, sigma, MAX_CLICK_DELAY_SIGMA))
    for name, value, cap in bounds:
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and 0 <= value <= cap):
            raise ConfigError(f"{name} must be a finite number >= 0 and <= {cap:g}, got {value!r}")


class DelayKind(str, enum.Enum):
    FIXED = "fixed"
    EXPONENTIAL = "exponential"
    LOGNORMAL = "lognormal"


@dataclass(frozen=True)
class ClickDelay:
    """Distribution of the time from an impression to its click (event time)."""

    kind: DelayKind = DelayKind.LOGNORMAL
    median_s: float = 30.0
    # lognormal: sigma of log(delay); exponential and fixed ignore it.
    sigma: float = 1.0

    def __post_init__(self) -> None:
        check_click_delay(self.median_s, self.sigma, "the click delay's median_s", "the click delay's sigma")


@dataclass(frozen=True)
class ReplaySettings:
    dataset: str = "ml-1m"
    limit: int | None = None
    rate: float | None = None  # events per second (wall clock); None = as fast as possible
    speed: float | None = None  # event-time speed-up factor; None = as fast as possible
    seed: int = 7  # at most 2**64 - 1 (PCG64 takes any, as the learner's seed)
    click_delay_kind: DelayKind = DelayKind.LOGNORMAL
    click_delay_median_s: float = 30.0
    click_delay_sigma: float = 1.0
    linger_ms: int = 20
    # How long the replay waits for a broker that acknowledges nothing (down, unreachable, frozen) before it fails
    # (exit 1): the producer's delivery timeout (message.timeout.ms; librdkafka's default is 300 s, told by nothing)
    broker_wait_s: float = BROKER_WAIT_S
    progress: bool = True
    # Serve Prometheus /metrics (streamrec_events_total{stage="replay"}, counted as each chunk goes out) on this port
    # while the replay runs; None: none. A paced replay (rate, speed) may run for hours.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"  # loopback; 0.0.0.0 exposes it to the network

    def __post_init__(self) -> None:
        # checked here, before anything connects or creates a topic: rate and speed finite and > 0
        check_durations("replay", self, zero_ok=("click_delay_median_s",), extra=("rate", "speed"))
        check_ports("replay", self)
        check_click_delay(self.click_delay_median_s, self.click_delay_sigma, "[replay] click_delay_median_s",
                          "[replay] click_delay_sigma")
        # limit >= 0 (0: nothing; None: everything; order[:-5] would replay all but the last 5), seed >= 0 (numpy
        # refuses a negative one), linger_ms 0 (send at once) to librdkafka's 900000
        check_counts("replay", self, zero_ok=("limit", "seed", "linger_ms"), at_most={"linger_ms": 900_000,
                                                                                  "seed": 2**64 - 1})
        if not self.linger_ms < self.broker_wait_s * 1000 <= MAX_BROKER_WAIT_S * 1000:  # librdkafka's bounds
            raise ConfigError(f"[replay] broker_wait_s must be longer than linger_ms ({self.linger_ms} ms) and at "
                              f"most {MAX_BROKER_WAIT_S:g} s, got {self.broker_wait_s:g}")
        if not str(self.dataset).strip():
            raise ConfigError("[replay] dataset is empty: give ml-1m, ml-100k, synthetic or a file's path")
        if self.rate is not None and self.speed is not None:
            raise ConfigError(f"[replay] give either rate (events/s) or speed (x event time), not both: got rate="
                              f"{self.rate!r}, speed={self.speed!r}")

    @property
    def click_delay(self) -> ClickDelay:
        return ClickDelay(self.click_delay_kind, self.click_delay_median_s, self.click_delay_sigma)


# The synthetic generator's bounds (one definition: stream/replay/synthetic.py imports them). Returning users' and
# items' ids are drawn below 2**62 (brand-new users' from it on); the planted model's latent_dim is one pass over every
# impression per dimension (10**9 ran for ever); a year is the longest attribution window or new-user session.
MAX_IDS = 2**62
MAX_LATENT_DIM = 1024
MAX_SPAN_S = 365 * 86_400.0


@dataclass(frozen=True)
class SyntheticSettings:
    """A deterministic synthetic feed with a planted click model (``--dataset synthetic``)."""

    impressions: int = 200_000
    users: int = 1_000_000  # distinct-id cardinality of returning users (up to 100 M)
    items: int = 100_000
    zipf_exponent: float = 1.1
    new_user_share: float = 0.02  # share of impressions from brand-new users
    new_user_impressions: int = 5  # a brand-new user has 1..this many impressions (uniform)
    # 0: a new user's impressions are consecutive rows (a burst); > 0: spread uniformly over this many
    # seconds of event time from the user's first, interleaved with everyone else's (a session)
    new_user_session_s: float = 0.0
    impressions_per_s: float = 200.0  # event-time arrival rate
    start_ts_ms: int = 1_700_000_000_000  # at most 253,402,300,799,999 (the last ms of year 9999)
    base_ctr: float = 0.1
    latent_dim: int = 8  # at most 1,024 (MAX_LATENT_DIM)
    signal: float = 1.5  # strength of the planted user x item interaction
    attribution_window_s: float = 1800.0
    late_click_share: float = 0.02  # share of clicks arriving after the attribution window
    duplicate_click_share: float = 0.03
    orphan_click_share: float = 0.01  # clicks for impression ids that were never shown
    malformed_share: float = 0.0  # share of all messages that are extra malformed ones (valid counts stay exact)

    def __post_init__(self) -> None:
        check_durations("synthetic", self, zero_ok=("new_user_session_s",))
        # impressions, users, items, new_user_impressions, latent_dim >= 1; start_ts_ms >= 0 (the epoch); ids are
        # drawn from 62 bits; start_ts_ms within year 9999 (datetime's last), latent_dim at most MAX_LATENT_DIM
        check_counts("synthetic", self, zero_ok=("start_ts_ms",),
                     at_most={"users": MAX_IDS, "items": MAX_IDS, "start_ts_ms": 253_402_300_799_999,
                              "latent_dim": MAX_LATENT_DIM})
        # The generator's bounds (stream/replay/synthetic.py relies on them): late clicks come up to twice the window
        # after their impression (1e300 was a traceback, out of bounds for int64; 1e13 put clicks past 2100); an
        # infinite signal made every click probability 0 or 1 (NaN at a zero dot product); shares are shares
        shares = ("new_user_share", "late_click_share", "duplicate_click_share", "orphan_click_share")
        bounds = {"new_user_session_s": (0, MAX_SPAN_S, "[]"), "attribution_window_s": (0, MAX_SPAN_S, "(]"),
                  "base_ctr": (0, 1, "()"), "zipf_exponent": (0, math.inf, "[)"),
                  "signal": (-math.inf, math.inf, "()"), **{n: (0, 1, "[]") for n in shares},
                  "malformed_share": (0, 1, "[)")}
        for name, (low, high, ends) in bounds.items():
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                    and (low <= v if ends[0] == "[" else low < v) and (v <= high if ends[1] == "]" else v < high)):
                within = (f"{'>' if ends[0] == '(' else '>='} 0 and at most {high:g} (a year)" if name.endswith("_s")
                          else "a finite number" if math.isinf(low) else f"in {ends[0]}{low:g}, {high:g}{ends[1]}")
                raise ConfigError(f"[synthetic] {name} must be {within}, got {v!r}")
