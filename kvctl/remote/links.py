"""The links to remote sources (the shared pool, peer agents in other DCs) and what they cost.

A fetch over a link costs ``rtt_s + nbytes / bandwidth_bytes_per_s``. Both figures come from one
of three places, reported with them as ``Link.source``:

- ``configured``: the operator gave both figures; they win over measurements, figure by figure.
- ``measured``: EWMAs of the round trips and bulk transfers this agent saw on the link.
- ``default``: a figure is still unknown; such a link cannot be costed, and the fetch planner
  uses it only when the operator forces it (override ``fetch``).

Emulated distance: a demo (or test) may add an in-process wait on a link (``EmulatedDelay``)
inside the timed span, so measured round trips include it; ``Link.as_dict`` then labels the RTT
``emulated`` so nobody mistakes it for a real network's.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvctl.errors import InvalidArgument

Override = Literal["auto", "fetch", "recompute"]
LinkSource = Literal["measured", "configured", "default"]

OVERRIDES: tuple[Override, ...] = ("auto", "fetch", "recompute")
SOURCES: tuple[LinkSource, ...] = ("measured", "configured", "default")

#: transfers smaller than this are dominated by the round trip, so they say nothing reliable
#: about bandwidth
DEFAULT_MIN_TRANSFER_BYTES = 256 * 1024
DEFAULT_ALPHA = 0.3


def parse_override(text: str) -> Override:
    """``auto`` | ``fetch`` | ``recompute`` (case and surrounding blanks ignored)."""
    value = str(text).strip().lower()
    if value not in OVERRIDES:
        raise InvalidArgument(f"link override must be one of {', '.join(OVERRIDES)}, got {text!r}")
    return value


def _check_seconds(value: float, what: str) -> float:
    # bool is an int: reject it so a stray flag is not taken for 1 s
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{what} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"{what} must be finite and >= 0, got {value!r}")
    return float(value)


def _check_bandwidth(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{what} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgument(f"{what} must be finite and > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class Link:
    """One remote source's figures at one moment, as the fetch planner uses them."""

    name: str
    rtt_s: float | None
    bandwidth_bytes_per_s: float | None
    #: how the figures were obtained: "measured" | "configured" | "default" (not known)
    source: LinkSource
    #: "auto": the planner decides; "fetch": always fetch from it; "recompute": never
    override: Override = "auto"
    #: in-process wait added on this link to emulate distance; > 0: the RTT includes it
    emulated_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.rtt_s is not None:
            _check_seconds(self.rtt_s, f"link {self.name!r} rtt_s")
        if self.bandwidth_bytes_per_s is not None:
            _check_bandwidth(self.bandwidth_bytes_per_s, f"link {self.name!r} bandwidth")
        if self.source not in SOURCES:
            raise InvalidArgument(f"link source must be one of {SOURCES}, got {self.source!r}")
        if self.override not in OVERRIDES:
            raise InvalidArgument(f"override must be one of {OVERRIDES}, got {self.override!r}")
        _check_seconds(self.emulated_delay_s, f"link {self.name!r} emulated_delay_s")

    @property
    def costed(self) -> bool:
        """Both figures are known, so a fetch over it can be priced."""
        return self.rtt_s is not None and self.bandwidth_bytes_per_s is not None

    @property
    def emulated(self) -> bool:
        return self.emulated_delay_s > 0

    def transfer_s(self, nbytes: float) -> float | None:
        """Bytes over bandwidth, without the round trip; None when the bandwidth is unknown."""
        if self.bandwidth_bytes_per_s is None:
            return None
        return nbytes / self.bandwidth_bytes_per_s

    def fetch_s(self, nbytes: float) -> float | None:
        """One batched request: ``rtt_s + nbytes / bandwidth``; None when not costed."""
        if self.rtt_s is None or self.bandwidth_bytes_per_s is None:
            return None
        return self.rtt_s + nbytes / self.bandwidth_bytes_per_s

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "rtt_s": self.rtt_s,
            # an emulated RTT is a demo's, not a network's: say so wherever it is shown
            "rtt_basis": "emulated" if self.emulated else self.source,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "source": self.source,
            "override": self.override,
            "emulated_delay_s": self.emulated_delay_s,
            "costed": self.costed,
        }


class LinkEstimator:
    """Running estimates of one remote source's RTT and bandwidth. Thread-safe.

    Each figure is an EWMA (the first sample seeds it); an operator-configured figure wins over
    the measured one for that figure, while measurements still accumulate for reporting.
    """

    def __init__(
        self,
        name: str,
        *,
        rtt_s: float | None = None,
        bandwidth_bytes_per_s: float | None = None,
        override: str = "auto",
        emulated_delay_s: float = 0.0,
        alpha: float = DEFAULT_ALPHA,
        min_transfer_bytes: int = DEFAULT_MIN_TRANSFER_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not name:
            raise InvalidArgument("a link needs a name")
        if isinstance(alpha, bool) or not isinstance(alpha, int | float):
            raise InvalidArgument(f"alpha must be a number, got {alpha!r}")
        if not 0 < alpha <= 1:  # NaN fails this too
            raise InvalidArgument(f"alpha must be in (0, 1], got {alpha!r}")
        if isinstance(min_transfer_bytes, bool) or not isinstance(min_transfer_bytes, int):
            raise InvalidArgument(f"min_transfer_bytes must be an int, got {min_transfer_bytes!r}")
        if min_transfer_bytes < 0:
            raise InvalidArgument(f"min_transfer_bytes must be >= 0, got {min_transfer_bytes}")
        self.name = name
        self.override: Override = parse_override(override)
        self.emulated_delay_s = _check_seconds(emulated_delay_s, "emulated_delay_s")
        self.configured_rtt_s = None if rtt_s is None else _check_seconds(rtt_s, "rtt_s")
        self.configured_bandwidth_bytes_per_s = (
            None
            if bandwidth_bytes_per_s is None
            else _check_bandwidth(bandwidth_bytes_per_s, "bandwidth_bytes_per_s")
        )
        self.alpha = float(alpha)
        self.min_transfer_bytes = min_transfer_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._rtt_s: float | None = None
        self._bandwidth_bytes_per_s: float | None = None
        self._rtt_samples = 0
        self._bandwidth_samples = 0
        self._small_transfers = 0
        self._last_observed_s: float | None = None

    def _ewma(self, current: float | None, sample: float) -> float:
        return sample if current is None else self.alpha * sample + (1 - self.alpha) * current

    def _rtt_locked(self) -> float | None:
        return self.configured_rtt_s if self.configured_rtt_s is not None else self._rtt_s

    def observe_rtt(self, seconds: float) -> None:
        """One round trip (a request with a negligible payload), in seconds."""
        seconds = _check_seconds(seconds, "rtt sample")
        with self._lock:
            self._rtt_s = self._ewma(self._rtt_s, seconds)
            self._rtt_samples += 1
            self._last_observed_s = self._clock()

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """A request that moved ``nbytes`` in ``seconds`` end to end (round trip included).

        Only transfers of at least ``min_transfer_bytes`` are bandwidth samples: smaller ones are
        RTT-bound. The sample subtracts the RTT the planner would use, so that
        ``rtt + nbytes / bandwidth`` reproduces what was observed.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidArgument(f"nbytes must be an int >= 0, got {nbytes!r}")
        seconds = _check_seconds(seconds, "transfer seconds")
        with self._lock:
            self._last_observed_s = self._clock()
            if nbytes < self.min_transfer_bytes:
                self._small_transfers += 1
                return
            rtt_s = self._rtt_locked() or 0.0
            # a transfer quicker than the RTT estimate says the estimate is too high (noise, or
            # a ping stalled on a loaded machine): its end-to-end rate is then a floor on the
            # bandwidth. Flooring its transfer time at 1 us instead read a 4 MiB probe as
            # 4 TB/s, and the EWMA priced the link as free once the RTT came back down
            sample = nbytes / (seconds - rtt_s if seconds > rtt_s else max(seconds, 1e-9))
            self._bandwidth_bytes_per_s = self._ewma(self._bandwidth_bytes_per_s, sample)
            self._bandwidth_samples += 1

    def _link_locked(self) -> Link:
        rtt_s = self._rtt_locked()
        bandwidth = (
            self.configured_bandwidth_bytes_per_s
            if self.configured_bandwidth_bytes_per_s is not None
            else self._bandwidth_bytes_per_s
        )
        source: LinkSource
        if rtt_s is None or bandwidth is None:
            source = "default"  # cannot be costed yet; a figure that is known is still shown
        elif (
            self.configured_rtt_s is not None and self.configured_bandwidth_bytes_per_s is not None
        ):
            source = "configured"
        else:
            source = "measured"
        return Link(
            name=self.name,
            rtt_s=rtt_s,
            bandwidth_bytes_per_s=bandwidth,
            source=source,
            override=self.override,
            emulated_delay_s=self.emulated_delay_s,
        )

    def link(self) -> Link:
        """The figures the planner should use now."""
        with self._lock:
            return self._link_locked()

    @property
    def measured_rtt_s(self) -> float | None:
        with self._lock:
            return self._rtt_s

    @property
    def measured_bandwidth_bytes_per_s(self) -> float | None:
        with self._lock:
            return self._bandwidth_bytes_per_s

    @property
    def samples(self) -> dict[str, int]:
        """Counts: ``rtt`` and ``bandwidth`` samples taken, ``small_transfers`` ignored."""
        with self._lock:
            return {
                "rtt": self._rtt_samples,
                "bandwidth": self._bandwidth_samples,
                "small_transfers": self._small_transfers,
            }

    @property
    def last_observed_s(self) -> float | None:
        """The clock's reading at the last observation of any kind; None before the first."""
        with self._lock:
            return self._last_observed_s

    def as_dict(self) -> dict[str, object]:
        """The link as the planner sees it, plus what went into it (one consistent snapshot)."""
        with self._lock:
            return {
                **self._link_locked().as_dict(),
                "configured_rtt_s": self.configured_rtt_s,
                "configured_bandwidth_bytes_per_s": self.configured_bandwidth_bytes_per_s,
                "measured_rtt_s": self._rtt_s,
                "measured_bandwidth_bytes_per_s": self._bandwidth_bytes_per_s,
                "samples": {
                    "rtt": self._rtt_samples,
                    "bandwidth": self._bandwidth_samples,
                    "small_transfers": self._small_transfers,
                },
                "last_observed_s": self._last_observed_s,
            }


class EmulatedDelay:
    """An in-process wait that emulates distance on a link: one round trip's worth per call."""

    def __init__(self, delay_s: float, *, sleep: Callable[[float], None] = time.sleep) -> None:
        self._delay_s = _check_seconds(delay_s, "emulated delay_s")
        self._sleep = sleep

    @property
    def delay_s(self) -> float:
        return self._delay_s

    def wait(self) -> None:
        if self._delay_s > 0:
            self._sleep(self._delay_s)

    def __repr__(self) -> str:
        return f"EmulatedDelay(delay_s={self._delay_s!r})"
