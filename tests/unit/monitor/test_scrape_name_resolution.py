"""A round of scrapes ends at its deadline even where a fetch is stuck resolving its source's host name (the one
step of a fetch its deadline does not reach: the resolver's own timeouts, tens of seconds with a DNS server that
does not answer): ``Scraper.scrape`` waited for every fetch's thread, so one such source held the round, and the
monitor's every rule, past ``scrape_timeout_s``. Now that source is a failed scrape and its thread ends alone."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest

from monitor.scrape import Scraper

RESOLVER_GIVES_UP_S = 30.0  # the stuck resolver's own limit: only so that, unfixed, this test ends


def test_a_source_whose_name_does_not_resolve_in_time_fails_the_round_at_its_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    release, gave_up = threading.Event(), threading.Event()
    real = socket.getaddrinfo

    def stuck_resolver(host: Any, *args: Any, **kw: Any) -> Any:
        if host != "stuck.invalid":
            return real(host, *args, **kw)
        if not release.wait(RESOLVER_GIVES_UP_S):
            gave_up.set()
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", stuck_resolver)
    try:
        snap = Scraper({"stuck": "http://stuck.invalid:9100/metrics"}, timeout_s=0.2).scrape()
        assert not gave_up.is_set(), "the round waited for the resolver, past its deadline"
        assert "no answer within scrape_timeout_s=0.2s" in snap.errors["stuck"]
    finally:
        release.set()
