"""The schema objects an auditor relies on besides the rows: the SQL views people query the log through, and the
append-only guard triggers (with their functions on PostgreSQL). check_schema_objects reports each view whose
definition is not the one the migrations created (a `CREATE OR REPLACE VIEW` with a filter hides rows from everyone
who queries it), each guard missing, disabled or altered (the comparison `loraledger db check` makes:
store.guards.guards_present), and each trigger on an audit table that no revision created. Verify recomputes the
chain so that it holds without the guards, and finds every row a missing guard let through; a report that verify
passed also says the database still refuses the next tampering.

Each view's expected definition is the constant of the newest revision that (re)creates it (VIEWS below); a revision
that changes a view adds itself there.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from functools import cache
from importlib.resources import files

from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError

# view -> (the file of the newest revision that creates it, the constant holding its CREATE VIEW)
VIEWS = {
    "adapter_usage": ("2026_11_22_0003_audit_views.py", "ADAPTER_USAGE"),
    "request_lineage": ("2026_11_27_0016_erasable_caller_content.py", "REQUEST_LINEAGE"),
}
PG_CHECK_MS = 5000  # the deadline of each statement comparing a view on PostgreSQL
# the dialect-specific pieces 0003 formats its views with
_FORMAT_ARGS = {"adapter_usage": "UTC_DAY"}


@cache
def _revision(filename: str):
    path = files("loraledger.migrations") / "versions" / filename
    spec = importlib.util.spec_from_file_location(f"loraledger_revision_{filename[:-3]}", str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected_view(name: str, dialect: str) -> str:
    """The CREATE VIEW statement the migrations ran for view `name` on `dialect`."""
    filename, constant = VIEWS[name]
    module = _revision(filename)
    sql = getattr(module, constant)
    if name in _FORMAT_ARGS:
        sql = sql.format(day=getattr(module, _FORMAT_ARGS[name])[dialect])
    return sql.strip()


def _select_of(create: str) -> str:
    return create.split(" AS\n", 1)[1] if " AS\n" in create else create.split(" AS ", 1)[1]


def _sqlite_views(conn: Connection) -> dict[str, str | None]:
    rows = conn.execute(text("SELECT name, sql FROM sqlite_master WHERE type = 'view'"))
    return {name: (sql or "").strip() for name, sql in rows}


def _pg_view_problems(conn: Connection, report: Callable[[str, str], None]) -> None:
    # PostgreSQL keeps a view's parsed form: compare it with what the expected text parses to, made as a temporary
    # view on a connection of its own (a verify snapshot may be read-only) and rolled back
    rows = conn.execute(text("SELECT viewname, definition FROM pg_views WHERE schemaname = current_schema()"))
    found = {name: definition for name, definition in rows}
    with conn.engine.connect() as scratch, scratch.begin() as tx:
        # bounded: a lock held by the connection being verified (or anyone) must not stall verify
        scratch.execute(text(f"SET LOCAL lock_timeout = '{PG_CHECK_MS}ms'"))
        scratch.execute(text(f"SET LOCAL statement_timeout = '{PG_CHECK_MS}ms'"))
        for name in VIEWS:
            if name not in found:
                report(name, "is missing")
                continue
            probe = f"loraledger_expected_{name}"
            try:
                with scratch.begin_nested():
                    scratch.execute(
                        text(f"CREATE TEMPORARY VIEW {probe} AS {_select_of(expected_view(name, 'postgresql'))}")
                    )
                    expected = scratch.execute(text(f"SELECT pg_get_viewdef('{probe}'::regclass)")).scalar_one()
            except DBAPIError as exc:
                report(name, f"could not be compared with its definition ({type(exc.orig).__name__})")
                continue
            if found[name].strip() != expected.strip():
                report(name, "has a definition other than the one the migrations created")
        tx.rollback()


def check_schema_objects(conn: Connection, add: Callable[..., None]) -> None:
    """Report (through `add(sequence, message, table=...)`, verify's problem list) every missing or altered view and
    guard, and every trigger on an audit table no migration made."""

    def report(view: str, what: str) -> None:
        add(
            None,
            f"view {view} {what}: queries through it may not show the log as it is (recreate it with "
            "`loraledger db upgrade`, and find out who changed it)",
            table=view,
            key={"view": view},
        )

    from loraledger.store.guards import foreign_triggers, guards_present
    from loraledger.store.migrate import current_revision, head_revision

    if current_revision(conn) != head_revision():
        return  # VIEWS describes the newest schema; an older one is reported as needing `loraledger db upgrade`
    for guard in guards_present(conn):
        add(
            None,
            f"append-only guard {guard} is not as the migrations created it: the table it guards may be changed "
            "(reinstall the guards with `loraledger db upgrade`, and find out who changed them)",
            table="triggers",
            key={"trigger": guard},
        )
    for trigger in foreign_triggers(conn):
        add(
            None,
            f"trigger {trigger} was not created by any migration: it may rewrite or drop audit rows as they are "
            "written (drop it, and find out who made it)",
            table="triggers",
            key={"trigger": trigger},
        )
    dialect = conn.dialect.name
    if dialect == "sqlite":
        found = _sqlite_views(conn)
        for name in VIEWS:
            if name not in found:
                report(name, "is missing")
            elif found[name] != expected_view(name, "sqlite"):
                report(name, "has a definition other than the one the migrations created")
    elif dialect == "postgresql":
        _pg_view_problems(conn, report)
