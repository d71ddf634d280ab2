"""Link figures: EWMA estimates, configured overrides, emulated delay, validation, threads."""

from __future__ import annotations

import math
import threading
import time

import pytest

from kvctl.errors import InvalidArgument
from kvctl.remote.links import EmulatedDelay, Link, LinkEstimator, parse_override

MIB = 1024 * 1024


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_rtt_ewma_by_hand() -> None:
    est = LinkEstimator("pool", alpha=0.3)
    est.observe_rtt(0.010)  # the first sample seeds the estimate
    assert est.measured_rtt_s == pytest.approx(0.010)
    est.observe_rtt(0.020)  # 0.3 x 0.020 + 0.7 x 0.010
    assert est.measured_rtt_s == pytest.approx(0.013)
    est.observe_rtt(0.003)  # 0.3 x 0.003 + 0.7 x 0.013
    assert est.measured_rtt_s == pytest.approx(0.0100)
    assert est.samples == {"rtt": 3, "bandwidth": 0, "small_transfers": 0}


def test_bandwidth_sample_subtracts_the_rtt_estimate_then_ewma() -> None:
    est = LinkEstimator("pool", alpha=0.3)
    est.observe_rtt(0.010)
    est.observe_transfer(1_000_000, 0.110)  # 1e6 B / (0.110 - 0.010) s = 1e7 B/s
    assert est.measured_bandwidth_bytes_per_s == pytest.approx(1e7)
    est.observe_transfer(1_000_000, 0.060)  # 1e6 / 0.05 = 2e7; 0.3 x 2e7 + 0.7 x 1e7
    assert est.measured_bandwidth_bytes_per_s == pytest.approx(1.3e7)
    link = est.link()
    assert link.source == "measured"
    assert link.rtt_s == pytest.approx(0.010)
    assert link.bandwidth_bytes_per_s == pytest.approx(1.3e7)
    # the model reproduces a transfer that matched the estimate
    assert link.fetch_s(1.3e6) == pytest.approx(0.010 + 0.1)


def test_transfer_before_any_rtt_and_faster_than_the_rtt() -> None:
    est = LinkEstimator("pool", alpha=1.0)
    est.observe_transfer(MIB, 0.5)  # no RTT known yet: all of it counts as transfer
    assert est.measured_bandwidth_bytes_per_s == pytest.approx(MIB / 0.5)
    est.observe_rtt(1.0)
    # shorter than the RTT (noise, or an inflated estimate): never negative, and no faster
    # than its end-to-end rate (it was MIB / 1e-6: 1 TB/s)
    est.observe_transfer(MIB, 0.5)
    assert est.measured_bandwidth_bytes_per_s == pytest.approx(MIB / 0.5)


def test_small_transfers_are_ignored_for_bandwidth() -> None:
    est = LinkEstimator("pool", min_transfer_bytes=256 * 1024)
    est.observe_rtt(0.001)
    est.observe_transfer(256 * 1024 - 1, 10.0)  # RTT-bound: would read as a very slow link
    assert est.measured_bandwidth_bytes_per_s is None
    assert est.samples == {"rtt": 1, "bandwidth": 0, "small_transfers": 1}
    assert est.link().source == "default"
    est.observe_transfer(256 * 1024, 0.101)
    assert est.measured_bandwidth_bytes_per_s == pytest.approx(256 * 1024 / 0.1)
    assert est.samples["bandwidth"] == 1


def test_configured_figures_win_figure_by_figure() -> None:
    est = LinkEstimator("peer:dc2/n1", rtt_s=0.050)
    est.observe_rtt(0.001)
    est.observe_transfer(MIB, 0.050 + 0.1)  # uses the configured RTT: MIB / 0.1
    link = est.link()
    assert link.rtt_s == 0.050 and est.measured_rtt_s == pytest.approx(0.001)
    assert link.bandwidth_bytes_per_s == pytest.approx(MIB / 0.1)
    assert link.source == "measured"  # one figure is measured

    both = LinkEstimator("pool", rtt_s=0.002, bandwidth_bytes_per_s=5e9)
    both.observe_rtt(0.5)
    both.observe_transfer(10 * MIB, 1.0)
    link = both.link()
    assert (link.rtt_s, link.bandwidth_bytes_per_s, link.source) == (0.002, 5e9, "configured")
    assert both.as_dict()["measured_rtt_s"] == pytest.approx(0.5)


def test_nothing_known_is_default_and_uncosted() -> None:
    est = LinkEstimator("pool")
    link = est.link()
    assert (link.rtt_s, link.bandwidth_bytes_per_s, link.source) == (None, None, "default")
    assert not link.costed and link.fetch_s(100) is None
    est.observe_rtt(0.01)
    link = est.link()
    assert link.source == "default" and link.rtt_s == pytest.approx(0.01)  # half known
    assert not link.costed


def test_last_observed_follows_the_clock() -> None:
    clock = FakeClock()
    est = LinkEstimator("pool", clock=clock)
    assert est.last_observed_s is None
    est.observe_rtt(0.01)
    assert est.last_observed_s == 100.0
    clock.now_s = 105.0
    est.observe_transfer(10, 0.01)  # ignored for bandwidth, but the link was seen
    assert est.last_observed_s == 105.0


@pytest.mark.parametrize("bad", [-0.001, math.nan, math.inf, "0.1", True])
def test_invalid_rtt_samples(bad: object) -> None:
    est = LinkEstimator("pool")
    with pytest.raises(InvalidArgument):
        est.observe_rtt(bad)  # type: ignore[arg-type]
    assert est.samples["rtt"] == 0


@pytest.mark.parametrize(
    ("nbytes", "seconds"), [(-1, 0.1), (1.5, 0.1), (MIB, -0.1), (MIB, math.nan), (MIB, math.inf)]
)
def test_invalid_transfer_samples(nbytes: object, seconds: object) -> None:
    est = LinkEstimator("pool")
    with pytest.raises(InvalidArgument):
        est.observe_transfer(nbytes, seconds)  # type: ignore[arg-type]
    assert est.samples == {"rtt": 0, "bandwidth": 0, "small_transfers": 0}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rtt_s": -1.0},
        {"rtt_s": math.nan},
        {"bandwidth_bytes_per_s": 0.0},
        {"bandwidth_bytes_per_s": -5.0},
        {"bandwidth_bytes_per_s": math.inf},
        {"override": "always"},
        {"emulated_delay_s": -0.1},
        {"alpha": 0.0},
        {"alpha": 1.5},
        {"alpha": math.nan},
        {"min_transfer_bytes": -1},
    ],
)
def test_invalid_estimator_settings(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument):
        LinkEstimator("pool", **kwargs)  # type: ignore[arg-type]


def test_parse_override() -> None:
    assert parse_override(" Fetch ") == "fetch"
    assert parse_override("auto") == "auto"
    assert parse_override("RECOMPUTE") == "recompute"
    with pytest.raises(InvalidArgument, match="auto, fetch, recompute"):
        parse_override("never")
    assert LinkEstimator("pool", override="Recompute").link().override == "recompute"


def test_link_validation_and_as_dict_labels_emulated_rtt() -> None:
    with pytest.raises(InvalidArgument):
        Link("pool", -0.1, 1e9, "measured")
    with pytest.raises(InvalidArgument):
        Link("pool", 0.1, 0.0, "measured")
    with pytest.raises(InvalidArgument):
        Link("pool", 0.1, 1e9, "guessed")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        Link("pool", 0.1, 1e9, "measured", override="Fetch")  # type: ignore[arg-type]
    plain = Link("pool", 0.001, 1e9, "measured").as_dict()
    assert plain["rtt_basis"] == "measured" and plain["costed"] is True
    far = LinkEstimator("peer:dc2/n1", emulated_delay_s=0.02)
    far.observe_rtt(0.021)  # the wait sits inside the timed span
    shown = far.link().as_dict()
    assert shown["rtt_basis"] == "emulated" and shown["emulated_delay_s"] == 0.02
    assert shown["source"] == "default"  # bandwidth still unknown


def test_emulated_delay_waits_one_round_trip() -> None:
    slept: list[float] = []
    EmulatedDelay(0.25, sleep=slept.append).wait()
    EmulatedDelay(0.0, sleep=slept.append).wait()  # no-op
    assert slept == [0.25]
    delay = EmulatedDelay(0.01)
    assert delay.delay_s == 0.01
    start_s = time.monotonic()
    delay.wait()
    assert time.monotonic() - start_s >= 0.009
    for bad in (-0.01, math.nan, math.inf):
        with pytest.raises(InvalidArgument):
            EmulatedDelay(bad)


def test_many_threads_observing() -> None:
    est = LinkEstimator("pool", alpha=0.3)
    threads_n, per_thread = 8, 500
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads_n)

    def work() -> None:
        try:
            barrier.wait()
            for _ in range(per_thread):
                est.observe_rtt(0.01)
                est.observe_transfer(MIB, 0.01 + MIB / 1e9)
                est.observe_transfer(1, 0.01)
                est.link()
        except BaseException as exc:  # collected: an exception in a thread would be lost
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    total = threads_n * per_thread
    assert est.samples == {"rtt": total, "bandwidth": total, "small_transfers": total}
    assert est.measured_rtt_s == pytest.approx(0.01)
    assert est.measured_bandwidth_bytes_per_s == pytest.approx(1e9)
