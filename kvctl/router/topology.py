"""The fleet as the router sees it: nodes in DCs, and what moving bytes between DCs costs."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvctl.errors import InvalidArgument
from kvctl.index.model import ENGINE_SEPARATOR
from kvctl.profiles import FIBER_SECONDS_PER_KM

#: inside one DC: one switch hop and a 100 Gb/s NIC (configured defaults, labelled as such)
INTRA_DC_RTT_S = 100e-6
INTRA_DC_BYTES_PER_S = 12.5e9
#: between DCs when only the distance is known: the fiber's round trip plus switching, over a
#: 100 Gb/s wave (labelled modeled, with the distance)
INTER_DC_BYTES_PER_S = 12.5e9
SWITCHING_RTT_S = 100e-6


@dataclass(frozen=True, slots=True)
class DcLink:
    """Moving bytes between two DCs: ``rtt_s + nbytes / bandwidth_bytes_per_s``."""

    rtt_s: float
    bandwidth_bytes_per_s: float
    #: "measured" | "configured" | "modeled: <inputs>" | "emulated": shown with every decision
    basis: str

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rtt_s) and self.rtt_s >= 0):
            raise InvalidArgument(f"link rtt_s must be finite and >= 0, got {self.rtt_s!r}")
        bw = self.bandwidth_bytes_per_s
        if not (math.isfinite(bw) and bw > 0):
            raise InvalidArgument(f"link bandwidth must be finite and > 0, got {bw!r}")

    @classmethod
    def fiber(cls, km: float, *, bandwidth_bytes_per_s: float = INTER_DC_BYTES_PER_S) -> DcLink:
        if not (math.isfinite(km) and km >= 0):
            raise InvalidArgument(f"distance must be finite and >= 0 km, got {km!r}")
        rtt_s = 2 * km * FIBER_SECONDS_PER_KM + SWITCHING_RTT_S
        return cls(rtt_s, bandwidth_bytes_per_s, f"modeled: {km:g} km of fiber")

    def as_dict(self) -> dict[str, object]:
        return {
            "rtt_s": self.rtt_s,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "basis": self.basis,
        }


INTRA_DC = DcLink(INTRA_DC_RTT_S, INTRA_DC_BYTES_PER_S, "configured: intra-DC default")


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    dc: str
    #: where its data plane answers (HOST:PORT), for whoever pulls from it; "" when unknown
    address: str = ""
    #: grid carbon intensity and PUE of its DC, for the optional carbon weight
    carbon_g_per_kwh: float | None = None
    pue: float = 1.0
    #: False for a pool agent: it holds chunks others pull, but runs no engine
    serves: bool = True


@dataclass
class Topology:
    """Nodes by name and the links between their DCs (symmetric; same DC: ``intra``)."""

    nodes: dict[str, Node] = field(default_factory=dict)
    links: dict[frozenset[str], DcLink] = field(default_factory=dict)
    intra: DcLink = INTRA_DC

    @classmethod
    def build(
        cls,
        nodes: Iterable[Node],
        links: Mapping[tuple[str, str], DcLink] | None = None,
        *,
        intra: DcLink = INTRA_DC,
    ) -> Topology:
        by_name: dict[str, Node] = {}
        for node in nodes:
            if not node.name:
                raise InvalidArgument("a node needs a name")
            if ENGINE_SEPARATOR in node.name:
                # the index reads NODE#ENGINE as NODE's engine cache: such a node's own copies
                # would count as another node's, and never as its own
                raise InvalidArgument(
                    f"node {node.name!r} has {ENGINE_SEPARATOR!r} in its name, which the fleet "
                    "index keeps for an engine's own cache (NODE#ENGINE): rename it"
                )
            if node.name in by_name:
                raise InvalidArgument(f"node {node.name!r} is listed twice")
            by_name[node.name] = node
        out = cls(by_name, {}, intra)
        for (a, b), link in (links or {}).items():
            out.set_link(a, b, link)
        return out

    def set_link(self, a: str, b: str, link: DcLink) -> None:
        if a == b:
            raise InvalidArgument(f"a link joins two DCs, got {a!r} twice")
        self.links[frozenset((a, b))] = link

    @property
    def dcs(self) -> list[str]:
        return sorted({n.dc for n in self.nodes.values()})

    def link(self, a_dc: str, b_dc: str) -> DcLink | None:
        """The link between two DCs; None when nobody said what it costs."""
        if a_dc == b_dc:
            return self.intra
        return self.links.get(frozenset((a_dc, b_dc)))

    def as_dict(self) -> dict[str, object]:
        return {
            "nodes": [
                {"name": n.name, "dc": n.dc, "address": n.address} for n in self.nodes.values()
            ],
            "links": [{"dcs": sorted(pair), **link.as_dict()} for pair, link in self.links.items()],
            "intra_dc": self.intra.as_dict(),
        }
