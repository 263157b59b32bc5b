"""Adapter-affinity routing on a simulated clock: many replicas, many adapters, Zipf traffic; hit rate and adapter
loads per second of Ray Serve's multiplexed routing vs round-robin. Pure Python (part of bench.scale_out).

The rule is Ray Serve's (ray/serve/_private/request_router/: the power-of-two-choices router with its multiplex
mixin): candidates are the replicas that hold the request's model id; when none does, or none of those accepts
(each accepts while its ongoing requests are under max_ongoing_requests), the replicas holding the fewest model
ids, then all replicas. From the candidates two are sampled at random and the one with the shorter queue that
accepts takes the request. Each replica keeps an LRU of max_num_models_per_replica model ids (the multiplexed
loader's cache); a request whose replica lacks its adapter loads it (a miss) and evicts the least recently used.
Round-robin sends request i to replica i mod R whatever it holds.

A request holds its replica for `service_s` (plus `load_s` on a miss). Arrivals are Poisson at `utilization` of
the cluster's capacity (R x max_ongoing / service_s).
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class SimConfig:
    replicas: int
    adapters: int = 1000
    zipf_s: float = 1.0  # adapter k (1-based) is asked for with weight k^-s
    models_per_replica: int = 16  # max_num_models_per_replica (= the engine's max_cpu_loras)
    max_ongoing: int = 32  # requests a replica takes at once (max_ongoing_requests)
    service_s: float = 2.0  # seconds a request holds its replica
    load_s: float = 0.2  # extra seconds of a request whose adapter is loaded first
    utilization: float = 0.7
    requests: int = 100_000
    seed: int = 0


@dataclass(frozen=True)
class SimResult:
    policy: str
    replicas: int
    requests: int
    hit_rate: float  # share of requests served by a replica that already held the adapter
    loads_per_s: float  # adapter loads per second, the whole cluster
    loads_per_s_per_replica: float
    seconds: float  # simulated


class Replica:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.models: OrderedDict[int, None] = OrderedDict()
        self.ongoing = 0

    def holds(self, adapter: int) -> bool:
        return adapter in self.models

    def serve(self, adapter: int) -> tuple[bool, int | None]:
        """Touch or load `adapter`: (hit, the adapter evicted to make room or None)."""
        if adapter in self.models:
            self.models.move_to_end(adapter)
            return True, None
        self.models[adapter] = None
        if len(self.models) > self.capacity:
            return False, self.models.popitem(last=False)[0]
        return False, None


class MultiplexedRouter:
    """Ray Serve's choice for a request with a multiplexed model id (see the module's docstring)."""

    def __init__(self, replicas: list[Replica], max_ongoing: int, rng: random.Random) -> None:
        self.replicas, self.max_ongoing, self.rng = replicas, max_ongoing, rng
        self.holders: dict[int, set[int]] = {}  # adapter -> indexes of the replicas holding it

    def choose(self, adapter: int) -> int | None:
        holders = self.holders.get(adapter)
        tiers = []
        if holders:
            tiers.append(list(holders))
        fewest = min(len(r.models) for r in self.replicas)
        tiers.append([i for i, r in enumerate(self.replicas) if len(r.models) == fewest])
        tiers.append(range(len(self.replicas)))
        for candidates in tiers:
            picked = self._two_choices(candidates)
            if picked is not None:
                return picked
        return None

    def _two_choices(self, candidates) -> int | None:
        sample = self.rng.sample(candidates, 2) if len(candidates) > 1 else list(candidates)
        accepting = [i for i in sample if self.replicas[i].ongoing < self.max_ongoing]
        return min(accepting, key=lambda i: self.replicas[i].ongoing) if accepting else None

    def served(self, index: int, adapter: int, evicted: int | None) -> None:
        self.holders.setdefault(adapter, set()).add(index)
        if evicted is not None:
            self.holders[evicted].discard(index)


class RoundRobinRouter:
    def __init__(self, replicas: list[Replica], max_ongoing: int, rng: random.Random) -> None:
        self.replicas, self.max_ongoing, self.cursor = replicas, max_ongoing, 0

    def choose(self, adapter: int) -> int | None:
        for _ in range(len(self.replicas)):
            index = self.cursor % len(self.replicas)
            self.cursor += 1
            if self.replicas[index].ongoing < self.max_ongoing:
                return index
        return None

    def served(self, index: int, adapter: int, evicted: int | None) -> None:
        pass


POLICIES = {"multiplexed": MultiplexedRouter, "round_robin": RoundRobinRouter}


def zipf_sampler(n: int, s: float, rng: random.Random):
    weights = [k**-s for k in range(1, n + 1)]
    adapters = list(range(n))
    rng.shuffle(adapters)  # popularity is not the adapter's index
    cum, total = [], 0.0
    for w in weights:
        total += w
        cum.append(total)
    return lambda: adapters[_bisect(cum, rng.random() * total)]


def _bisect(cum: list[float], x: float) -> int:
    lo, hi = 0, len(cum) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cum[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def simulate(config: SimConfig, policy: str) -> SimResult:
    rng = random.Random(config.seed)
    traffic = random.Random(config.seed + 1)  # the same arrivals and adapters for every policy
    next_adapter = zipf_sampler(config.adapters, config.zipf_s, traffic)
    replicas = [Replica(config.models_per_replica) for _ in range(config.replicas)]
    router = POLICIES[policy](replicas, config.max_ongoing, rng)
    rate = config.utilization * config.replicas * config.max_ongoing / config.service_s
    finishing: list[tuple[float, int]] = []  # (time, replica)
    waiting: list[int] = []  # adapters of requests no replica accepted yet, in arrival order
    now, hits, loads = 0.0, 0, 0

    def start(index: int, adapter: int) -> None:
        nonlocal hits, loads
        replica = replicas[index]
        hit, evicted = replica.serve(adapter)
        router.served(index, adapter, evicted)
        hits += hit
        loads += not hit
        replica.ongoing += 1
        heapq.heappush(finishing, (now + config.service_s + (0.0 if hit else config.load_s), index))

    for _ in range(config.requests):
        now += traffic.expovariate(rate)
        while finishing and finishing[0][0] <= now:
            _, index = heapq.heappop(finishing)
            replicas[index].ongoing -= 1
            while waiting:
                chosen = router.choose(waiting[0])
                if chosen is None:
                    break
                start(chosen, waiting.pop(0))
        adapter = next_adapter()
        chosen = router.choose(adapter) if not waiting else None
        if chosen is None:
            waiting.append(adapter)
        else:
            start(chosen, adapter)
    served = hits + loads
    return SimResult(
        policy=policy, replicas=config.replicas, requests=served, hit_rate=hits / served, loads_per_s=loads / now,
        loads_per_s_per_replica=loads / now / config.replicas, seconds=now,
    )  # fmt: skip
