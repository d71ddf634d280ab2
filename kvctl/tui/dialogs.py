"""Modal dialogs of `kvctl top`: confirm an action, choose a tier (and a size), and help."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, Label, Select, Static

from kvctl.db.inventory import NodeInfo
from kvctl.errors import KvctlError
from kvctl.fleet.actions import ActionRequest


def describe(node: NodeInfo, request: ActionRequest) -> str:
    args = ", ".join(f"{k}={v}" for k, v in request.audit_args().items())
    return f"{request.action} on {node.name} ({node.dc})" + (f": {args}" if args else "")


class ConfirmScreen(ModalScreen[bool]):
    """Yes or no for one action; Escape and `n` are no."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, node: NodeInfo, request: ActionRequest, detail: str, actor: str) -> None:
        super().__init__()
        self.node, self.request, self.detail, self.actor = node, request, detail, actor

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(f"Run {self.request.action}?", id="dialog-title")
            yield Static(describe(self.node, self.request))
            if self.detail:
                yield Static(self.detail)
            yield Static(f"Recorded in the audit trail as {self.actor}.", classes="muted")
            with Horizontal(id="buttons"):
                yield Button(f"Yes, {self.request.action} (y)", id="yes", variant="error")
                yield Button("Cancel (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()  # a stray Enter must not act

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class TierDialog(ModalScreen[ActionRequest | None]):
    """Pick the tier to flush (dropping or demoting) or resize (with the new size)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(
        self, node: NodeInfo, action: str, tiers: list[str], tier: str | None = None
    ) -> None:
        super().__init__()
        self.node, self.action, self.tiers = node, action, tiers
        self.tier = tier if tier in tiers else tiers[0]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(f"{self.action} a tier of {self.node.name}", id="dialog-title")
            yield Select(
                [(t, t) for t in self.tiers], value=self.tier, allow_blank=False, id="tier"
            )
            if self.action == "resize":
                yield Input(placeholder="new capacity, e.g. 8GiB", id="size")
            else:
                yield Checkbox("demote to the next tier instead of dropping", id="demote")
            yield Static("", id="error", classes="error")
            with Horizontal(id="buttons"):
                yield Button("Next", id="ok", variant="primary")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        if self.action == "resize":
            self.query_one("#size", Input).focus()

    def _request(self) -> ActionRequest | None:
        tier = str(self.query_one("#tier", Select).value)
        try:
            if self.action == "resize":
                size = self.query_one("#size", Input).value.strip()
                return ActionRequest("resize", tier=tier, size=size or None)
            demote = self.query_one("#demote", Checkbox).value
            return ActionRequest("flush", tier=tier, demote=demote)
        except KvctlError as exc:
            self.query_one("#error", Static).update(str(exc))
            return None

    def on_input_submitted(self, _event: Input.Submitted) -> None:
        self._submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
        else:
            self._submit()

    def _submit(self) -> None:
        request = self._request()
        if request is not None:
            self.dismiss(request)

    def action_cancel(self) -> None:
        self.dismiss(None)


HELP = """\
[b]kvctl top[/b]: the fleet live. Figures are over the last 15 polls (30 s at the default 2 s
interval); the agents' counters since start show on a node's page.

[b]Fleet[/b]
  ↑ ↓ PgUp PgDn  move            Enter   open the node
  s / S          sort by the next column / reverse (or click a header)
  /              filter: words, dc:NAME, node:NAME, up, down, !word   Esc clears
  g              group by DC (a header row with the DC's totals)
  f / z          flush / resize a tier of the selected node (asks first)
  p              pause (figures freeze; keys still work)      r  poll now

[b]Node[/b]
  1 / 2 / 3      Events / Top prefixes / Pinned (Tab moves the focus)
  p / u / e      pin / unpin / evict the selected chunk (asks first)
  f / z          flush / resize the selected tier (asks first)
  Esc            back to the fleet

[b]Everywhere[/b]  ?  this help    q  quit

[b]Reading it[/b]
  HIT        chunk hit ratio of the recent window; idle = no lookups; TREND: per poll
  HITS R/S   share of the hits (not per lookup): reuse of the tenant's own chunks /
             sharing of other tenants' (JSON: reuse_/sharing_share_of_hits)
  GPU CPU…   tier occupancy; bold from 85 %, reversed from 95 %
  EVICT/s    chunks leaving the node; I/O: tier bytes read + written per second
  RTT        slowest link from the node's DC (collectors' probes, last 15 min)
             emu: with an agent-emulated delay in it; mix: in some probes
  POWER      NVML board power of the node's GPUs; N/A without NVML
  Bold is a warning and reversed is critical in every theme; N/A is dim.
  Every action is written to the audit trail (`kvctl audit`); --readonly refuses them.
"""


ROUTING_HELP = """\
[b]Routing[/b] (with --router)
  ROUTED/s   decisions per second the router sent to the node (recent window)
  TO HOLDER  of those, the share sent there because the node held part of the prefix
  The routing lines: the router's counts since it started (index hits, chunks reused
  locally or pulled, tokens fetched vs prefilled, bytes pulled per DC link) and the rates now.
  "router down" and N/A: the router did not answer this poll.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q,question_mark", "close", "Close"),
    ]

    def compose(self) -> ComposeResult:
        from kvctl.tui.app import TopApp

        with VerticalScroll(id="help"):
            yield Static(HELP)
            if isinstance(self.app, TopApp) and self.app.watches_router:
                yield Static(ROUTING_HELP)

    def action_close(self) -> None:
        self.dismiss(None)
