"""One call to many agents at once: concurrent, each with its own deadline, one result per node
whether it answered or not."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvctl.client import (
    AgentClient,
    AgentError,
    AgentNotAnswering,
    AgentStarting,
    AuthError,
)
from kvctl.daemon_pool import DaemonPool
from kvctl.db.inventory import NodeInfo
from kvctl.deadline_transport import Abandonable, AbandonableTransport, running
from kvctl.errors import KvctlError
from kvctl.interrupts import ForcedInterrupt, interrupts_held, wait_interruptibly

T = TypeVar("T")

#: at most this many agents are asked at the same time
DEFAULT_CONCURRENCY = 32


@dataclass(frozen=True, slots=True)
class NodeResult(Generic[T]):
    node: NodeInfo
    ok: bool
    value: T | None
    error: str | None
    elapsed_s: float
    #: the agent answered, so it is up, but refused the token (or needed one): not down
    auth_refused: bool = False
    #: it took the connection and said nothing in time (hung, overloaded): not answering,
    #: which "down, start it" would misdescribe
    silent: bool = False
    #: asked, but a second Ctrl-C ended the wait for its answer: whether it acted is unknown
    unanswered: bool = False
    #: (silent too) its call ran past the fan-out's deadline: hung, or its answer trickled
    overdue: bool = False
    #: it answered that it is starting (opening its tiers): up, and serving shortly, not down
    starting: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node.name,
            "dc": self.node.dc,
            "ok": self.ok,
            "result": self.value,
            "error": self.error,
            "elapsed_s": self.elapsed_s,
        }


def fan_out(
    nodes: Sequence[NodeInfo],
    call: Callable[[AgentClient], T],
    *,
    token: str | None = None,
    timeout_s: float = 5.0,
    concurrency: int = DEFAULT_CONCURRENCY,
    on_result: Callable[[NodeResult[T]], None] | None = None,
    clients: ClientPool | None = None,
    deadline_s: float | None = None,
) -> list[NodeResult[T]]:
    """Run ``call`` against each node's agent concurrently; results come back in the order of
    ``nodes``. ``on_result`` sees each as it finishes (a progress bar). Agent errors (down,
    refused token, 4xx/5xx) are results, not exceptions. With ``clients``, connections are
    kept open between calls (a live view polling every few seconds).

    ``timeout_s`` bounds each wait of the client (connecting, each read), not a whole answer:
    one trickling a byte at a time never times out. ``deadline_s`` bounds each node's call
    from its start: one still running then is a silent failure, and its connection is shut
    down, so its thread is free for the nodes queued behind it (an action cut off so may
    still act, as one its client's timeout cut off may). Not with ``clients``: a connection
    kept open between calls is not one a call is seen opening, so it cannot be cut; such a
    call ends on its own thread."""

    def one(i: int, node: NodeInfo) -> NodeResult[T]:
        t0 = started[i] = time.perf_counter()
        try:
            if clients is not None:
                client = clients.get(node.agent_url)
            else:
                transport = None
                if deadline_s is not None:
                    # its connections are cut when its call is given up at its deadline (all
                    # opened by this call: kept alive between its requests, as before)
                    https = node.agent_url.startswith("https://")
                    transport = AbandonableTransport(verify=https, keep_alive=True)
                client = AgentClient(
                    node.agent_url, token=token, timeout_s=timeout_s, transport=transport
                )
        except Exception as exc:  # a bad URL in the inventory: this node's failure, no other's
            return NodeResult(node, False, None, _reason(exc), time.perf_counter() - t0)
        try:
            with running(calls[i]):
                value = call(client)
        except Exception as exc:  # down, refused, or not an agent at all (HTML, bad JSON)
            elapsed_s = time.perf_counter() - t0
            if calls[i].abandoned and deadline_s is not None:
                # its connection cut at the deadline, not lost: overdue, as first reported
                # (a Ctrl-C that beat that report reports this one)
                return _overdue(node, deadline_s, elapsed_s)
            refused = isinstance(exc, AuthError)
            reason = _reason(exc)
            return NodeResult(
                node,
                False,
                None,
                reason,
                elapsed_s,
                refused,
                isinstance(exc, AgentNotAnswering),
                starting=isinstance(exc, AgentStarting),
            )
        finally:
            if clients is None:
                client.close()
        return NodeResult(node, True, value, None, time.perf_counter() - t0)

    results: dict[int, NodeResult[T]] = {}
    #: when each node was asked (by its index), for its deadline and for a node a second Ctrl-C
    #: leaves unanswered
    started: dict[int, float] = {}
    #: each node's call, abandoned (its connections shut down) once past its deadline
    calls = [Abandonable() for _ in nodes]
    if not nodes:
        return []
    pool = DaemonPool(max(1, min(concurrency, len(nodes))), "kvctl-fanout")
    futures: dict[Future[NodeResult[T]], int] = {}
    #: answers ``on_result`` took in full: a Ctrl-C between an answer's arrival and its
    #: report must not leave it unreported
    reported: set[int] = set()
    try:
        # every node queued before a Ctrl-C is taken: then it cancels the nodes not yet asked
        # and waits for (and reports) those that were, none asked unseen
        with interrupts_held():
            for i, node in enumerate(nodes):
                futures[pool.submit(one, i, node)] = i
        for fut, res in _as_answered(nodes, futures, started, deadline_s, calls):
            results[futures[fut]] = res
            if on_result is not None:
                with interrupts_held():  # a report torn halfway is lost, or written twice
                    on_result(res)
                    reported.add(futures[fut])
    except BaseException as exc:
        # on_result failed (the audit trail cannot be written) or Ctrl-C: nodes not yet asked
        # must not be acted on unrecorded
        if not isinstance(exc, KeyboardInterrupt):
            for fut in futures:
                fut.cancel()  # those not yet asked; a call under way runs on
            # every answer is in, left unreported: the trail cannot be written
            _wait_unreported(futures, reported, started, deadline_s)
            raise
        if on_result is None or isinstance(exc, ForcedInterrupt):
            # read-only: nothing to report or audit, so no agent is waited for (a hung one
            # would hold the Ctrl-C for the whole timeout); the calls end on daemon threads.
            # Forced (Ctrl-C again while a report was stuck): the operator will not wait, and
            # another report would be stuck the same way
            for fut in futures:
                fut.cancel()
            raise
        try:
            for fut in futures:
                fut.cancel()
            # the nodes asked act all the same: their answers are reported (one still
            # trickling at its deadline is reported as unanswered below)
            _wait_unreported(futures, reported, started, deadline_s)
        except KeyboardInterrupt:
            # a second Ctrl-C: the operator will not wait. The nodes still asking are reported
            # as unanswered below, so the audit trail has a row for every node asked, not none
            pass
        _report_rest(nodes, futures, reported, started, on_result)
        raise
    finally:
        # a call past its deadline (one a Ctrl-C or a failed report did not wait for) lets go
        # of its thread too; one still within it (a second Ctrl-C) ends on its own
        if deadline_s is not None:
            now = time.perf_counter()
            for fut, end_s in _ends_s(futures, futures, started, deadline_s).items():
                if end_s <= now and not fut.done():
                    calls[futures[fut]].abandon()
        pool.shutdown()  # its threads end with their calls
    return [results[i] for i in range(len(nodes))]


def _ends_s(
    futures: dict[Future[NodeResult[T]], int],
    of: Iterable[Future[NodeResult[T]]],
    started: dict[int, float],
    deadline_s: float,
) -> dict[Future[NodeResult[T]], float]:
    """The deadline (``time.perf_counter``) of each call of ``of`` asked so far; one still
    queued has none yet."""
    return {f: started[futures[f]] + deadline_s for f in of if futures[f] in started}


def _wait_unreported(
    futures: dict[Future[NodeResult[T]], int],
    reported: set[int],
    started: dict[int, float],
    deadline_s: float | None,
) -> None:
    """Wait for the calls whose answers are not reported yet (one reported already, past its
    deadline, is not waited for), none past its own deadline (``_left_s``)."""
    unreported = [f for f, i in futures.items() if i not in reported]
    wait_interruptibly(unreported, _left_s(futures, unreported, started, deadline_s))


def _left_s(
    futures: dict[Future[NodeResult[T]], int],
    waited: Sequence[Future[NodeResult[T]]],
    started: dict[int, float],
    deadline_s: float | None,
) -> float | None:
    """How long the calls of ``waited`` may still run: to the latest deadline of those asked
    (None: no deadline, each ends with its client's timeouts). Without it, a node trickling
    its answer held a Ctrl-C, or a failed audit write, for as long as the trickle lasted."""
    if deadline_s is None:
        return None
    ends_s = _ends_s(futures, waited, started, deadline_s).values()
    return max(0.0, max(ends_s) - time.perf_counter()) if ends_s else 0.0


def read_deadline_s(timeout_s: float) -> float:
    """The deadline of one read-only call whose client waits ``timeout_s``: connecting and
    the answer's first byte each get that long, so the client's own timeouts (down, hung)
    come first and keep their diagnosis; only a trickle runs past it."""
    return 2 * timeout_s


def _as_answered(
    nodes: Sequence[NodeInfo],
    futures: dict[Future[NodeResult[T]], int],
    started: dict[int, float],
    deadline_s: float | None,
    calls: Sequence[Abandonable],
) -> Iterator[tuple[Future[NodeResult[T]], NodeResult[T]]]:
    """Each node's result as it comes, or (``deadline_s``) a silent failure for one whose call
    has run that long: the fan-out is not held by it, and its call is abandoned, so its thread
    is free for a node queued behind it."""
    pending = set(futures)
    if deadline_s is None:
        while pending:
            done, pending = wait_interruptibly(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                yield fut, fut.result()
        return
    while pending:
        # up to the next deadline of a node asked (one still queued waits its turn)
        ends_s = _ends_s(futures, pending, started, deadline_s).values()
        now = time.perf_counter()
        done, pending = wait_interruptibly(
            pending,
            max(0.0, min(ends_s) - now) if ends_s else deadline_s,
            return_when=FIRST_COMPLETED,
        )
        for fut in done:
            yield fut, fut.result()
        now = time.perf_counter()
        for fut, end_s in _ends_s(futures, list(pending), started, deadline_s).items():
            i = futures[fut]
            # (one that answered since the wait ended is taken on the next turn)
            if end_s <= now and not fut.done():
                # cut before it is reported: a thread of the pool is free for the next node
                # even while the report (an audit write) runs
                calls[i].abandon()
                pending.discard(fut)
                yield fut, _overdue(nodes[i], deadline_s, now - started[i])


def _overdue(node: NodeInfo, deadline_s: float, elapsed_s: float) -> NodeResult[T]:
    """The result of a node whose call ran past its deadline."""
    error = (
        f"{node.agent_url} did not answer in full within {deadline_s:g} s: hung, "
        "overloaded, or its answer trickles"
    )
    return NodeResult(node, False, None, error, elapsed_s, silent=True, overdue=True)


#: the error of a node asked whose answer a second Ctrl-C did not wait for
UNANSWERED = "interrupted before it answered: whether it acted is unknown"


def _report_rest(
    nodes: Sequence[NodeInfo],
    futures: dict[Future[NodeResult[T]], int],
    reported: set[int],
    started: dict[int, float],
    on_result: Callable[[NodeResult[T]], None],
) -> None:
    """After a Ctrl-C, report every node asked and not yet reported: its answer, or (a call
    still under way) that it did not answer. All in one held block: the writes are quick, and
    a Ctrl-C between two of them would leave the rest unrecorded."""
    now = time.perf_counter()
    with interrupts_held():
        for fut, i in futures.items():
            if i in reported or fut.cancelled():  # reported, or never asked
                continue
            if fut.done():
                res = fut.result()
            else:
                elapsed_s = now - started.get(i, now)
                res = NodeResult(nodes[i], False, None, UNANSWERED, elapsed_s, unanswered=True)
            try:
                on_result(res)
            except Exception:  # the audit trail failing: the Ctrl-C still goes on
                break


class ClientPool:
    """One open :class:`AgentClient` per agent URL, reused across fan-outs; thread-safe."""

    def __init__(self, *, token: str | None = None, timeout_s: float = 5.0) -> None:
        self.token, self.timeout_s = token, timeout_s
        self._clients: dict[str, AgentClient] = {}
        self._lock = threading.Lock()

    def get(self, url: str) -> AgentClient:
        with self._lock:
            client = self._clients.get(url)
            if client is None:
                client = AgentClient(url, token=self.token, timeout_s=self.timeout_s)
                self._clients[url] = client
            return client

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()


def _reason(exc: Exception) -> str:
    """Agent errors carry their own sentence; anything else is named by its type."""
    if isinstance(exc, AgentError | KvctlError | OSError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
