"""Snapshots of `kvctl top`'s screens (SVG, compared by pytest-textual-snapshot): the fleet in
80x24 and in a large terminal, grouped, in a light theme, a node's page, a confirmation and the
help. Figures come from a scripted source so every run draws the same screen; the pilot tests
in test_top.py run the same screens against real agents."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from textual.pilot import Pilot

from kvctl.db.inventory import NodeInfo
from kvctl.tui.app import TopApp, create_app
from kvctl.tui.model import GpuPower, Poll, Reading
from kvctl.tui.sources import Details

GiB = 1 << 30
T0 = 1_790_000_000.0


def _stats(
    step: int, *, lookups: int, hits: int, sharing: int, used: dict[str, int], reads: bool = True
) -> Any:
    cap = {"cpu": 64 * GiB, "disk": 512 * GiB}
    tiers = {
        t: {
            # each tier serves half the hits, half of each kind
            "hits": hits * step // 2,
            "hit_tokens": 0,
            "reuse_hits": (hits - sharing) * step // 2,
            "sharing_hits": sharing * step // 2,
            "puts": 0,
            "bytes_written": 3 * GiB * step // 10,
            "bytes_read": 7 * GiB * step // 10,
            "promotions": 0,
            "demotions": 0,
            "evictions": {"capacity": 40 * step if t == "cpu" else 0},
        }
        for t in used
    }
    return {
        "stats": {
            "lookup_chunks": lookups * step,
            "lookup_tokens": 0,
            "hit_chunks": hits * step,
            "hit_tokens": 0,
            "reuse_hits": (hits - sharing) * step,
            "sharing_hits": sharing * step,
            "drops": 25 * step,
            "tiers": tiers,
        },
        "usage": {
            t: {
                "used_bytes": u,
                "capacity_bytes": cap[t],
                "pinned_bytes": 0,
                "chunks": u // (32 << 20),
            }
            for t, u in used.items()
        },
        "started_s": T0 - 3 * 3600,
        # the engines read every hit, one in 20 gone by then; an older agent counts no reads
        **(
            {"dataplane": {"read_chunks": hits * step, "read_missing_chunks": hits * step // 20}}
            if reads
            else {}
        ),
    }


NODES = [
    # name, dc, lookups/poll, hits/poll, sharing hits/poll, cpu used, disk used, power
    ("gpu-a1", "fra", 1000, 720, 180, 40 * GiB, 100 * GiB, 612.0),
    ("gpu-a2", "fra", 800, 600, 0, 58 * GiB, 300 * GiB, 598.5),
    ("gpu-a3", "fra", 900, 50, 10, 63 * GiB, 500 * GiB, None),
    ("gpu-b1", "ams", 1200, 900, 450, 20 * GiB, 50 * GiB, 640.0),
    ("gpu-b2", "ams", 0, 0, 0, 1 * GiB, 0, None),
    ("gpu-c1", "lon", 500, 300, 60, 33 * GiB, 200 * GiB, 701.2),
]
RTT = {("fra", "ams"): 0.0008, ("fra", "lon"): 0.0061, ("ams", "lon"): 0.0034}


class ScriptedSource:
    """Polls of a made-up fleet, 2 s apart: the same screen on every run."""

    label = "fleet · snapshot"
    token = None

    def __init__(self) -> None:
        self.step = 0

    def poll(self, wait_s: float | None = None) -> Poll:
        self.step += 1
        readings = []
        for i, (name, dc, lookups, hits, sharing, cpu, disk, power) in enumerate(NODES):
            node = NodeInfo(i + 1, name, dc, f"http://10.0.0.{i + 1}:7070", "H100", None)
            if name == "gpu-a3" and self.step > 5:
                readings.append(Reading(node, None, "cannot reach the agent: timed out"))
                continue
            st = _stats(
                self.step,
                lookups=lookups,
                hits=hits,
                sharing=sharing,
                used={"cpu": cpu, "disk": disk},
                reads=name != "gpu-c1",
            )
            gpu = GpuPower(power, 1) if power else GpuPower(None, 0, "NVML unavailable: no driver")
            readings.append(Reading(node, st, None, 0.01, gpu))
        rtt = {**RTT, **{(b, a): v for (a, b), v in RTT.items()}}
        return Poll(T0 + 2 * self.step, readings, rtt, 0.042)

    def details(self, node: NodeInfo, cursor: int | None, wait_s: float | None = None) -> Details:
        if cursor is not None:
            return Details(cursor=cursor, top=None, pinned=None)
        events = [
            {
                "seq": i + 1,
                "time_s": T0 + i,
                "type": kind,
                "key": f"{i:02x}" * 16,
                "tier": tier,
                "size_bytes": 32 << 20,
                "tenant": tenant,
                **({"src": src} if src else {}),
            }
            for i, (kind, tier, tenant, src) in enumerate(
                [
                    ("store", "cpu", "acme", None),
                    ("store", "cpu", "globex", None),
                    ("demote", "disk", "acme", "cpu"),
                    ("promote", "cpu", "acme", "disk"),
                    ("evict", "disk", "globex", None),
                ]
            )
        ]
        chunks = [
            {
                "key": f"{i:02x}" * 16,
                "tier": "cpu" if i < 3 else "disk",
                "hit_count": 900 - i * 97,
                "prefix_tokens": (i + 1) * 256,
                "prefix_complete": i != 4,
                "size_bytes": 32 << 20,
                "tenant": "acme" if i % 2 == 0 else "globex",
                "pinned": i == 0,
            }
            for i in range(6)
        ]
        return Details(events, 5, 0, False, chunks, [chunks[0]])

    def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
def _utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def make_app(theme: str | None = None) -> TopApp:
    return create_app(
        ScriptedSource(), auto_poll=False, audit_engine=None, actor="op@bastion", theme=theme
    )


async def polled(pilot: Pilot[None], times: int = 3) -> None:
    app = pilot.app
    assert isinstance(app, TopApp)
    for _ in range(times):
        before = app.refreshes
        app.tick()
        deadline = time.monotonic() + 10
        while app.refreshes == before:
            assert time.monotonic() < deadline, "the scripted poll never arrived"
            await pilot.pause(0.02)
    await pilot.pause()


async def details_shown(pilot: Pilot[None]) -> None:
    from textual.widgets import DataTable

    deadline = time.monotonic() + 10
    while pilot.app.screen.query_one("#top", DataTable).row_count == 0:
        assert time.monotonic() < deadline, "the node's details never arrived"
        await pilot.pause(0.02)
    await pilot.pause()


def test_fleet_80x24(snap_compare: Any) -> None:
    assert snap_compare(make_app(), terminal_size=(80, 24), run_before=polled)


def test_fleet_large_grouped_with_a_node_down(snap_compare: Any) -> None:
    async def run(pilot: Pilot[None]) -> None:
        await polled(pilot, times=6)  # gpu-a3 stops answering at the sixth poll
        await pilot.press("g")

    assert snap_compare(make_app(), terminal_size=(160, 30), run_before=run)


def test_fleet_light_theme_sorted_by_hit_ratio(snap_compare: Any) -> None:
    async def run(pilot: Pilot[None]) -> None:
        await polled(pilot)
        await pilot.press("s", "s", "s", "S")  # DC -> node -> state -> hit, then descending

    assert snap_compare(make_app("textual-light"), terminal_size=(140, 24), run_before=run)


def test_node_page(snap_compare: Any) -> None:
    async def run(pilot: Pilot[None]) -> None:
        await polled(pilot, times=4)
        await pilot.press("enter")  # the first row: gpu-b1 (ams sorts first)
        await details_shown(pilot)
        await pilot.press("2")
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=(100, 30), run_before=run)


def test_node_page_events(snap_compare: Any) -> None:
    async def run(pilot: Pilot[None]) -> None:
        await polled(pilot, times=2)
        await pilot.press("enter")
        await details_shown(pilot)

    assert snap_compare(make_app(), terminal_size=(80, 24), run_before=run)


def test_confirm_dialog(snap_compare: Any) -> None:
    from kvctl.fleet.actions import ActionRequest, ChunkSelection

    async def run(pilot: Pilot[None]) -> None:
        await polled(pilot)
        app = pilot.app
        assert isinstance(app, TopApp) and app.view is not None
        app.audit_engine = object()  # type: ignore[assignment]  # a dialog only: nothing runs
        node = app.view.rows[0].node
        request = ActionRequest("evict", chunks=ChunkSelection(keys=("ab" * 16,)))
        app.request_action(node, request, f"chunk {'ab' * 16}")
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=(80, 24), run_before=run)


def test_help(snap_compare: Any) -> None:
    async def run(pilot: Pilot[None]) -> None:
        await polled(pilot, times=1)
        await pilot.press("question_mark")

    assert snap_compare(make_app(), terminal_size=(100, 45), run_before=run)


# --- with a router ------------------------------------------------------------------------------
ROUTER_URL = "http://10.0.0.9:9480"
#: chunks each scripted node holds, in the router's index: prefixes of its own
HELD = {"gpu-a1": 6, "gpu-a2": 2, "gpu-b1": 4, "pool-ams": 16}


def _chain(node: str, n: int) -> list[bytes]:
    seed = sum(node.encode())
    return [bytes([seed % 256, i]) * 8 for i in range(n)]


def scripted_router(clock: Callable[[], float]) -> Any:
    """A real router (kvctl.router.service.Router) over a real embedded index holding the
    scripted nodes' chunks, its modeled backlog drained on the scripted polls' clock: the same
    decisions, so the same figures, on every run."""
    from kvctl.index.events import ChunkEvent
    from kvctl.index.model import EmbeddedIndex
    from kvctl.remote.fetchplan import PrefillModel
    from kvctl.router.load import LoadTally
    from kvctl.router.score import Costs
    from kvctl.router.service import Router
    from kvctl.router.topology import DcLink, Node, Topology

    index = EmbeddedIndex()
    for name, n in HELD.items():
        index.apply(
            name,
            [
                ChunkEvent("stored", k, tier="cpu", size_bytes=32 << 20, tokens=256)
                for k in _chain(name, n)
            ],
        )
    nodes = [Node(name, dc) for name, dc, *_ in NODES] + [Node("pool-ams", "ams", serves=False)]
    links = {
        ("fra", "ams"): DcLink.fiber(80),
        ("fra", "lon"): DcLink.fiber(640),
        ("ams", "lon"): DcLink.fiber(360),
    }
    costs = Costs(PrefillModel(2e-4, 0.0, "configured: snapshot"))
    return Router(index, Topology.build(nodes, links), costs, load=LoadTally(clock=clock))


class RoutedSource(ScriptedSource):
    """The scripted fleet, and a real router asked the same requests before every poll."""

    label = "fleet · snapshot · router " + ROUTER_URL

    def __init__(self, *, router_down_after: int | None = None) -> None:
        super().__init__()
        self.router = scripted_router(lambda: T0 + 2 * self.step)
        self.down_after = router_down_after

    def poll(self, wait_s: float | None = None) -> Poll:
        from kvctl.tui.model import RouterReading

        base = super().poll()
        if self.down_after is not None and self.step > self.down_after:
            why = f"the router at {ROUTER_URL} did not answer: [Errno 111] Connection refused"
            reading = RouterReading(ROUTER_URL, None, why)
        else:
            for node, origin in [("gpu-a1", "fra")] * 3 + [("gpu-b1", "ams"), ("gpu-a2", "fra")]:
                self.router.route(_chain(node, HELD[node]), tenant="acme", origin_dc=origin)
            # a long prefix only the ams pool holds, asked in fra: pulled over the fra-ams link
            self.router.route(_chain("pool-ams", 16), tenant="acme", origin_dc="fra")
            self.router.route([b"\xee" * 16], tenant="acme", origin_dc="lon")  # held nowhere
            reading = RouterReading(ROUTER_URL, self.router.stats())
        return Poll(base.ts_s, base.readings, base.rtt_s, base.elapsed_s, reading)


def test_fleet_with_a_router(snap_compare: Any) -> None:
    app = create_app(RoutedSource(), auto_poll=False, audit_engine=None, actor="op@bastion")
    assert snap_compare(app, terminal_size=(170, 20), run_before=polled)


def test_fleet_with_the_router_down(snap_compare: Any) -> None:
    app = create_app(
        RoutedSource(router_down_after=2), auto_poll=False, audit_engine=None, actor="op@bastion"
    )
    assert snap_compare(app, terminal_size=(120, 16), run_before=polled)
