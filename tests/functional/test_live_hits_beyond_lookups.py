"""Live views and an agent whose counts since its start have more hits than lookups, which a
sound agent's never do (it counts a lookup before its hits, remote ones included): live `kvctl
status`, `kvctl top` and `kvctl agent status` have its hit counts unknown and named, and leave
the node out of DC and fleet sums, as the database's window does (kvctl.db.analytics.counts).
Before, live status summed them (the fleet read 120 hits of 150 lookups, 80%, where the sound
node had 40 of 100), top showed the node's lifetime hit ratio as 160%, and neither said why.

The agents are the collectors' tests' stand-ins (a loopback HTTP server answering what the
test sets)."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app as cli
from tests.functional.test_agent_status_impossible_values import INFO
from tests.functional.test_collector_impossible_values import StandIn, _stats
from tests.functional.test_status_impossible_values import _inventory
from tests.functional.test_top_impossible_values import _strict

runner = CliRunner()

#: 50 lookups, 80 hits (all sharing, all from cpu), of 256 tokens each
BEYOND = {
    "stats.hit_chunks": "more than stats.lookup_chunks",
    "stats.sharing_hits": "more than stats.lookup_chunks",
    "stats.tiers.cpu.hits": "more than stats.lookup_chunks",
    "stats.tiers.cpu.sharing_hits": "more than stats.lookup_chunks",
    "stats.hit_tokens": "more than stats.lookup_tokens",
    "stats.tiers.cpu.hit_tokens": "more than stats.lookup_tokens",
}
#: 50 lookups (12,800 tokens), 40 hits of 20,480 tokens, all from cpu
TOKENS_BEYOND = {
    "stats.hit_tokens": "more than stats.lookup_tokens",
    "stats.tiers.cpu.hit_tokens": "more than stats.lookup_tokens",
}


def _tokens_beyond() -> dict[str, Any]:
    """Hits within the lookups (40 of 50 chunks), their tokens beyond (20,480 of 12,800)."""
    stats = _stats(50, 40, 0.0)
    stats["stats"]["hit_tokens"] = stats["stats"]["tiers"]["cpu"]["hit_tokens"] = 20_480
    return stats


#: (the odd node's answer, what it names, what the status table says): hits beyond the
#: lookups, and hits within them whose tokens are beyond the lookups' tokens
CASES = {
    "chunks": (
        lambda: _stats(50, 80, 0.0),
        BEYOND,
        "stats.hit_chunks (more than stats.lookup_chunks)",
    ),
    "tokens": (
        _tokens_beyond,
        TOKENS_BEYOND,
        "stats.hit_tokens (more than stats.lookup_tokens)",
    ),
}


def _answers(n1: StandIn, n2: StandIn, case: str) -> None:
    n1.answers["/v1/stats"] = _stats(100, 40, 0.0)
    n2.answers["/v1/stats"] = CASES[case][0]()


def _rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["node"]: r for r in doc["nodes"]}


@pytest.mark.parametrize("case", CASES)
def test_live_status_has_them_unknown_named_and_out_of_the_sums(
    sqlite_url: str, stand_ins: tuple[StandIn, StandIn], case: str
) -> None:
    """An agent reporting 80 hits over 50 lookups, or 20,480 hit tokens over 12,800 lookup
    tokens (its chunks within: 40 of 50), was summed as sound: live `kvctl status` named
    nothing and read the fleet 120 (or 80) of 150."""
    _, rejected, said_why = CASES[case]
    n1, n2 = stand_ins
    _inventory(sqlite_url, n1, n2)
    _answers(n1, n2, case)
    out = runner.invoke(cli, ["status", "--db", sqlite_url, "--json"])
    assert out.exit_code == 0, out.output
    doc = _strict(out.stdout)
    odd = _rows(doc)["n2"]
    assert odd["state"] == "up" and odd["rejected"] == rejected, odd
    assert (odd["lookups"], odd["hits"], odd["hit_ratio"]) == (None, None, None)
    assert odd["tiers"]["cpu"]["hits"] is None  # unknown with the node's
    assert odd["tiers"]["cpu"]["used_bytes"] == 4096  # the rest stands
    total = doc["total"]
    assert (total["lookups"], total["hits"], total["hit_ratio"]) == (100, 40, 0.4)
    ams = next(d for d in doc["dcs"] if d["dc"] == "ams")
    assert (ams["lookups"], ams["hit_ratio"]) == (None, None)

    table = runner.invoke(cli, ["status", "--db", sqlite_url], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    said = " ".join(line for line in table.stdout.splitlines() if line.startswith("n2 "))
    assert said_why in said, table.stdout


@pytest.mark.parametrize("case", CASES)
def test_top_has_them_unknown_and_named(
    sqlite_url: str, stand_ins: tuple[StandIn, StandIn], case: str
) -> None:
    n1, n2 = stand_ins
    _inventory(sqlite_url, n1, n2)
    _answers(n1, n2, case)
    out = runner.invoke(cli, ["top", "--db", sqlite_url, "--json", "--interval", "0.2"])
    assert out.exit_code == 0, out.output
    rows = _rows(_strict(out.stdout))
    odd = rows["n2"]
    assert odd["state"] == "up" and CASES[case][1].items() <= odd["rejected"].items(), odd
    assert odd["lifetime_hit_ratio"] is None, odd  # never above 100%
    assert rows["n1"]["lifetime_hit_ratio"] == 0.4


def test_agent_status_has_them_unknown_and_named(stand_ins: tuple[StandIn, StandIn]) -> None:
    _, n2 = stand_ins
    n2.answers["/v1/stats"] = _stats(50, 80, 0.0)
    n2.answers["/v1/info"] = {"name": "n2", "pid": 1, "version": "0.1.0", "tiers": []}
    out = runner.invoke(cli, ["agent", "status", "--url", n2.url, "--json"])
    assert out.exit_code == 0, out.output
    report = _strict(out.stdout)
    assert report["rejected"] == BEYOND, report["rejected"]
    assert (report["lookups"], report["hits"], report["hit_ratio"]) == (None, None, None)
    assert report["lookup_requests"] == 50  # the rest stands


def test_agent_status_shows_no_tier_hits_it_names_as_impossible(
    stand_ins: tuple[StandIn, StandIn],
) -> None:
    """`kvctl agent status` named stats.tiers.cpu.hits and .sharing_hits under rejected (more
    than the node's 50 lookups) but still showed them, 80 each, in its JSON's tiers and as the
    cpu tier's '80 hit' in its table; `kvctl status` has them null. The rest of the tier, and
    the tiers that are sound, stand."""
    _, n2 = stand_ins
    n2.answers["/v1/stats"] = _stats(50, 80, 0.0)
    n2.answers["/v1/info"] = INFO
    out = runner.invoke(cli, ["agent", "status", "--url", n2.url, "--json"])
    assert out.exit_code == 0, out.output
    cpu = _strict(out.stdout)["tiers"]["cpu"]
    assert (cpu["hits"], cpu["sharing_hits"]) == (None, None), cpu
    assert (cpu["reuse_hits"], cpu["bytes_read"]) == (0, 80)  # not named: they stand
    assert _strict(out.stdout)["tiers"]["disk"]["hits"] == 0
    table = runner.invoke(cli, ["agent", "status", "--url", n2.url], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    cpu_row = next(line.split() for line in table.stdout.splitlines() if " cpu " in line)
    assert cpu_row[-2:] == ["N/A", "│"], table.stdout  # its hits column


def test_agent_status_shows_no_hit_tokens_beyond_the_lookup_tokens(
    stand_ins: tuple[StandIn, StandIn],
) -> None:
    """`kvctl agent status --json` showed 20,480 hit tokens over 12,800 lookup tokens (and the
    cpu tier's 20,480), named nothing, and its hit ratio 80% from the same counters. Now the
    tokens, the node's hit counts and every ratio over them are null and named; the table says
    N/A and why."""
    _, n2 = stand_ins
    n2.answers["/v1/stats"] = _tokens_beyond()
    n2.answers["/v1/info"] = INFO
    out = runner.invoke(cli, ["agent", "status", "--url", n2.url, "--json"])
    assert out.exit_code == 0, out.output
    report = _strict(out.stdout)
    assert report["rejected"] == TOKENS_BEYOND, report["rejected"]
    assert (report["lookup_tokens"], report["hit_tokens"]) == (None, None), report
    assert (report["lookups"], report["hits"], report["hit_ratio"]) == (None, None, None)
    cpu = report["tiers"]["cpu"]
    assert cpu["hit_tokens"] is None and cpu["hits"] == 40, cpu  # its chunks were within
    assert report["tiers"]["disk"]["hit_tokens"] == 0
    assert report["lookup_requests"] == 50  # the rest stands
    table = runner.invoke(cli, ["agent", "status", "--url", n2.url], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    assert "stats.hit_tokens (more than stats.lookup_tokens)" in table.stdout, table.stdout
    assert "80.0%" not in table.stdout, table.stdout


def test_agent_status_names_the_tokens_of_hits_beyond_lookups_too(
    stand_ins: tuple[StandIn, StandIn],
) -> None:
    """80 hits over 50 lookups are 20,480 hit tokens over 12,800: `kvctl agent status --json`
    nulled the chunks but still showed those tokens."""
    _, n2 = stand_ins
    n2.answers["/v1/stats"] = _stats(50, 80, 0.0)
    n2.answers["/v1/info"] = INFO
    out = runner.invoke(cli, ["agent", "status", "--url", n2.url, "--json"])
    assert out.exit_code == 0, out.output
    report = _strict(out.stdout)
    assert (report["lookup_tokens"], report["hit_tokens"]) == (None, None), report
    assert report["tiers"]["cpu"]["hit_tokens"] is None, report["tiers"]
