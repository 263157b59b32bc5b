"""The append-only guards: database triggers that refuse to change or remove audit rows.

Both dialects: UPDATE and DELETE on every audit table raise "audit table X is append-only" (a
`request_texts` row may be deleted once its request's erasure is on record: `audit erase`),
a completion whose adapter_fingerprint differs (NULL-safe) from its request's binding is
refused, and so is a `request_texts` row for a request whose erasure is on record. PostgreSQL also refuses TRUNCATE, and every guard is ENABLE ALWAYS, so
`session_replication_role = replica` does not switch it off. SQLite's REPLACE conflict
resolution (`INSERT OR REPLACE`, `REPLACE`) deletes the old row without firing DELETE triggers,
so a BEFORE INSERT guard refuses any insert whose key is already taken; the writer therefore
selects before it inserts. Refusals are integrity errors on both dialects (SQLSTATE 23001 /
23514 on PostgreSQL, SQLITE_CONSTRAINT_TRIGGER on SQLite).

Revision `0002_guards` installs this set; `loraledger db upgrade` reinstalls any guard that has
gone missing. Changing a guard needs a new revision that reinstalls the set.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from sqlalchemy import Connection, text

from loraledger.store.models import AUDIT_TABLES, ERASABLE_TABLES

# when an insert's key is already taken (one EXISTS per unique key, so each uses its index)
_KEY_TAKEN = {
    "adapters": "EXISTS (SELECT 1 FROM adapters WHERE fingerprint = NEW.fingerprint)",
    "requests": "EXISTS (SELECT 1 FROM requests WHERE request_id = NEW.request_id)",
    "completions": "EXISTS (SELECT 1 FROM completions "
    "WHERE request_id = NEW.request_id AND completion_index = NEW.completion_index)",
    "events": "EXISTS (SELECT 1 FROM events WHERE seq = NEW.seq) OR (NEW.dedup_key IS NOT NULL "
    "AND EXISTS (SELECT 1 FROM events WHERE dedup_key = NEW.dedup_key))",
    "instances": "EXISTS (SELECT 1 FROM instances WHERE instance_id = NEW.instance_id)",
    "merkle_nodes": "EXISTS (SELECT 1 FROM merkle_nodes WHERE level = NEW.level AND idx = NEW.idx)",
    "checkpoints": "EXISTS (SELECT 1 FROM checkpoints WHERE tree_size = NEW.tree_size)",
    "receipts": "EXISTS (SELECT 1 FROM receipts WHERE request_id = NEW.request_id)",
    "request_texts": "EXISTS (SELECT 1 FROM request_texts "
    "WHERE request_id = NEW.request_id AND part = NEW.part AND idx = NEW.idx)",
    "erasures": "EXISTS (SELECT 1 FROM erasures WHERE request_id = NEW.request_id)",
}
# a text row for a request whose erasure is on record: an erased request never gets new kept text (revision 0016)
_ERASED_REQUEST = "EXISTS (SELECT 1 FROM erasures WHERE request_id = NEW.request_id)"
_ERASED_MESSAGE = "request_texts refuses text for a request whose text was erased (its erasures row is on record)"
# the one way an audit row may go: a text row whose request has an `erasures` row that names an `erased` event,
# both appended by `audit erase` in the transaction that deletes it (audit/erase.py)
_ERASURE_ON_RECORD = (
    "EXISTS (SELECT 1 FROM erasures x JOIN events e ON e.seq = x.seq "
    "WHERE x.request_id = OLD.request_id AND e.kind = 'erased')"
)


@dataclass(frozen=True)
class Guard:
    name: str
    table: str
    sql: str  # the exact CREATE statement; SQLite keeps it verbatim, which lets us spot a tampered guard


def _sqlite_guards() -> list[Guard]:
    guards = []
    for table in AUDIT_TABLES:
        refuse = f"SELECT RAISE(ABORT, 'audit table {table} is append-only'); END"
        guards += [
            Guard(
                f"{table}_no_update",
                table,
                f"CREATE TRIGGER {table}_no_update BEFORE UPDATE ON {table} BEGIN {refuse}",
            ),
            Guard(
                f"{table}_no_delete",
                table,
                f"CREATE TRIGGER {table}_no_delete BEFORE DELETE ON {table} "
                + (f"WHEN NOT {_ERASURE_ON_RECORD} " if table in ERASABLE_TABLES else "")
                + f"BEGIN {refuse}",
            ),
            Guard(
                f"{table}_no_replace",
                table,
                f"CREATE TRIGGER {table}_no_replace BEFORE INSERT ON {table} "
                f"WHEN {_KEY_TAKEN[table]} "
                f"BEGIN SELECT RAISE(ABORT, 'audit table {table} is append-only: "
                f"a row with this key already exists'); END",
            ),
        ]
    guards.append(
        Guard(
            "request_texts_after_erasure",
            "request_texts",
            f"CREATE TRIGGER request_texts_after_erasure BEFORE INSERT ON request_texts WHEN {_ERASED_REQUEST} "
            f"BEGIN SELECT RAISE(ABORT, '{_ERASED_MESSAGE}'); END",
        )
    )
    guards.append(
        Guard(
            "completions_binding",
            "completions",
            "CREATE TRIGGER completions_binding BEFORE INSERT ON completions "
            "WHEN EXISTS (SELECT 1 FROM requests WHERE request_id = NEW.request_id "
            "AND adapter_fingerprint IS NOT NEW.adapter_fingerprint) "
            "BEGIN SELECT RAISE(ABORT, 'completions.adapter_fingerprint differs from "
            "requests.adapter_fingerprint, the adapter the request is bound to'); END",
        )
    )
    return guards


# PL/pgSQL bodies; no '%' or ':' in them, so they pass through any driver's parameter parsing
PG_FUNCTIONS = {
    "loraledger_refuse_change": """
BEGIN
    RAISE EXCEPTION USING
        MESSAGE = 'audit table ' || TG_TABLE_NAME || ' is append-only (' || TG_OP || ' refused)',
        ERRCODE = 'restrict_violation';
END
""",
    "loraledger_check_completion_binding": """
BEGIN
    IF EXISTS (SELECT 1 FROM requests r WHERE r.request_id = NEW.request_id
               AND r.adapter_fingerprint IS DISTINCT FROM NEW.adapter_fingerprint) THEN
        RAISE EXCEPTION USING
            MESSAGE = 'completion ' || NEW.request_id || '/' || NEW.completion_index
                || ' has adapter_fingerprint ' || coalesce(NEW.adapter_fingerprint, 'NULL')
                || ', which differs from the adapter its request is bound to',
            ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
""",
    "loraledger_refuse_erased_text": f"""
BEGIN
    IF {_ERASED_REQUEST} THEN
        RAISE EXCEPTION USING MESSAGE = '{_ERASED_MESSAGE}', ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END
""",
    "loraledger_guard_erasure": f"""
BEGIN
    IF {_ERASURE_ON_RECORD} THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION USING
        MESSAGE = 'audit table ' || TG_TABLE_NAME || ' is append-only (DELETE refused), its rows go only by '
            || 'loraledger audit erase, which records the erasure in the same transaction',
        ERRCODE = 'restrict_violation';
END
""",
}


# pg_trigger.tgtype bits
_ROW, _BEFORE, _INSERT, _DELETE, _UPDATE, _TRUNCATE = 1, 2, 4, 8, 16, 32


@dataclass(frozen=True)
class PgGuard(Guard):
    function: str = "loraledger_refuse_change"
    tgtype: int = 0  # what pg_trigger records for it: a guard re-created as something else is not present


def _pg_guards() -> list[PgGuard]:
    guards = []
    for table in AUDIT_TABLES:
        for name, timing, tgtype in (
            (f"{table}_no_update", "BEFORE UPDATE ON {t} FOR EACH ROW", _ROW | _BEFORE | _UPDATE),
            (f"{table}_no_delete", "BEFORE DELETE ON {t} FOR EACH ROW", _ROW | _BEFORE | _DELETE),
            (f"{table}_no_truncate", "BEFORE TRUNCATE ON {t} FOR EACH STATEMENT", _BEFORE | _TRUNCATE),
        ):
            on = timing.format(t=table)
            function = "loraledger_refuse_change"
            if table in ERASABLE_TABLES and tgtype & _DELETE:
                function = "loraledger_guard_erasure"
            sql = f"CREATE TRIGGER {name} {on} EXECUTE FUNCTION {function}()"
            guards.append(PgGuard(name, table, sql, function=function, tgtype=tgtype))
    guards.append(
        PgGuard(
            "request_texts_after_erasure",
            "request_texts",
            "CREATE TRIGGER request_texts_after_erasure BEFORE INSERT ON request_texts FOR EACH ROW "
            "EXECUTE FUNCTION loraledger_refuse_erased_text()",
            function="loraledger_refuse_erased_text",
            tgtype=_ROW | _BEFORE | _INSERT,
        )
    )
    guards.append(
        PgGuard(
            "completions_binding",
            "completions",
            "CREATE TRIGGER completions_binding BEFORE INSERT ON completions FOR EACH ROW "
            "EXECUTE FUNCTION loraledger_check_completion_binding()",
            function="loraledger_check_completion_binding",
            tgtype=_ROW | _BEFORE | _INSERT,
        )
    )
    return guards


SQLITE_GUARDS = _sqlite_guards()
PG_GUARDS = _pg_guards()


def guards_for(dialect_name: str) -> list[Guard]:
    if dialect_name == "sqlite":
        return list(SQLITE_GUARDS)
    if dialect_name == "postgresql":
        return list(PG_GUARDS)
    raise ValueError(f"no append-only guards for dialect {dialect_name!r}: use SQLite or PostgreSQL")


def install_statements(dialect_name: str, tables: Collection[str] | None = None) -> list[str]:
    """The SQL that (re)creates every guard (of tables only, when given: a revision guards the tables that
    exist at it); safe to run again over a partly guarded schema."""
    statements: list[str] = []
    if dialect_name == "postgresql":
        for name, body in PG_FUNCTIONS.items():
            statements.append(f"CREATE OR REPLACE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $${body}$$")
    for guard in guards_for(dialect_name):
        if tables is not None and guard.table not in tables:
            continue
        on_table = f" ON {guard.table}" if dialect_name == "postgresql" else ""
        statements.append(f"DROP TRIGGER IF EXISTS {guard.name}{on_table}")
        statements.append(guard.sql)
        if dialect_name == "postgresql":
            statements.append(f"ALTER TABLE {guard.table} ENABLE ALWAYS TRIGGER {guard.name}")
    return statements


def install(execute: Callable[[str], object], dialect_name: str, tables: Collection[str] | None = None) -> None:
    """Run install_statements through execute (Alembic's op.execute, or a connection's)."""
    for statement in install_statements(dialect_name, tables):
        execute(statement)


def guards_present(conn: Connection) -> list[str]:
    """The guards that are missing, disabled or altered (empty when the database is fully guarded)."""
    if conn.dialect.name == "sqlite":
        triggers = conn.execute(text("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'"))
        found = {name: sql for name, sql in triggers}
        return [g.name for g in SQLITE_GUARDS if found.get(g.name) != g.sql]
    if conn.dialect.name != "postgresql":
        raise ValueError(f"no append-only guards for dialect {conn.dialect.name!r}: use SQLite or PostgreSQL")
    rows = conn.execute(
        text(
            "SELECT c.relname, t.tgname, t.tgenabled, t.tgtype, t.tgqual IS NULL AND t.tgattr::text = '', "
            "p.proname, p.prosrc "
            "FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_proc p ON p.oid = t.tgfoid "
            "WHERE NOT t.tgisinternal AND pg_table_is_visible(c.oid)"
        )
    )
    found_pg = {(row[0], row[1]): tuple(row[2:]) for row in rows}
    missing = []
    for guard in PG_GUARDS:
        state = found_pg.get((guard.table, guard.name))
        if state is None:
            missing.append(guard.name)
        elif state[0] != "A":
            missing.append(f"{guard.name} (not ENABLE ALWAYS)")
        elif state[1] != guard.tgtype or not state[2]:
            missing.append(f"{guard.name} (re-created with another timing, event or condition)")
        elif state[3] != guard.function or state[4] != PG_FUNCTIONS[guard.function]:
            missing.append(f"{guard.name} (its function {state[3]}() was altered)")
    return missing


def foreign_triggers(conn: Connection) -> list[str]:
    """Triggers on the audit tables that no revision created (one could rewrite or drop rows as they are written)."""
    ours = {g.name for g in guards_for(conn.dialect.name)}
    tables = sorted(AUDIT_TABLES)
    if conn.dialect.name == "sqlite":
        rows = conn.execute(text("SELECT name, tbl_name FROM sqlite_master WHERE type = 'trigger'"))
    else:
        rows = conn.execute(
            text(
                "SELECT t.tgname, c.relname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
                "WHERE NOT t.tgisinternal AND pg_table_is_visible(c.oid)"
            )
        )
    return sorted(f"{name} on {table}" for name, table in rows if table in tables and name not in ours)
