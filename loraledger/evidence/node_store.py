"""The Merkle tree's stored nodes (`merkle_nodes`): appending leaves with the events, and reading proofs back.

Only complete subtrees are stored (about two rows per event), so a tree of any size yields a root, an
inclusion proof or a consistency proof from O(log n) rows fetched in one query; incomplete subtrees
are folded from them (tree_hash.range_nodes). Appending reads the tree's right edge (one row per set
bit of its size) and inserts the new leaves and every subtree they complete, in the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import Connection, Table, and_, func, insert, or_, select

from loraledger.errors import AuditCorruptError
from loraledger.evidence import tree_hash as th
from loraledger.evidence.tree_hash import NodeKey
from loraledger.store.models import MerkleNode

NODES: Table = MerkleNode.__table__  # type: ignore[assignment]
_KEYS_PER_QUERY = 200


def leaf_of_event(event_hash: str) -> bytes:
    """The leaf hash of an event: RFC 9162's leaf hash of its chain hash's 32 bytes."""
    return th.leaf_hash(bytes.fromhex(event_hash))


def fetch(conn: Connection, keys: Iterable[NodeKey]) -> dict[NodeKey, bytes]:
    """The stored hashes of keys; a key with no row is an error (the tree and its events disagree)."""
    wanted = sorted(set(keys))
    found: dict[NodeKey, bytes] = {}
    for start in range(0, len(wanted), _KEYS_PER_QUERY):
        chunk = wanted[start : start + _KEYS_PER_QUERY]
        where = or_(*(and_(NODES.c.level == level, NODES.c.idx == idx) for level, idx in chunk))
        for row in conn.execute(select(NODES.c.level, NODES.c.idx, NODES.c.hash).where(where)):
            found[(row.level, row.idx)] = bytes.fromhex(row.hash)
    missing = [key for key in wanted if key not in found]
    if missing:
        raise AuditCorruptError(
            f"the Merkle tree lacks node(s) {missing[:5]} (level, index): `merkle_nodes` was edited or the "
            "database predates revision 0009; run `loraledger audit verify`"
        )
    return found


def size(conn: Connection) -> int:
    """The number of leaves: the count of level-0 nodes (one per event)."""
    return int(conn.execute(select(func.count()).select_from(NODES).where(NODES.c.level == 0)).scalar_one())


def append_leaves(conn: Connection, first_index: int, event_hashes: Sequence[str]) -> None:
    """Add the events' leaves at first_index onward (first_index must be the tree's size), with every
    subtree they complete; inside the writer's transaction, after the events are chained."""
    if not event_hashes:
        return
    edge = fetch(conn, th.range_nodes(0, first_index))
    frontier = th.Frontier.resume(first_index, edge.__getitem__)
    rows = []
    for event_hash in event_hashes:
        for (level, idx), h in frontier.append(leaf_of_event(event_hash)):
            rows.append({"level": level, "idx": idx, "hash": h.hex()})
    conn.execute(insert(NODES), rows)


def root(conn: Connection, tree_size: int) -> bytes:
    return th.range_hash(0, tree_size, fetch(conn, th.range_nodes(0, tree_size)).__getitem__)


def _hashes(conn: Connection, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    nodes = fetch(conn, (key for a, b in ranges for key in th.range_nodes(a, b)))
    return [th.range_hash(a, b, nodes.__getitem__) for a, b in ranges]


def inclusion_proof(conn: Connection, index: int, tree_size: int) -> list[bytes]:
    return _hashes(conn, th.inclusion_ranges(index, tree_size))


def consistency_proof(conn: Connection, old_size: int, new_size: int) -> list[bytes]:
    return _hashes(conn, th.consistency_ranges(old_size, new_size))


def backfill(conn: Connection, batch: int = 10_000) -> int:
    """Build the tree over every event already on record (revision 0009); returns the number of leaves."""
    from loraledger.store.models import Event

    events: Table = Event.__table__  # type: ignore[assignment]
    done = 0
    while True:
        hashes = list(
            conn.execute(select(events.c.hash).where(events.c.seq > done).order_by(events.c.seq).limit(batch)).scalars()
        )
        if not hashes:
            return done
        append_leaves(conn, done, hashes)
        done += len(hashes)
