"""Measuring a link to a real pool agent: the first measurement of a link takes one ping and one
download that are not recorded (the first opens the connection inside its timing, the first
download runs cold), then one of each that is; later measurements record every call. Counts
only: no speed is asserted."""

from __future__ import annotations

import signal
from pathlib import Path

from kvctl.remote.agent_source import AgentSource
from kvctl.remote.federation import POOL_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import LinkEstimator
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from tests.functional.agents import running_agent
from tests.functional.waiting import wait_until


def test_a_links_first_measurement_warms_it_up_unrecorded(tmp_path: Path) -> None:
    with running_agent(tmp_path / "pool", "--role", "pool", "--cpu", "64MiB", "--disk", "0") as a:
        pool = Source("pool", POOL_TIER, AgentSource(a.state.data_tcp or ""), LinkEstimator("pool"))
        store = TieredStore([CpuTier(8 << 20)], chunk_tokens=256)
        remote = RemoteTiers(
            store, pool=pool, prefill=PrefillRate(1e4, "configured"), write_through=False
        )
        try:
            assert not pool.link.link().costed
            remote.measure(pool)
            # two pings and two downloads went over the link; one of each was recorded
            assert pool.counters.calls == 4 and pool.counters.errors == 0
            assert pool.link.samples == {"rtt": 1, "bandwidth": 1, "small_transfers": 0}
            assert pool.link.link().costed and pool.link.link().source == "measured"
            remote.measure(pool)  # a measured link: every call counts
            assert pool.counters.calls == 6
            assert pool.link.samples == {"rtt": 2, "bandwidth": 2, "small_transfers": 0}
        finally:
            remote.close()
            store.close()


def test_a_link_whose_first_measurement_failed_is_measured_again_once_its_source_answers(
    tmp_path: Path,
) -> None:
    """A CI run's agent found its peer slow to answer at start (a loaded machine) and left the
    link uncosted, so unused, until the next measurement 30 s later. An uncosted link is
    measured again as soon as its source answers, not at the next ``measure_every_s``."""
    with running_agent(tmp_path / "pool", "--role", "pool", "--cpu", "64MiB", "--disk", "0") as a:
        pool = Source("pool", POOL_TIER, AgentSource(a.state.data_tcp or ""), LinkEstimator("pool"))
        store = TieredStore([CpuTier(8 << 20)], chunk_tokens=256)
        remote = RemoteTiers(
            store,
            pool=pool,
            prefill=PrefillRate(1e4, "configured"),
            write_through=False,
            measure_every_s=600.0,
        )
        a.proc.send_signal(signal.SIGSTOP)  # answers nothing: the first measurement fails
        try:
            remote.start()
            wait_until("the first measurement to fail", lambda: pool.counters.errors >= 1)
            a.proc.send_signal(signal.SIGCONT)
            wait_until("the link to be measured", lambda: pool.link.link().costed, timeout_s=30)
            assert pool.link.link().source == "measured"
        finally:
            a.proc.send_signal(signal.SIGCONT)
            remote.close()
            store.close()
