"""Options and database access shared by command modules, so each flag reads the same everywhere."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, get_type_hints

import typer

from kvctl.cli.output import fail, user_errors

if TYPE_CHECKING:
    from kvctl.db.inventory import NodeInfo
    from kvctl.fleet.actions import ChunkSelection

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]
DbOpt = Annotated[
    str | None,
    typer.Option(
        "--db",
        help="Database URL (default: $KVCTL_DB_URL, else a SQLite file in ~/.local/state/kvctl).",
        show_default=False,
    ),
]
DB_HINT = "set KVCTL_DB_URL or --db; `kvctl db current` shows which database is used"


#: what to check when the database named is the one meant but does not answer
DB_SERVER_HINT = (
    "check that its server is up, and the URL's host, port, user and database name (--db or "
    "$KVCTL_DB_URL)"
)
#: the same for a SQLite file, which has no server: a file that is no database, a directory
DB_FILE_HINT = (
    "check the URL's path (--db or $KVCTL_DB_URL): a SQLite database file kvctl can read and "
    "write, or none yet (`kvctl db upgrade` creates it)"
)


def db_server_hint(url: str) -> str:
    """What to check of ``url`` when it does not answer: its server's address, or the file
    of a SQLite URL (whose 'file is not a database' was told to check that its server is up)."""
    return DB_FILE_HINT if url.startswith("sqlite") else DB_SERVER_HINT


@contextmanager
def db_errors(hint: str = DB_HINT, *, url: str | None = None) -> Iterator[None]:
    """The database's failures as one line with a hint, never a traceback; with ``url``, the
    line names the database (its password masked)."""
    from sqlalchemy.exc import SQLAlchemyError

    from kvctl.db.engine import DatabaseError, display_url, driver_message

    try:
        yield
    except DatabaseError as exc:
        fail(str(exc), hint=getattr(exc, "hint", None) or hint)
    except SQLAlchemyError as exc:
        what = f"cannot use {display_url(url)}" if url else "database error"
        fail(f"{what}: {driver_message(exc)}", hint=hint)


def open_engine(db: str | None, *, create: bool = False) -> Any:
    """The CLI's way into the database: SQLite upgrades itself, PostgreSQL must be current.
    Only commands that write the inventory (or the audit trail without one) ``create`` a
    missing SQLite file; the others say there is none there (exit 2) and create nothing."""
    from kvctl.db.migrate import open_db

    with db_errors():
        return open_db(db, create=create)


# --- the workload a command replays or plans for: a trace file, else a generated one ----------
TraceOpt = Annotated[
    Path | None,
    typer.Option("--trace", help="Mooncake-format JSONL trace (default: --workload)."),
]
WorkloadOpt = Annotated[
    str,
    typer.Option(
        "--workload",
        "-w",
        help="Generated workload: builtin, system-prompt, chat, rag or mix (system-prompt, "
        "chat and rag at once, tenants and blocks kept apart).",
    ),
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the generated workload.")]
#: kvctl.profiles.DEFAULT_MFU, not imported here: every command's module loads this one
MFU_DEFAULT = 0.5
#: the --mfu of every command that models prefill (plan, replay, dashboard, router serve):
#: below 1% no GPU runs prefill, and above 1 is more than the GPU's peak
MfuOpt = Annotated[
    float,
    typer.Option(
        "--mfu",
        help="Prefill MFU (model FLOPs utilisation) of the modeled figures.",
        min=0.01,
        max=1.0,
    ),
]
LimitOpt = Annotated[int | None, typer.Option("--limit", help="Only the first N requests.", min=1)]
TenantsOpt = Annotated[
    int,
    typer.Option(
        "--tenants",
        help="Tenants to assign to a trace's requests when it has none (continuing "
        "conversations keep theirs).",
        min=1,
    ),
]


def load_workload_said(
    trace: Path | None, *, seed: int, limit: int | None, workload: str, quiet: bool = False
) -> Any:
    """``load_workload``, saying on stderr what it reads or generates while it does (a transient
    spinner on a terminal): 100k generated requests or a big trace take seconds, which looked
    hung. ``quiet`` (--json) says nothing."""
    from kvctl.cli.output import shown_while
    from kvctl.workload.source import load_workload

    if trace is not None:
        what = f"reading {trace}"
    else:
        size = "" if limit is None else f", {limit:,} requests"
        what = f"generating the {workload} workload (seed {seed}{size})"
    with shown_while(what, disable=quiet):
        return load_workload(trace, seed=seed, limit=limit, workload=workload)


# --- targets: which nodes a fleet command acts on ---------------------------------------------
NodeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--node",
        "-n",
        help="A node by name (repeat for several).",
        metavar="NODE",
        show_default=False,
    ),
]
DcOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--dc", help="Every node of a DC (repeat for several).", metavar="DC", show_default=False
    ),
]
AllOpt = Annotated[bool, typer.Option("--all", help="Every node of the fleet.")]
#: the longest --timeout for an agent's answer to a read (lookup, status, doctor, top): an hour
#: is already no agent's; past about 1e10 seconds a deadline is past what the platform's time_t
#: holds (OverflowError for every node)
MAX_AGENT_TIMEOUT_S = 3600.0
TimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout", help="Seconds to wait for each agent.", min=0.1, max=MAX_AGENT_TIMEOUT_S
    ),
]
#: the longest --timeout of an action (flush, resize, move, prefetch, pin...): the agent answers
#: once it is done, and a flush --demote or a shrinking resize of a multi-TiB tier to a disk
#: tier takes over an hour (4 TiB at 1 GB/s: 70 min), so an hour refused a legitimate wait
MAX_ACTION_TIMEOUT_S = 86_400.0
ActionTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout",
        help="Seconds to wait for each agent's answer (it answers once the action is done).",
        min=0.1,
        max=MAX_ACTION_TIMEOUT_S,
    ),
]

#: the most tokens per chunk a command takes (keys, router serve): engines page KV in blocks of
#: 16 to a few thousand tokens, and an agent's default is 256
MAX_CHUNK_TOKENS = 65_536

# --- a prompt given as text or token ids -------------------------------------------------------
TextOpt = Annotated[
    str | None, typer.Option("--text", help="Prompt text, tokenized with --tokenizer.")
]
TokensOpt = Annotated[
    Path | None,
    typer.Option("--tokens", help="File of token ids (whitespace or commas; - for stdin)."),
]
TokenizerOpt = Annotated[
    str, typer.Option("--tokenizer", help="simple (whitespace words) or bytes (UTF-8).")
]


def read_option_file(path: Path, what: str = "", *, stdin: bool = False) -> str:
    """The text of a file an option names (``-`` is standard input where ``stdin``); a missing
    file, a directory or text that is not UTF-8 exits 2 naming the file, never a traceback."""
    from kvctl.errors import InvalidArgument
    from kvctl.paths import read_text_file

    try:
        if stdin and str(path) == "-":
            try:
                return sys.stdin.read().removeprefix("\ufeff")  # a BOM, as read_text_file
            except UnicodeDecodeError:
                raise InvalidArgument(
                    f"cannot read {what or 'standard input'} from standard input: not UTF-8 text"
                ) from None
        return read_text_file(path, what)
    except InvalidArgument as exc:
        fail(str(exc))


def read_secret_file(path: Path, what: str = "the token file") -> str:
    """A secret from the first line of the file an option names; an empty file exits 2."""
    text = read_option_file(path, what).strip()
    if not text:
        fail(f"{what} {path} is empty")
    return text.splitlines()[0].strip()


def prompt_tokens(text: str | None, tokens: Path | None, tokenizer: str) -> list[int] | None:
    """Token ids from --text or --tokens; None when neither is given, an error when both are."""
    from kvctl.tokenize import read_token_file, tokenize

    if text is not None and tokens is not None:
        fail("give one of --text and --tokens, not both")
    if text is not None:
        return tokenize(text, tokenizer)
    if tokens is not None:
        return read_token_file(read_option_file(tokens, "--tokens", stdin=True))
    return None


# --- chunks named by key or by prompt ---------------------------------------------------------
KeyOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--key",
        "-k",
        help="A chunk key, 32 hex characters (repeat for several).",
        metavar="KEY",
        show_default=False,
    ),
]
KeysFileOpt = Annotated[
    Path | None,
    typer.Option("--keys-file", help="File of chunk keys, one per line (- for stdin)."),
]
#: where a user finds a prompt's keys: the node's own (its model, layout, chunk size and salt)
#: or computed here for an agent's defaults
KEYS_HINT = (
    "`kvctl lookup --node NODE --text ...` shows the keys NODE computes for a prompt; "
    "`kvctl keys --text ...` computes them here for an agent's default model (--model and the "
    "layout options for another)"
)
ModelOpt = Annotated[
    str | None,
    typer.Option("--model", help="Model whose keys --text/--tokens make (default: the agent's)."),
]
TenantOpt = Annotated[str, typer.Option("--tenant", help="Tenant the prompt belongs to.")]
TierOpt = Annotated[str | None, typer.Option("--tier", "-t", help="Tier name (gpu, cpu, disk...).")]


@dataclass(frozen=True, slots=True)
class ChunkOptions:
    """The chunks a control command acts on: keys (--key/--keys-file) or a prompt's chunks."""

    key: KeyOpt = None
    keys_file: KeysFileOpt = None
    text: TextOpt = None
    tokens: TokensOpt = None
    tokenizer: TokenizerOpt = "simple"
    model: ModelOpt = None
    tenant: TenantOpt = ""

    def selection(self) -> ChunkSelection:
        """The library's selection; a bad key or both ways (or neither) given is a usage error."""
        from kvctl.fleet.actions import ChunkSelection

        keys, ids = prompt_or_keys(
            self.key,
            self.keys_file,
            self.text,
            self.tokens,
            self.tokenizer,
            hint="a prompt's keys are computed by each agent for its own model",
        )
        if ids is not None:
            return ChunkSelection(tokens=tuple(ids), model=self.model, tenant=self.tenant)
        return ChunkSelection(keys=tuple(keys))


def prompt_or_keys(
    key: list[str] | None,
    keys_file: Path | None,
    text: str | None,
    tokens: Path | None,
    tokenizer: str,
    *,
    hint: str = "see --help",
) -> tuple[list[str], list[int] | None]:
    """The keys (--key/--keys-file) or the prompt's token ids (--text/--tokens) a command was
    given: exactly one of the two ways, or a usage error (exit 2)."""
    with user_errors(hint="see --help"):
        keys = keys_from(key, keys_file)
        ids = prompt_tokens(text, tokens, tokenizer)
    if not keys and ids is None and keys_file is not None and not key:
        fail(f"--keys-file {keys_file} names no key (blank lines and # comments only)", hint=hint)
    if bool(keys) == (ids is not None):
        fail("give a prompt (--text TEXT or --tokens FILE) or its keys (--key, --keys-file)",
             hint=hint)  # fmt: skip
    return keys, ids


def keys_from(key: list[str] | None, keys_file: Path | None) -> list[str]:
    """The keys --key and --keys-file name, each checked as strictly as the agents check them."""
    from kvctl.store.keys import KEY_BYTES, is_key_text

    # whitespace around a key (a pasted one, a file's line) is dropped, as keys files always were
    texts = [k.strip() for k in key or []]
    if keys_file is not None:
        raw = read_option_file(keys_file, "--keys-file", stdin=True)
        texts += [ln.strip() for ln in raw.splitlines() if ln.strip() and not ln.startswith("#")]
    for i, k in enumerate(texts):
        if not is_key_text(k):  # as strict as the agents: nothing but the 32 hex digits
            shown = k if len(k) <= 40 else k[:40] + "..."
            fail(
                f"bad key #{i + 1} {shown!r}: keys are {KEY_BYTES * 2} hex characters",
                hint=KEYS_HINT,
            )
    return texts


@dataclass(frozen=True, slots=True)
class Targets:
    """The nodes a fleet command acts on: --node, --dc or --all."""

    node: NodeOpt = None
    dc: DcOpt = None
    all_nodes: AllOpt = False

    def resolve(self, engine: Any) -> list[NodeInfo]:
        """The inventory's nodes for these options; an unknown name is a usage error."""
        from kvctl.fleet.targets import resolve_targets

        with (
            db_errors(),
            user_errors(hint="`kvctl fleet ls` lists DCs and nodes"),
            engine.connect() as conn,
        ):
            return resolve_targets(
                conn, nodes=self.node or [], dcs=self.dc or [], all_nodes=self.all_nodes
            )

    def question(self, action: str, nodes: list[NodeInfo]) -> str | None:
        """What to ask before ``action`` on the resolved ``nodes`` when the selection is
        wholesale (--all, or a whole DC: as many nodes at once, named by no one), else None."""
        if self.all_nodes:
            dcs = len({n.dc for n in nodes})
            return f"{action} on ALL {len(nodes)} node(s) in {dcs} DC(s)?"
        if not self.dc:
            return None
        dcs = list(dict.fromkeys(self.dc))  # a DC given twice is asked about once
        in_dcs = sum(n.dc in dcs for n in nodes)
        named = [n.name for n in nodes if n.dc not in dcs]  # --node outside those DCs
        where = f"DC {dcs[0]}" if len(dcs) == 1 else f"DCs {', '.join(dcs)}"
        also = f" and on {', '.join(named)}" if named else ""
        return f"{action} on ALL {in_dcs} node(s) in {where}{also}?"


def bundled(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` as a command whose dataclass-typed parameters (:class:`ChunkOptions`,
    :class:`Targets`) are shown as their fields' options, in place, and handed to ``fn`` built.
    A bundle parameter's default, an instance, gives this command's option defaults (one
    bundle, several commands' defaults); without one, the fields' defaults apply."""
    hints = get_type_hints(fn, include_extras=True)
    params: list[inspect.Parameter] = []
    bundles: dict[str, tuple[type, list[str]]] = {}
    for param in inspect.signature(fn).parameters.values():
        hint = hints[param.name]
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            params.append(param.replace(annotation=hint, kind=inspect.Parameter.KEYWORD_ONLY))
            continue
        field_hints = get_type_hints(hint, include_extras=True)
        fields = dataclasses.fields(hint)
        defaults = param.default if isinstance(param.default, hint) else None
        bundles[param.name] = (hint, [f.name for f in fields])
        params += [
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=f.default if defaults is None else getattr(defaults, f.name),
                annotation=field_hints[f.name],
            )
            for f in fields
        ]

    @functools.wraps(fn)
    def command(**options: Any) -> None:
        for name, (cls, fields) in bundles.items():
            options[name] = cls(**{f: options.pop(f) for f in fields})
        fn(**options)

    del command.__wrapped__  # typer reads the signature below, not fn's
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command
