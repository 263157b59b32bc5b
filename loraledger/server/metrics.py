"""Prometheus metrics: vLLM's names that Kubernetes inference gateways scrape, and ours, labelled by adapter name.

vLLM's (read by gateways for adapter-affinity routing; `model_name` is the served base model):
- `vllm:lora_requests_info` (gauge, value: the scrape time): labels `running_lora_adapters` and
  `waiting_lora_adapters` (comma-separated names), `max_lora`;
- `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (0..1).

Ours: `loraledger_requests_total{adapter, outcome}` (outcome: ok, aborted, rejected = 4xx, failed = 5xx),
`loraledger_prompt_tokens_total{adapter}`, `loraledger_generation_tokens_total{adapter}`,
`loraledger_time_to_first_token_seconds{adapter}` and `loraledger_e2e_request_latency_seconds{adapter}`
(histograms, measured at the server), `loraledger_adapter_loads_total{adapter, where}` and
`loraledger_adapter_evictions_total{adapter, where}` (where: host = the host cache, device = a device slot),
`loraledger_adapter_load_failures_total{adapter}`, `loraledger_audit_queue_depth`,
`loraledger_audit_write_failures_total`, `loraledger_audit_commits_total`, `loraledger_audit_refused_total`,
`loraledger_audit_store_up`, `loraledger_requests_in_flight`, `loraledger_auth_failures_total{reason}`
(missing, invalid), `loraledger_access_denied_total{adapter}`, `loraledger_rate_limited_total{tenant}`.

The engine's part is read at scrape time (AsyncEngine.get_metrics), not polled.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loraledger.engine_metrics import EngineMetrics

disable_created_metrics()  # *_created series double every counter for nothing a dashboard reads (vLLM does the same)

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)


class ServerMetrics:
    """One registry per app (several apps in one process, as in tests, do not share series)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "loraledger_requests", "Requests by adapter and outcome", ["adapter", "outcome"], registry=r
        )
        self.prompt_tokens = Counter(
            "loraledger_prompt_tokens", "Prompt tokens of finished requests", ["adapter"], registry=r
        )
        self.generation_tokens = Counter("loraledger_generation_tokens", "Generated tokens", ["adapter"], registry=r)
        self.ttft = Histogram(
            "loraledger_time_to_first_token_seconds", "Time from request received to first token sent", ["adapter"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "loraledger_e2e_request_latency_seconds", "Time from request received to its last byte", ["adapter"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.auth_failures = Counter(
            "loraledger_auth_failures", "Requests refused for a missing or invalid API key", ["reason"], registry=r
        )
        self.access_denied = Counter(
            "loraledger_access_denied", "Requests for a model the key may not use", ["adapter"], registry=r
        )
        self.rate_limited = Counter(
            "loraledger_rate_limited", "Requests refused by a key's rate limit", ["tenant"], registry=r
        )
        self.engine = EngineCollector(model_name)
        r.register(self.engine)


class EngineCollector:
    """The engine's gauges and counters, from the EngineMetrics fetched just before the scrape is rendered."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.latest: EngineMetrics | None = None
        self.in_flight = 0

    def describe(self):
        return []  # collected at scrape time only

    def collect(self):
        labels = ["model_name"]
        in_flight = GaugeMetricFamily("loraledger_requests_in_flight", "Requests the server is handling", labels=labels)
        in_flight.add_metric([self.model_name], self.in_flight)
        yield in_flight
        m = self.latest
        if m is None:
            return
        s = m.stats
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in the running batch", s.num_requests_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed", s.num_requests_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage", s.kv_cache_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model_name], value)
            yield g
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        info.add_metric(
            [",".join(s.running_lora_adapters), ",".join(s.waiting_lora_adapters), str(s.max_loras)], time.time()
        )
        yield info
        loads = CounterMetricFamily(
            "loraledger_adapter_loads",
            "Adapter loads: host = read into the host cache, device = into a slot",
            labels=["adapter", "where"],
        )
        evictions = CounterMetricFamily(
            "loraledger_adapter_evictions",
            "Adapter evictions from the host cache or a device slot",
            labels=["adapter", "where"],
        )
        for where, load_counts, eviction_counts in (
            ("host", m.host_loads, m.host_evictions),
            ("device", s.slot_loads, s.slot_evictions),
        ):
            for name, n in sorted(load_counts.items()):
                loads.add_metric([name, where], n)
            for name, n in sorted(eviction_counts.items()):
                evictions.add_metric([name, where], n)
        yield loads
        yield evictions
        failures = CounterMetricFamily(
            "loraledger_adapter_load_failures", "Adapter loads that failed", labels=["adapter"]
        )
        for name, n in sorted(m.host_load_failures.items()):
            failures.add_metric([name], n)
        yield failures
        depth = GaugeMetricFamily("loraledger_audit_queue_depth", "Audit records (messages) not yet committed")
        depth.add_metric([], m.audit_queue_depth)
        yield depth
        up = GaugeMetricFamily(
            "loraledger_audit_store_up", "1 when the last audit write reached the store (0 with auditing off)"
        )
        up.add_metric([], 1.0 if m.audit_enabled and not m.audit_store_down else 0.0)
        yield up
        for name, doc, value in (
            ("loraledger_audit_commits", "Audit group commits", m.audit_commits),
            (
                "loraledger_audit_write_failures",
                "Audit writes that failed to reach the store (retries count)",
                m.audit_failures,
            ),
            ("loraledger_audit_refused", "Audit records the database refused for good", m.audit_refused),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
