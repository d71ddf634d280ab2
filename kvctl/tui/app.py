"""The `kvctl top` Textual app: one factory (:func:`create_app`) for the CLI and the tests.

Polls run in a thread worker, one at a time: a tick that finds the previous poll still running
is counted as late and skipped, so a slow fleet never queues work or freezes the keyboard. A
poll waits for the agents' answers :data:`POLL_WAIT_SHARE` of the interval at most: a hung
agent shows as not answering and the others refresh on time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ClassVar

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from textual import work
from textual.app import App
from textual.binding import Binding, BindingType

from kvctl.db.engine import NoDatabaseFile, driver_message, follow_the_path
from kvctl.db.inventory import NodeInfo
from kvctl.fleet.actions import ActionReport, ActionRequest
from kvctl.tui.cells import Cells, Palette
from kvctl.tui.model import FleetView, Sampler, Thresholds
from kvctl.tui.sources import Source

#: a poll waits for the agents' answers this share of the interval at most; the rest is for
#: the database's part of the poll and drawing
POLL_WAIT_SHARE = 0.6


class TopApp(App[None]):
    TITLE = "kvctl top"
    CSS_PATH = "top.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
    ]

    def __init__(
        self,
        source: Source,
        *,
        interval_s: float = 2.0,
        readonly: bool = False,
        audit_engine: Engine | None = None,
        actor: str | None = None,
        thresholds: Thresholds | None = None,
        auto_poll: bool = True,
    ) -> None:
        super().__init__()
        self.source = source
        self.interval_s = interval_s
        self.readonly = readonly
        if audit_engine is not None:
            # a SQLite file moved away or replaced while top runs (`mv metrics.db*`, a backup
            # restored over the path): its pooled connection wrote the audit rows into the file
            # it had opened, no longer at the path, said "done (audited)". Followed, an action
            # finds no file there (and is refused, below), and a file put there is written
            follow_the_path(audit_engine, "kvctl top")
        self.audit_engine = audit_engine
        self.actor = actor
        self.thresholds = thresholds or Thresholds()
        self.auto_poll = auto_poll
        self.sampler = Sampler(max_gap_s=3 * interval_s)
        self.view: FleetView | None = None
        #: polls applied to the screen, ticks skipped because a poll was still running
        self.refreshes = 0
        self.late_ticks = 0
        self.paused = False
        self.poll_error: str | None = None
        self._polling = False
        self.actions_done: list[ActionReport] = []

    @property
    def watches_router(self) -> bool:
        """Whether the view reads a router (known from the first poll on)."""
        return self.view is not None and self.view.routing is not None

    # --- theme-aware cells ---------------------------------------------------------------------
    def cells(self) -> Cells:
        return Cells(Palette.from_variables(self.get_css_variables()), self.thresholds)

    # --- lifecycle -----------------------------------------------------------------------------
    def on_mount(self) -> None:
        from kvctl.tui.fleet_screen import FleetScreen

        self.push_screen(FleetScreen())
        if self.auto_poll:
            self.set_interval(self.interval_s, self.tick)
            self.tick()

    def on_unmount(self) -> None:
        self.source.close()

    def tick(self) -> None:
        """Start a poll unless one is running (then this tick is late) or the view is paused."""
        if self.paused:
            return
        if self._polling:
            self.late_ticks += 1
            return
        self._polling = True
        self._poll()

    @work(thread=True, group="poll", exit_on_error=False)
    def _poll(self) -> None:
        try:
            view = self.sampler.update(self.source.poll(self.interval_s * POLL_WAIT_SHARE))
        except Exception as exc:  # the database went away: say so, keep the last view
            self.from_thread(self._poll_failed, f"{type(exc).__name__}: {exc}")
            return
        self.from_thread(self._apply, view)

    def from_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run ``fn`` on the app's loop from a worker thread; nothing once the app closed."""
        with contextlib.suppress(RuntimeError):
            self.call_from_thread(fn, *args, **kwargs)

    def _apply(self, view: FleetView) -> None:
        self._polling = False
        self.poll_error = None
        self.view = view
        self.refreshes += 1
        try:
            self._show(view)
        except Exception as exc:  # a drawing bug must not stop the polls
            msg = f"{type(exc).__name__}: {exc}"
            self.notify(msg, title="cannot draw", severity="error", markup=False)

    def _show(self, view: FleetView) -> None:
        for screen in self.screen_stack:
            show = getattr(screen, "show_view", None)
            if show is not None:
                show(view)

    def _poll_failed(self, error: str) -> None:
        self._polling = False
        self.poll_error = error
        self.notify(error, title="poll failed", severity="error", timeout=5, markup=False)
        if self.view is not None:
            self._show(self.view)

    # --- actions -------------------------------------------------------------------------------
    def action_help(self) -> None:
        from kvctl.tui.dialogs import HelpScreen

        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def refuse_readonly(self, what: str) -> bool:
        """True (and a notice) when actions are off: --readonly, or no audit trail at hand."""
        if self.readonly:
            self.notify(
                f"{what}: read-only view (started with --readonly)",
                title="action refused",
                severity="warning",
            )
            return True
        if self.audit_engine is None:
            self.notify(
                f"{what}: no database to audit it in (--db)",
                title="action refused",
                severity="error",
            )
            return True
        return False

    def request_action(self, node: NodeInfo, request: ActionRequest, detail: str) -> None:
        """Ask for confirmation, then run ``request`` on ``node`` through the same library
        code as the CLI (which writes the audit row)."""
        from kvctl.tui.dialogs import ConfirmScreen

        if self.refuse_readonly(request.action):
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self._run_action(node, request)
            else:
                self.notify(f"{request.action} cancelled: nothing done", timeout=3)

        self.push_screen(ConfirmScreen(node, request, detail, self.actor or ""), confirmed)

    def tier_action(self, node: NodeInfo, action: str, tier: str | None = None) -> None:
        """Flush or resize: choose the tier (and size), then confirm, then run."""
        from kvctl.tui.dialogs import TierDialog

        if self.refuse_readonly(action):
            return
        row = None if self.view is None else self.view.row(node.name)
        tiers = list(row.tiers) if row is not None and row.up else []
        if not tiers:
            # a node shown up but unread has tiers it cannot tell yet: not "is it down?"
            if row is not None and row.starting:
                why = "is starting: its tiers are still opening; try again once it is up"
            elif row is not None and row.auth_refused:
                why = "refused the token: its tiers cannot be read (KVCTL_TOKEN)"
            else:
                why = "reports no tiers (is it down?)"
            self.notify(f"{node.name} {why}", severity="warning")
            return
        self.push_screen(
            TierDialog(node, action, tiers, tier),
            lambda req: None if req is None else self.request_action(node, req, ""),
        )

    @work(thread=True, group="action", exit_on_error=False)
    def _run_action(self, node: NodeInfo, request: ActionRequest) -> None:
        from kvctl.fleet.actions import run_action

        assert self.audit_engine is not None
        try:
            # the audit row is written once the agent answered: a database that cannot be
            # reached now (its file moved away, its server down) refuses the action before
            # the agent is asked, rather than leave it acted and not audited
            with self.audit_engine.connect():
                pass
        except SQLAlchemyError as exc:
            # the way out: a file moved away is not made again here (its rows would be lost
            # to a restore over it), so the operator is told to put one back
            way_out = (
                "; put the database file back at that path to act (audited there at once)"
                if isinstance(getattr(exc, "orig", None), NoDatabaseFile)
                else ""
            )
            self.from_thread(
                self.notify,
                f"{request.action} on {node.name}: nothing done, the audit trail cannot be "
                f"written: {driver_message(exc)}{way_out}",
                title="action refused",
                severity="error",
                timeout=30,
                markup=False,
            )
            return
        try:
            report = run_action(
                self.audit_engine, [node], request, token=self.source.token, actor=self.actor
            )
        except Exception as exc:
            # the audit row is written after the agent answers: the action may have run
            self.from_thread(
                self.notify,
                f"{request.action} on {node.name} may have run, but its audit row could not be "
                f"written: {exc}",
                title="NOT AUDITED",
                severity="error",
                timeout=30,
                markup=False,
            )
            return
        self.from_thread(self._action_done, report)

    def _action_done(self, report: ActionReport) -> None:
        self.actions_done.append(report)
        res = report.results[0]
        what = f"{report.request.action} on {res.node.name}"
        if res.ok:
            figures = ", ".join(f"{k} {v}" for k, v in (res.value or {}).items() if k != "usage")
            self.notify(f"{what}: {figures}", title="done (audited)", timeout=5, markup=False)
        else:
            self.notify(
                f"{what} failed: {res.error}",
                title="failed (audited)",
                severity="error",
                markup=False,
            )
        for screen in self.screen_stack:
            after = getattr(screen, "after_action", None)
            if after is not None:
                after()
        self.tick()


def create_app(
    source: Source,
    *,
    interval_s: float = 2.0,
    readonly: bool = False,
    audit_engine: Engine | None = None,
    actor: str | None = None,
    thresholds: Thresholds | None = None,
    auto_poll: bool = True,
    theme: str | None = None,
) -> TopApp:
    """The live view on ``source``. Actions need ``audit_engine`` (their audit trail) and are
    refused with ``readonly``; ``auto_poll=False`` leaves polling to the caller (tests)."""
    if interval_s <= 0:
        raise ValueError(f"the refresh interval must be positive, got {interval_s}")
    if actor is None:
        from kvctl.fleet.audit import current_actor

        actor = current_actor()
    app = TopApp(
        source,
        interval_s=interval_s,
        readonly=readonly,
        audit_engine=audit_engine,
        actor=actor,
        thresholds=thresholds,
        auto_poll=auto_poll,
    )
    if theme is not None:
        if theme not in app.available_themes:
            known = ", ".join(sorted(app.available_themes))
            raise ValueError(f"unknown theme {theme!r}; one of {known}")
        app.theme = theme
    return app
