"""EngineMetrics: what a server's /metrics shows of one engine (AsyncEngine.get_metrics), gathered without a server."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from loraledger.actors.step_stats import StatsSnapshot

if TYPE_CHECKING:
    from loraledger.actors.engine_core import EngineCore


class EngineMetrics(msgspec.Struct, frozen=True, kw_only=True):
    stats: StatsSnapshot  # the Scheduler's: queues, KV use, device-slot loads and evictions, step timings
    host_loads: dict[str, int]  # adapter name -> reads from disk into the host cache
    host_evictions: dict[str, int]  # adapter name -> drops from the host cache (max_cpu_loras)
    host_load_failures: dict[str, int]  # adapter name -> loads that failed
    audit_enabled: bool
    audit_queue_depth: int  # audit messages not yet committed
    audit_commits: int
    audit_failures: int  # writes that failed because the store was unreachable (retries count)
    audit_refused: int  # messages the database refused for good
    audit_store_down: bool  # the last write failed to reach the store
    dead: bool  # a fatal error stopped the engine


def engine_metrics(core: EngineCore, stats: StatsSnapshot) -> EngineMetrics:
    """The metrics of a running engine's actors, with the Scheduler's snapshot `stats`."""
    loader, audit = core.loader_stats, core.audit_stats
    return EngineMetrics(
        stats=stats,
        host_loads=dict(loader.loads) if loader is not None else {},
        host_evictions=dict(loader.evictions) if loader is not None else {},
        host_load_failures=dict(loader.failures) if loader is not None else {},
        audit_enabled=audit is not None,
        audit_queue_depth=core.audit_queue_depth(),
        audit_commits=audit.commits if audit is not None else 0,
        audit_failures=audit.failures if audit is not None else 0,
        audit_refused=audit.refused if audit is not None else 0,
        audit_store_down=audit.store_down if audit is not None else False,
        dead=core.fatal is not None,
    )
