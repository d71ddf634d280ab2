"""The audit trail: one row per action an operator's kvctl took (who, when, what, on which
target, with which arguments, and how it ended)."""

from __future__ import annotations

import getpass
import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from kvctl import json_text
from kvctl.db.models import Audit
from kvctl.db.sample_checks import shown
from kvctl.errors import InvalidArgument

#: argument names whose values never reach the audit table: ``token``, ``agent_token``,
#: ``db_password``... (not ``tokens``, a prompt's token count)
_SECRET_NAME = re.compile(r"(^|_)(token|password|passwd|secret|api_key|credentials?)$", re.I)
#: a URL's user and password (``scheme://USER:PASSWORD@host``): the inventory refuses such
#: URLs, but the refused attempt is audited, with the URL in its args and often its message.
#: Up to the authority's last '@' (a password may hold one, as URL parsers read it), and also
#: at the start of text without a scheme (``USER:PASSWORD@host:port``, refused for that)
_URL_USERINFO = re.compile(r"(?:(?<=://)|^(?=[^/?#\s'\"@]*:))[^/?#\s'\"]*@")
#: results longer than this are cut (a fan-out over hundreds of nodes stays one row per node)
MAX_RESULT_CHARS = 4000
#: the inventory's changes (`kvctl fleet ...`) as the trail names them; the control actions are
#: ``kvctl.fleet.actions.ACTIONS``
INVENTORY_ACTIONS = ("fleet.add-dc", "fleet.add-node", "fleet.add-link", "fleet.rm", "fleet.import")


@dataclass(frozen=True, slots=True)
class AuditEntry:
    id: int
    ts_ms: int
    actor: str
    action: str
    target: str
    args: dict[str, Any]
    ok: bool
    result: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def current_actor() -> str:
    """``$KVCTL_ACTOR`` when set (a bastion's wrapper names the person), else user@host."""
    if actor := os.environ.get("KVCTL_ACTOR"):
        return actor[:128]
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"[:128]


def redact(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with the values of secret-looking names replaced, and any URL's user and
    password."""
    return {k: "<redacted>" if _SECRET_NAME.search(k) else _unsecret(v) for k, v in args.items()}


def _unsecret(value: Any) -> Any:
    """Text with every URL's ``user:password@`` replaced; anything else as it is."""
    return _URL_USERINFO.sub("<redacted>@", value) if isinstance(value, str) else value


def record(
    conn: Connection,
    *,
    action: str,
    target: str,
    args: dict[str, Any],
    ok: bool,
    result: Any = "",
    actor: str | None = None,
    ts_ms: int | None = None,
) -> int:
    """Write one audit row; ``result`` may be text or anything JSON can hold."""
    text = result if isinstance(result, str) else json.dumps(result, default=str, sort_keys=True)
    # NUL (PostgreSQL refuses it) and lone surrogates (SQLite's driver cannot encode them) from
    # a node's garbage answer quoted in its error would fail the write, stopping the fan-out
    text = shown(_unsecret(text))
    if len(text) > MAX_RESULT_CHARS:
        text = text[: MAX_RESULT_CHARS - 3] + "..."
    return conn.execute(
        Audit.__table__.insert()
        .values(
            ts_ms=int(time.time() * 1000) if ts_ms is None else ts_ms,
            actor=shown(actor or current_actor()),
            action=shown(action)[:64],
            target=shown(target)[:255],
            args=json.dumps(redact(args), default=str, sort_keys=True),  # NUL escaped: \u0000
            ok=ok,
            result=text,
        )
        .returning(Audit.id)
    ).scalar_one()


def check_action(conn: Connection, action: str) -> None:
    """Refuse a filter that no action kvctl records (nor any row recorded) could match: a typo
    would otherwise read as an empty trail. ``fleet.`` (ending in a dot) is a prefix."""
    from kvctl.fleet.actions import ACTIONS  # that module records through this one

    a = Audit.__table__.c
    known = {*ACTIONS, *INVENTORY_ACTIONS, *conn.execute(select(a.action).distinct()).scalars()}
    if action in known or (action.endswith(".") and any(k.startswith(action) for k in known)):
        return
    raise InvalidArgument(
        f"unknown action {action!r}; one of {', '.join(sorted(known))}, or a prefix ending in "
        "'.' such as 'fleet.'"
    )


def recent(
    conn: Connection,
    *,
    limit: int = 50,
    action: str | None = None,
    target: str | None = None,
    since_ms: int | None = None,
    ok: bool | None = None,
) -> list[AuditEntry]:
    """The newest rows first, optionally only one action (``pin``, or a prefix: ``fleet.``),
    one target, since a time, or only those that succeeded (``ok=True``) or failed."""
    a = Audit.__table__.c
    q = select(a).order_by(a.ts_ms.desc(), a.id.desc()).limit(limit)
    if action is not None:
        q = q.where(a.action.startswith(action) if action.endswith(".") else a.action == action)
    if target is not None:
        q = q.where(a.target == target)
    if since_ms is not None:
        q = q.where(a.ts_ms >= since_ms)
    if ok is not None:
        q = q.where(a.ok.is_(ok))
    return [
        AuditEntry(r.id, r.ts_ms, r.actor, r.action, r.target, _args(r.args), r.ok, r.result)
        for r in conn.execute(q)
    ]


def _args(stored: str) -> dict[str, Any]:
    """A row's args as recorded (a JSON object); a row written otherwise (by hand, another
    tool) says it cannot be read instead of failing the whole listing: JSON nested thousands
    deep raised RecursionError out of ``kvctl audit``."""
    try:
        value = json_text.loads(stored)
    except json_text.NestedTooDeep:
        return {"unreadable": "JSON nested too deep"}
    except ValueError:
        return {"unreadable": "not JSON"}
    return value if isinstance(value, dict) else {"args": value}
