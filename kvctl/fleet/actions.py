"""Control actions on chunks and tiers (pin, unpin, evict, flush, prefetch, move, resize), run
on many agents at once, each node's outcome written to the audit trail as it arrives."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from kvctl.agent.settings import tier_size_problem
from kvctl.client import AgentClient, NotAnAgent
from kvctl.db.engine import DatabaseError, driver_message
from kvctl.db.inventory import NodeInfo
from kvctl.errors import InvalidArgument
from kvctl.fleet.audit import record
from kvctl.fleet.fanout import NodeResult, fan_out, read_deadline_s
from kvctl.units import parse_size

#: the bottom tier of every agent (kvctl.agent.runtime builds gpu, cpu, then disk): nothing is
#: below it to demote to
BOTTOM_TIER: Final = "disk"
#: actions that name chunks; the others name a tier
KEYED: Final = frozenset({"pin", "unpin", "evict", "prefetch", "move"})
ACTIONS: Final = ("pin", "unpin", "evict", "flush", "prefetch", "move", "resize")
#: the counts in every action's answer (the agent's BulkResponse)
COUNTS: Final = ("done", "skipped_pinned", "missing", "failed")


@dataclass(frozen=True, slots=True)
class ChunkSelection:
    """The chunks an action names: explicit keys, or a prompt's tokens whose keys each agent
    computes for its own model namespace (a node's keys depend on its model and KV layout)."""

    keys: tuple[str, ...] = ()
    tokens: tuple[int, ...] | None = None
    model: str | None = None
    tenant: str = ""

    def __post_init__(self) -> None:
        if (not self.keys) == (self.tokens is None):
            raise InvalidArgument("name the chunks: keys, or tokens (a text or a token file)")

    def resolve(self, client: AgentClient) -> list[str]:
        if self.tokens is None:
            return list(self.keys)
        # count=False: looking keys up for an operator must not move the node's hit ratio
        found = client.lookup(tokens=self.tokens, model=self.model, tenant=self.tenant, count=False)
        return [c["key"] for c in found["chunks"]]

    def describe(self) -> dict[str, Any]:
        if self.tokens is None:
            return {"keys": len(self.keys)}
        return {"prompt_tokens": len(self.tokens), "model": self.model, "tenant": self.tenant}


@dataclass(frozen=True, slots=True)
class ActionRequest:
    action: str
    chunks: ChunkSelection | None = None
    tier: str | None = None
    size: str | None = None
    demote: bool = False

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise InvalidArgument(f"unknown action {self.action!r}; one of {', '.join(ACTIONS)}")
        if (self.action in KEYED) != (self.chunks is not None):
            raise InvalidArgument(
                f"{self.action} {'names chunks' if self.action in KEYED else 'names a tier'}"
            )
        if self.action in ("flush", "move", "resize") and not self.tier:
            raise InvalidArgument(f"{self.action} needs a tier")
        if self.action == "flush" and self.demote and self.tier == BOTTOM_TIER:
            # the agents refuse it too; refused here, no node is asked and none fails
            raise InvalidArgument(
                f"cannot demote the {BOTTOM_TIER} tier: it is every agent's bottom tier, "
                "nothing is below it; flush without --demote to drop its chunks"
            )
        if self.action == "resize":
            if self.size is None:
                raise InvalidArgument("resize needs a size")
            # a bad size fails here, before any agent is asked; so does one no agent takes
            problem = tier_size_problem(self.tier or "", parse_size(self.size))
            if problem:
                raise InvalidArgument(problem)

    def call(self, client: AgentClient) -> dict[str, Any]:
        return _checked(client.url, self.action, self._call(client))

    def _call(self, client: AgentClient) -> dict[str, Any]:
        a = self.action
        if a == "flush":
            return client.flush(self.tier or "", demote=self.demote)
        if a == "resize":
            return client.resize(self.tier or "", self.size or "")
        assert self.chunks is not None
        keys = self.chunks.resolve(client)
        if not keys:
            return {"done": 0, "skipped_pinned": 0, "missing": 0, "failed": 0, "keys": 0}
        if a == "pin":
            out = client.pin(keys, self.tier)
        elif a == "unpin":
            out = client.unpin(keys)
        elif a == "evict":
            out = client.evict(keys)
        elif a == "prefetch":
            out = client.prefetch(keys, self.tier)
        else:
            out = client.move(keys, self.tier or "")
        return {**out, "keys": len(keys)}

    def audit_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"tier": self.tier}
        if self.chunks is not None:
            args.update(self.chunks.describe())
        if self.action == "resize":
            args["size"] = self.size
        if self.action == "flush":
            args["demote"] = self.demote
        return {k: v for k, v in args.items() if v is not None}


def _checked(url: str, action: str, answer: dict[str, Any]) -> dict[str, Any]:
    """``answer`` if it carries an agent's counts: ``done``, and the others (0 when absent) as
    counts too. Any JSON object passed before: another service or a proxy's reply on the port
    made an ok that did nothing (exit 0, audited ok), and a null count crashed the table."""
    bad = {
        k: answer.get(k)
        for k in COUNTS
        if (k == "done" or k in answer)
        and not (type(answer.get(k)) is int and answer[k] >= 0)  # (a bool is no count)
    }
    if bad:
        shown = ", ".join(f"{k}={v!r}" for k, v in bad.items())
        raise NotAnAgent(f"{url} answered {action} with {shown[:200]}: not a kvctl agent's answer")
    try:  # an agent's JSON has no NaN or Infinity; --json and the audit row would pass them on
        json.dumps(answer, allow_nan=False)
    except ValueError:
        raise NotAnAgent(
            f"{url} answered {action} with NaN or Infinity: not a kvctl agent's answer"
        ) from None
    return answer


@dataclass(slots=True)
class ActionReport:
    request: ActionRequest
    results: list[NodeResult[dict[str, Any]]] = field(default_factory=list)

    @property
    def failed(self) -> list[NodeResult[dict[str, Any]]]:
        return [r for r in self.results if not r.ok]

    @property
    def ok(self) -> bool:
        return not self.failed

    def missing_notes(self) -> list[str]:
        """One line per node where chunks a keyed action named are not cached there: the
        action succeeded (exit 0, as documented) but did nothing for them, which a script would
        not see in "ok"."""
        chunks = self.request.chunks
        if chunks is None:
            return []
        action = self.request.action
        notes = []
        for r in self.results:
            v = r.value or {}
            if not r.ok:
                continue
            missing, keys = int(v.get("missing", 0)), int(v.get("keys", 0))
            where = f"kvctl lookup --node {r.node.name}"
            if chunks.tokens is not None and keys == 0:
                notes.append(
                    f"{r.node.name}: the prompt makes no full chunk there: nothing to {action}; "
                    f"`{where} --text ...` shows its chunks"
                )
            elif missing:
                shows = (
                    f"`{where} --text ...` shows what is"
                    if chunks.tokens is not None
                    else f"the keys may be another model's: `{where} --text ...` shows the "
                    "keys it has for a prompt"
                )
                notes.append(
                    f"{r.node.name}: {missing} of {keys} chunk(s) not cached there: nothing to "
                    f"{action} for them; {shows}"
                )
        return notes

    def as_dict(self) -> dict[str, Any]:
        return {
            "action": self.request.action,
            "args": self.request.audit_args(),
            "ok": self.ok,
            "nodes": [r.as_dict() for r in self.results],
            "failed": [r.node.name for r in self.failed],
        }


class ActionInterrupted(KeyboardInterrupt):
    """A Ctrl-C ended an action. ``unrecorded`` names the nodes asked whose outcome the audit
    trail lacks: a second Ctrl-C stopped a write stuck on a lock, or a write after the Ctrl-C
    failed (a full disk). They may have acted all the same, and `kvctl audit` cannot say so."""

    def __init__(self, unrecorded: list[str]) -> None:
        super().__init__(unrecorded)
        self.unrecorded = unrecorded


def run_action(
    engine: Engine,
    nodes: Sequence[NodeInfo],
    request: ActionRequest,
    *,
    token: str | None = None,
    timeout_s: float = 10.0,
    on_result: Callable[[NodeResult[dict[str, Any]]], None] | None = None,
    actor: str | None = None,
) -> ActionReport:
    """Run ``request`` on every node concurrently. Each node's outcome is committed to the
    audit trail as soon as it arrives, so a CLI killed halfway leaves the finished nodes
    recorded."""
    args = request.audit_args()
    recorded: set[str] = set()

    def audited(res: NodeResult[dict[str, Any]]) -> None:
        with engine.begin() as conn:
            record(
                conn,
                action=request.action,
                target=res.node.name,
                args=args,
                ok=res.ok,
                result=res.value if res.ok else res.error or "",
                actor=actor,
            )
        recorded.add(res.node.name)
        if on_result is not None and not res.unanswered:  # audited, but it did not answer
            on_result(res)

    #: the agent URLs asked: an audit write failing stops the fan-out, and those not recorded
    #: acted all the same, which the error must say (it read as if nothing had been done)
    asked: list[str] = []

    def call(client: AgentClient) -> dict[str, Any]:
        asked.append(client.url)
        return request.call(client)

    def unrecorded() -> list[str]:
        urls = set(asked)
        return [n.name for n in nodes if n.agent_url.rstrip("/") in urls and n.name not in recorded]

    try:
        results = fan_out(
            nodes,
            call,
            token=token,
            timeout_s=timeout_s,
            on_result=audited,
            # a keyed action makes two calls (its keys, then the action); each bounded as one
            # read, so an agent whose answer trickles does not hold the whole fan-out. One cut
            # off may still act, as one the client's own timeout cuts off may
            deadline_s=2 * read_deadline_s(timeout_s),
        )
    except KeyboardInterrupt as exc:
        raise ActionInterrupted(unrecorded()) from exc
    except SQLAlchemyError as exc:
        names = unrecorded()
        reason = driver_message(exc)
        raise DatabaseError(
            f"the audit trail cannot be written ({reason}): {len(names)} node(s) were asked "
            f"to {request.action} all the same and are not recorded: {', '.join(names)}; the "
            "nodes not yet asked were left alone"
        ) from exc
    return ActionReport(request, results)
