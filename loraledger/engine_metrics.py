"""EngineMetrics: what a server's /metrics shows of one engine (AsyncEngine.get_metrics), gathered without a server."""

from __future__ import annotations

import msgspec

from loraledger.actors.step_stats import StatsSnapshot


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
