"""Which database, and how to connect: ``KVCTL_DB_URL`` or a SQLite file in the state dir."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sqlite3
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DisconnectionError

from kvctl.paths import default_state_dir
from kvctl.redact import redact_unparsed, redact_url

#: a SQLite database kvctl creates: its owner's alone (it names the fleet's nodes and their
#: URLs, and the audit trail says who did what), whatever the umask
DB_FILE_MODE = 0o600


class DatabaseError(Exception):
    """The database cannot be used as asked; the message says what to do."""


class SchemaNotKnown(DatabaseError):
    """The database is at a schema revision this kvctl does not know (a newer kvctl migrated
    it), or at several at once; nothing of it is changed."""

    hint = "an older kvctl neither uses nor migrates it: run the kvctl that migrated it, or newer"


class NoDatabase(DatabaseError):
    """A command that only reads found no SQLite database where the URL points (a typo, or
    none made yet); nothing was created."""


def default_db_path() -> Path:
    return default_state_dir() / "metrics.db"


#: what SQLAlchemy's URL parser takes for a password: from the first ':' after the user to the
#: first '@' (a valid URL has no raw '/', '?' or '#' there)
_RAW_PASSWORD = re.compile(r"[\w+]+://[^:/]*:([^@]*)@")
#: a port, a path and a query's key=value as what the parser took for a password: the userinfo
#: it took ran from the host to an '@' in the query, so the "password" starts with the port
#: (digits, or an IPv6 host's tail ':1]:5432') and the path's '/'. A password typed with a raw
#: '?' and '=' ('k3?Lm=Q'), or a raw '/' before them ('k3/Lm?Q=x'), is no such thing, and
#: reads as it did
_QUERY_IN_IT = re.compile(r"(?:[^/]*\]:?)?\d*/[^?]*\?[^=]*=")


def resolve_url(url: str | URL | None = None) -> str:
    """The database URL: ``url``, else ``KVCTL_DB_URL``, else the default SQLite file.

    ``postgresql://`` URLs use psycopg 3 (the driver installed with kvctl)."""
    if isinstance(url, URL):  # built by a library caller: its parts percent-encoded as text
        url = url.render_as_string(hide_password=False)
    text = url or os.environ.get("KVCTL_DB_URL") or f"sqlite:///{default_db_path()}"
    try:
        parsed = make_url(text)
    except (ArgumentError, ValueError) as exc:  # ValueError: a port that is no number
        port = " (its port is not a number)" if isinstance(exc, ValueError) else ""
        raise DatabaseError(
            f"not a database URL: {redact_unparsed(text)!r}{port} (examples: "
            "sqlite:////var/lib/kvctl/metrics.db, postgresql://kvctl@db.example:5432/kvctl)"
        ) from None
    raw_password = _RAW_PASSWORD.match(text)
    if raw_password and _QUERY_IN_IT.match(raw_password[1]):
        # an '@' in the query (password=pa@ss) read as ending a userinfo that runs from the
        # host to it: the host is then what follows that '@' (the password's tail), which the
        # driver's errors print ("failed to resolve host 'ss'"). A password typed with a raw
        # '/' or '?' (no key=value after it) reads as one, as it did.
        raise DatabaseError(
            f"not a database URL: {redact_url(text)}: its query holds a raw '@', which must be "
            "percent-encoded as %40"
        )
    if parsed.host is not None and "@" in parsed.host:
        # a password typed with a raw '@': the URL parser takes its tail for the host, which
        # the driver's errors then print ("failed to resolve host 'ss@db'")
        raise DatabaseError(
            f"not a database URL: {redact_url(text)}: its password has a raw '@', which must "
            "be percent-encoded as %40"
        )
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise DatabaseError(
            f"unsupported database {parsed.get_backend_name()!r}: kvctl supports SQLite and "
            "PostgreSQL"
        )
    if parsed.drivername not in _DRIVERS:
        # another driver (asyncpg, psycopg2) was "a bug in kvctl: ModuleNotFoundError"
        raise DatabaseError(
            f"unsupported database driver {parsed.drivername!r}: kvctl uses psycopg 3 for "
            "PostgreSQL (postgresql://USER@HOST:5432/DB) and Python's sqlite3 for SQLite "
            "(sqlite:///PATH)"
        )
    return parsed.render_as_string(hide_password=False)


#: the drivers kvctl installs and is written for (the pysqlite transaction recipe, psycopg 3's
#: connection socket): a URL's scheme names one of them, or its backend alone (postgresql://
#: is made postgresql+psycopg:// above)
_DRIVERS = frozenset({"sqlite", "sqlite+pysqlite", "postgresql+psycopg"})


def driver_message(exc: BaseException) -> str:
    """What the database driver said of ``exc`` (SQLAlchemy's wrapped ``orig``, else ``exc``)
    on one line: libpq's "connection refused" comes with a second, indented line."""
    return " ".join(str(getattr(exc, "orig", None) or exc).split())


def display_url(url: str) -> str:
    """The URL with its password masked, for logs and `kvctl db current`: the userinfo's, and
    those libpq takes in the query (``password=``, ``sslpassword=``)."""
    return redact_url(make_url(url).render_as_string(hide_password=True))


@contextlib.contextmanager
def write_transaction(engine: Engine) -> Iterator[Connection]:
    """``engine.begin()``, whose statements commit or roll back together on SQLite too.
    pysqlite opens a transaction only before a statement it takes for a write by its first
    word: a ``WITH ... UPDATE`` (the counters' compare-and-set save) ran on its own and
    committed at once, so a batch refused after it (a full disk) left the counters' state
    saved and their increases in no row. ``BEGIN IMMEDIATE`` opens it first, taking the write
    lock then (waiting up to the busy timeout) rather than at some later statement."""
    with engine.begin() as conn:
        if conn.dialect.name == "sqlite":
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        yield conn


def sqlite_pragmas(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    # WAL: readers (dashboard, CLI) never block the collector's writes, and vice versa
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def create_db_engine(url: str, *, create: bool = True) -> Engine:
    """An engine on ``url``. A SQLite file that is missing is created 0600 (its directory
    0700), or, unless ``create``, refused with :class:`NoDatabase` and nothing created."""
    parsed: URL = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            path = Path(parsed.database).expanduser()
            if create:
                _create_sqlite_file(path)
            elif not path.exists():
                raise NoDatabase(
                    f"no fleet database at {path}; create one with `kvctl fleet add-dc NAME` "
                    "(or `kvctl fleet import FILE`), or fix --db / KVCTL_DB_URL"
                )
        engine = create_engine(parsed)
        event.listen(engine, "connect", sqlite_pragmas)
        return engine
    engine = create_engine(
        parsed,
        pool_pre_ping=True,
        pool_size=5,
        max_overflow=5,
        connect_args=_pg_connect_args(parsed),
    )
    opened: weakref.WeakSet[Any] = weakref.WeakSet()
    _OPENED[engine] = opened
    event.listen(engine, "connect", lambda dbapi_conn, _record: opened.add(dbapi_conn))
    return engine


#: each PostgreSQL engine's driver connections, for :func:`cut_when_stuck`
_OPENED: weakref.WeakKeyDictionary[Engine, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()


class StuckWatch:
    """Whether :func:`cut_when_stuck` cut the connections (the block's error is then that)."""

    fired = False


@contextlib.contextmanager
def cut_when_stuck(engine: Engine, after_s: float) -> Iterator[StuckWatch]:
    """A block whose calls on ``engine`` (PostgreSQL) have not returned after ``after_s`` has
    every connection of the engine shut down, so a call blocked on one fails at once
    (OperationalError) instead of waiting on. A server that stops answering while its host's
    kernel still acknowledges (hung on its storage, a stopped proxy or pooler in between) held
    the collector's loop for as long as it stayed so, no TCP keepalive firing, with no word:
    100 s in a test, forever in the field. ``lock_timeout`` bounds only lock waits. A commit
    cut so may have been made: the counters' compare-and-set save tells which next time."""
    watch = StuckWatch()
    opened = _OPENED.get(engine)
    if opened is None:  # SQLite: a lock waits busy_timeout, no network to stall
        yield watch
        return

    def cut() -> None:
        watch.fired = True
        for dbapi_conn in list(opened):
            with contextlib.suppress(Exception):  # closed meanwhile, or never connected
                fd = os.dup(dbapi_conn.pgconn.socket)
                with socket.socket(fileno=fd) as sock:
                    sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(after_s, cut)
    timer.daemon = True
    timer.start()
    try:
        yield watch
    finally:
        timer.cancel()


#: a server that takes the TCP connection and never answers (a hung host, a black-holing
#: firewall) fails the connection after this long, instead of hanging a command or the
#: collector's loop with no word
PG_CONNECT_TIMEOUT_SECONDS = 10
#: a statement waiting on another session's lock (a LOCK TABLE, a long upkeep) gives up
#: after this long: the collector keeps its batch for the next try and says so
PG_LOCK_TIMEOUT_MS = 15_000
#: TCP keepalives: a connection whose peer vanished mid-query is found dead in about
#: idle + interval x count seconds, not after the kernel's two hours
PG_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10,
                 "keepalives_count": 3}  # fmt: skip


def _pg_connect_args(url: URL) -> dict[str, Any]:
    """libpq settings for every PostgreSQL connection; a URL that sets one itself (e.g.
    ``?connect_timeout=30``, ``?options=...``) keeps its own."""
    given = set(url.query)
    args: dict[str, Any] = {"connect_timeout": PG_CONNECT_TIMEOUT_SECONDS, **PG_KEEPALIVES}
    args = {k: v for k, v in args.items() if k not in given}
    if "options" not in given:
        args["options"] = f"-c lock_timeout={PG_LOCK_TIMEOUT_MS}"
    return args


def sqlite_dir_problem(database: str | None) -> str:
    """Why a SQLite file in WAL mode cannot be opened, where its directory is the cause (else
    ""): SQLite makes its ``-wal`` and ``-shm`` files beside it, so a read-only directory
    fails every connection with "attempt to write a readonly database" (or "unable to open
    database file"), the file itself writable, which sent operators to the file."""
    if not database or database == ":memory:":
        return ""
    path = Path(database).expanduser()
    wal = path.with_name(path.name + "-wal")
    if not path.exists() or wal.exists() or os.access(path.parent, os.W_OK | os.X_OK):
        return ""
    return (
        f" (its directory {path.parent} is not writable: SQLite makes {wal.name} and "
        f"{path.name}-shm there; let this user write it)"
    )


def _create_sqlite_file(path: Path) -> None:
    """``path`` as an empty file 0600 when missing (SQLite makes its -wal and -shm files with
    the same mode), so the database is never readable by others, whatever the umask."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise DatabaseError(f"cannot create {path.parent}: {exc.strerror}") from None
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, DB_FILE_MODE))
    except FileExistsError:
        pass  # an existing database keeps its mode: its owner chose it
    except OSError as exc:
        raise DatabaseError(f"cannot create {path}: {exc.strerror}") from None


# --- a SQLite file moved away or replaced while a process runs ---------------------------------
# A SQLite database is the file at a path, but a connection reads and writes the file it
# opened, whatever is at the path since. A process that runs on (the dashboard, the collector's
# loop) kept its pooled connections on a file moved away (``mv metrics.db* /backup/``) or
# replaced (a backup restored over the path with mv): the dashboard drew the figures of a file
# no longer there, the collector wrote its rows where no one would read them, silently; and a
# connection opened once no file was at the path made sqlite3 create an empty database there.
# ``follow_the_path`` makes an engine's connections follow the path instead.

#: a file on this host: (device, inode)
FileId = tuple[int, int]

#: keys of a pool record's ``info``: the path its connection opened (None: not a file), the
#: file that was at the path then (None: it cannot be told, the path changed as it opened)
_PATH = "kvctl_path"
_FILE = "kvctl_file"

#: engines following their path (each once, however many callers ask)
_FOLLOWED: weakref.WeakSet[Engine] = weakref.WeakSet()


class NoDatabaseFile(sqlite3.OperationalError):
    """No file at a followed engine's path: it was moved or deleted while the process ran. No
    connection is opened (sqlite3 would create an empty database there); SQLAlchemy wraps it
    in its OperationalError, this in ``orig``."""


def file_id(path: str) -> FileId | None:
    """The file at ``path`` (device, inode); None where there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def sqlite_file_path(engine: Engine) -> str | None:
    """The path of ``engine``'s SQLite file; None for another database, an in-memory one or a
    ``file:`` URI (opened as asked)."""
    if engine.dialect.name != "sqlite":
        return None
    database = engine.url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    if str(engine.url.query.get("uri", "")).lower() in ("true", "1"):
        return None
    return database


def follow_the_path(engine: Engine, who: str) -> None:
    """Make ``engine``'s connections (a SQLite file; else nothing changes) those of the file at
    its path: a pooled connection whose file is no longer there (moved, deleted, replaced), or
    that was opened before this call, is replaced at checkout (the pool opens another); none is
    opened where no file is (:class:`NoDatabaseFile`: "no database file at PATH (moved or
    deleted while ``who`` ran)"), sqlite3 being told never to create one (``mode=rw``). A new
    file at the path is opened. :func:`connection_file` says which file a connection has."""
    if sqlite_file_path(engine) is None or engine in _FOLLOWED:
        return
    _FOLLOWED.add(engine)

    @event.listens_for(engine, "do_connect")
    def _open_the_file_there(dialect: Any, record: Any, cargs: list[Any], cparams: Any) -> Any:
        path = str(cargs[0]) if cargs else ""
        if not path or path == ":memory:" or path.startswith("file:"):
            record.info[_PATH] = None
            return None  # no file, or a URI: opened as asked
        record.info[_PATH] = path
        before = file_id(path)
        if before is None:  # sqlite3 would create it
            raise NoDatabaseFile(f"no database file at {path} (moved or deleted while {who} ran)")
        # a URI opened read-write, never created: one moved away as it opens fails to open
        uri = f"file:{quote(os.path.abspath(path))}?mode=rw"
        dbapi_conn = dialect.connect(uri, *cargs[1:], **{**cparams, "uri": True})
        # the file opened is the one at the path before and after, else it cannot be told
        record.info[_FILE] = before if file_id(path) == before else None
        return dbapi_conn

    @event.listens_for(engine, "checkout")
    def _still_there(_dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        if _PATH not in record.info:
            # opened before the engine followed its path: its file is not known
            raise DisconnectionError("a connection opened before its file was followed")
        path = record.info[_PATH]
        opened = record.info.get(_FILE)
        if path is not None and (opened is None or file_id(path) != opened):
            # the pool drops this connection and opens another (the path's file, or none)
            raise DisconnectionError(f"{path} is no longer the file this connection opened")


def connection_file(conn: Connection) -> FileId | None:
    """The file ``conn`` reads and writes (checked at its checkout to be the one at its path),
    where its engine follows its path (:func:`follow_the_path`); else None."""
    file: FileId | None = conn.info.get(_FILE)
    return file
