"""Scale-out: adapter-affinity routing (Ray Serve's multiplexed model ids) vs round-robin, live and simulated.

Live (`loraledger.server.ray_app` on a local Ray instance): 2 engine replicas over 16 rank-8 adapters of the bench
model, each replica holding `--max-cpu-loras` (4) in host memory and `--max-loras` (2) on the device, both writing
one PostgreSQL audit database (a fresh one per routing). The same `--requests` (192) completions, adapters drawn
Zipf(`--zipf`, 1.0) with a fixed seed, `--max-tokens` (16, ignore_eos) each, `--concurrency` (8) at a time, go
through the Router: `multiplexed` (adapter_affinity: Ray's multiplexed routing) and `round_robin` (no affinity;
Ray's experimental RoundRobinRouter on the replicas). Hit rate = 1 - adapter loads / requests, the loads counted
from the `adapter_loaded` events the replicas wrote to the audit log (a replica loads an adapter into its host
cache exactly when it serves a request for one it does not hold). Throughput = generated tokens / wall seconds.
On a 2-core machine both replicas and the client share the cores, so the absolute throughput says little about
two machines; the hit rate and the loads it saves are the point.

Simulated (bench.affinity_sim, the same routing rule on a simulated clock): 8-64 replicas, 1,000 adapters, Zipf
traffic: hit rate and adapter loads per second, multiplexed vs round-robin.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import anyio
import httpx

from bench.affinity_sim import SimConfig, simulate, zipf_sampler
from bench.stats import environment

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"
ROUND_ROBIN_ROUTER = "ray.serve.experimental.round_robin_router:RoundRobinRouter"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def postgres_database(admin_url: str):
    """A fresh PostgreSQL database (its SQLAlchemy URL), dropped afterwards."""
    import psycopg

    name = f"loraledger_scale_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        base = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def local_ray(tmp: Path, port: int):
    """Ray on loopback with its files under tmp; the replicas import this checkout's code."""
    import ray
    from ray import serve

    os.environ.update(RAY_TMPDIR=str(tmp), RAY_AUTH_MODE="disabled")
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RAY_TMPDIR": str(tmp), "RAY_AUTH_MODE": "disabled"}
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        _temp_dir=str(tmp),
        log_to_driver=False,
        runtime_env={"env_vars": env},
        _node_ip_address="127.0.0.1",
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(routing: str, app_args: dict, replicas: int) -> None:
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from loraledger.server.ray_app import EngineReplica, Router
    from loraledger.server.ray_config import RayServeArgs

    parsed = RayServeArgs.parse({**app_args, "adapter_affinity": routing == "multiplexed"})
    options = dict(num_replicas=replicas, ray_actor_options={"num_cpus": 1})
    if routing == "round_robin":
        options["request_router_config"] = RequestRouterConfig(request_router_class=ROUND_ROBIN_ROUTER)
    app = Router.options(ray_actor_options={"num_cpus": 0.5}).bind(
        EngineReplica.options(**options).bind(parsed), parsed
    )
    serve.run(app, name="loraledger", route_prefix="/")


async def drive(base_url: str, key: str, adapters: list[str], args) -> dict:
    """The fixed request sequence at `concurrency` at a time; wall seconds and generated tokens."""
    limiter = anyio.Semaphore(args.concurrency)
    tokens = 0
    failed = 0

    async def one(http: httpx.AsyncClient, i: int, model: str) -> None:
        nonlocal tokens, failed
        async with limiter:
            body = {
                "model": model,
                "prompt": f"request {i}: summarise the ticket",
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = await http.post(f"{base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            if r.status_code == 200:
                tokens += r.json()["usage"]["completion_tokens"]
            else:
                failed += 1

    draw = zipf_sampler(len(adapters), args.zipf, random.Random(args.seed))
    sequence = [adapters[draw()] for _ in range(args.requests)]
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http, anyio.create_task_group() as tg:
        for i, model in enumerate(sequence):
            tg.start_soon(one, http, i, model)
    return {"seconds": time.perf_counter() - started, "tokens": tokens, "failed": failed, "requests": len(sequence)}


def adapter_loads(audit_url: str) -> int:
    from sqlalchemy import func, select

    from loraledger.store.audit_store import EVENTS
    from loraledger.store.db import make_engine
    from loraledger.store.records import EventKind

    engine = make_engine(audit_url)
    try:
        with engine.connect() as conn:
            return conn.execute(
                select(func.count()).select_from(EVENTS).where(EVENTS.c.kind == EventKind.ADAPTER_LOADED)
            ).scalar_one()
    finally:
        engine.dispose()


def run_live(args) -> dict[str, dict]:
    from ray import serve

    from bench.bench_assets import churn_adapters, model_assets
    from loraledger.server.auth import add_key

    model_dir = model_assets().model_dir
    sources = churn_adapters(args.adapters)
    tmp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths live under it
    results = {}
    try:
        folder = tmp / "adapters"
        folder.mkdir()
        names = []
        for src in sources:
            (folder / src.name).symlink_to(src, target_is_directory=True)
            names.append(src.name)
        _, key = add_key(tmp / "keys.toml", tenant="bench", adapters=["*"])
        port = _free_port()
        with local_ray(tmp / "ray", port):
            for routing in ("multiplexed", "round_robin"):
                with postgres_database(args.pg) as audit_url:
                    app_args = dict(model=str(model_dir), audit_url=audit_url, adapters_dir=str(folder), api_keys_file=str(tmp / "keys.toml"),
                                    engine=dict(max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras, max_lora_rank=16,
                                                max_num_seqs=32, seed=0))  # fmt: skip
                    deploy(routing, app_args, args.replicas)
                    run = anyio.run(drive, f"http://127.0.0.1:{port}", key, names, args)
                    serve.delete("loraledger")
                    loads = adapter_loads(audit_url)
                served = run["requests"] - run["failed"]
                results[routing] = {
                    **run, "adapter_loads": loads, "hit_rate": 1 - loads / served if served else 0.0,
                    "tokens_per_s": run["tokens"] / run["seconds"], "requests_per_s": served / run["seconds"],
                }  # fmt: skip
                print(f"{routing:<12} hit rate {results[routing]['hit_rate']:.2f}  loads {loads:>4}  {results[routing]['tokens_per_s']:7.1f} tok/s  "
                      f"{results[routing]['requests_per_s']:5.2f} req/s  ({run['failed']} failed)", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def run_simulation(args) -> list[dict]:
    rows = []
    for replicas in args.sim_replicas:
        for policy in ("multiplexed", "round_robin"):
            config = SimConfig(replicas=replicas, adapters=args.sim_adapters, zipf_s=args.zipf, models_per_replica=args.sim_models_per_replica,
                               requests=args.sim_requests, seed=args.seed)  # fmt: skip
            rows.append(asdict(simulate(config, policy)))
    print(
        f"\nsimulated: {args.sim_adapters} adapters, Zipf s={args.zipf}, {args.sim_models_per_replica} adapters per replica, {args.sim_requests} requests"
    )
    print(f"{'replicas':>8}  {'policy':<12}{'hit rate':>9}{'loads/s':>10}{'loads/s/replica':>17}")
    for r in rows:
        print(
            f"{r['replicas']:>8}  {r['policy']:<12}{r['hit_rate']:>9.3f}{r['loads_per_s']:>10.1f}{r['loads_per_s_per_replica']:>17.2f}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run --only scale-out", description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2, help="live: engine replicas")
    parser.add_argument("--adapters", type=int, default=16, help="live: adapters in the folder")
    parser.add_argument("--max-loras", type=int, default=2, help="live: adapters on a replica's device at once")
    parser.add_argument(
        "--max-cpu-loras",
        type=int,
        default=4,
        help="live: adapters a replica holds in host memory (Ray's max_num_models_per_replica)",
    )
    parser.add_argument("--requests", type=int, default=192, help="live: requests per routing")
    parser.add_argument("--concurrency", type=int, default=8, help="live: requests in flight at once")
    parser.add_argument("--max-tokens", type=int, default=16, help="live: new tokens per request (ignore_eos)")
    parser.add_argument(
        "--zipf", type=float, default=1.0, help="adapter popularity: the k-th most asked-for has weight k^-s"
    )
    parser.add_argument("--seed", type=int, default=0, help="the request sequence's seed")
    parser.add_argument(
        "--pg", default=PG_ADMIN, help="a PostgreSQL server URL where the user may CREATE DATABASE (libpq form)"
    )
    parser.add_argument("--skip-live", action="store_true", help="only the simulation (no Ray, no PostgreSQL)")
    parser.add_argument(
        "--sim-replicas", type=int, nargs="+", default=[8, 16, 32, 64], help="simulated: replica counts"
    )
    parser.add_argument("--sim-adapters", type=int, default=1000, help="simulated: adapters")
    parser.add_argument("--sim-models-per-replica", type=int, default=16, help="simulated: adapters a replica holds")
    parser.add_argument("--sim-requests", type=int, default=100_000, help="simulated: requests per run")
    parser.add_argument("--out", type=Path, default=RESULTS / "scale_out.json")
    args = parser.parse_args(argv)

    live = {} if args.skip_live else run_live(args)
    sim = run_simulation(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "config": {k: str(v) for k, v in vars(args).items()},
                "live": live,
                "simulated": sim,
                "environment": environment(),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
