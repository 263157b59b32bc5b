"""Engine child for the kill -9 tests: serves a stream of mixed-adapter requests and reports, on stdout, every output it releases.

``python -m tests.stress.engine_child --zygote --model DIR`` imports the engine (torch, transformers:
seconds), loads the model's tokenizer once, says ``READY`` and then reads commands on stdin:
``RUN <json list of arguments>`` forks one engine process that runs ``run(arguments)``;
``SYNC`` answers ``SYNCED`` (after a killed run, every line that run printed comes before it).
Forking from a warm process makes a crash round cost the engine's start, not the imports; the
fork happens before any torch computation or tokenizer parallelism in the zygote.

A run (``--model DIR --lora NAME=PATH ... --url URL --prefix P [--commit-delay-ms MS]``) prints one flushed line each:
``PID <pid>``; ``ENGINE`` once the engine runs; ``ADMITTED <id>`` when ``add_request`` returned
(the binding is committed); ``RELEASED <id> <n>`` when ``step()`` handed over the request's final
output with n completions; ``FAILED <id>`` for a request that ended in an error; ``DONE`` after
``--requests`` requests; ``EXIT <code>`` when it ends on its own. By default the stream never
ends: the parent is expected to SIGKILL the process, or to SIGTERM it: then it submits nothing
more, finishes what it holds, says ``DONE`` and stops cleanly. With ``--out PATH`` the run prints
to that file instead of the zygote's stdout (several runs at once: tests.stress.fleet), and says
``INSTANCE <id>`` (its instance id in the audit database) after ``ENGINE``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import traceback

RUN_LIMIT_S = 600.0


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def parse_run_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="engine_child run", description="one engine run")
    p.add_argument("--model", required=True, help="tiny model folder")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", help="an adapter to serve (repeatable)")
    p.add_argument("--url", required=True, help="audit database URL")
    p.add_argument("--prefix", required=True, help="request ids are <prefix>-<i>: unique per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--in-flight", type=int, default=6, help="requests kept unfinished at once")
    p.add_argument("--requests", type=int, default=1_000_000, help="stop (DONE) after this many")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--long", action="store_true", help="greedy requests of --max-tokens tokens each (EOS ignored)")
    p.add_argument(
        "--commit-delay-ms",
        type=float,
        default=0.0,
        help="hold every audit transaction open this long before it commits",
    )
    p.add_argument("--lease-seconds", type=float, default=30.0, help="EngineArgs.audit_lease_seconds")
    p.add_argument("--out", default=None, help="print to this file instead of stdout")
    return p.parse_args(argv)


def delay_commits(seconds: float) -> None:
    """A slow disk: each audit transaction waits, its rows written but not committed, so that kills land inside it
    (nothing of it may survive) and an output released before its commit would be caught."""
    import time

    from loraledger.store import audit_store

    write_rows = audit_store.write_batch

    def slow_write_batch(conn, batch, instance_id=None, **kwargs):
        checkpoint = write_rows(conn, batch, instance_id, **kwargs)
        time.sleep(seconds)
        return checkpoint

    audit_store.write_batch = slow_write_batch


def run(argv: list[str]) -> int:
    """Serve the request stream of one run (see the module docstring)."""
    from loraledger import EngineArgs, LLMEngine, LoRARequest, SamplingParams

    args = parse_run_args(argv)
    if args.out:
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    say(f"PID {os.getpid()}")
    if args.commit_delay_ms:
        delay_commits(args.commit_delay_ms / 1000)
    pairs = [spec.split("=", 1) for spec in args.lora]
    loras = [None] + [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(pairs)]
    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            enable_lora=bool(pairs),
            max_loras=max(1, len(pairs)),
            max_lora_rank=16,
            block_size=4,
            audit_url=args.url,
            seed=args.seed,
            num_threads=1,  # leave the other core to the parent
            audit_lease_seconds=args.lease_seconds,
            audit_timeout=min(5.0, args.lease_seconds / 2),
        )
    )
    say("ENGINE")
    if args.out:
        say(f"INSTANCE {engine.engine.instance_id}")
    rng = random.Random(args.seed)
    submitted = 0
    while True:
        while (
            not stopping.is_set()
            and submitted < args.requests
            and engine.get_num_unfinished_requests() < args.in_flight
        ):
            rid = f"{args.prefix}-{submitted}"
            n = 1 if args.long else rng.choice((1, 1, 2))
            params = SamplingParams(
                n=n,
                temperature=0.0 if n == 1 else 0.8,
                seed=rng.randrange(1 << 30),
                max_tokens=args.max_tokens if args.long else rng.randint(1, args.max_tokens),
                ignore_eos=args.long,
            )
            prompt = {"prompt_token_ids": [rng.randrange(4, 500) for _ in range(rng.randint(2, 12))]}
            # round robin, so that every adapter (and the base model) has requests in flight at any kill
            engine.add_request(rid, prompt, params, loras[submitted % len(loras)], tenant=f"tenant-{submitted % 3}")
            say(f"ADMITTED {rid}")
            submitted += 1
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if not out.finished:
                continue
            if out.request_id in engine.errors:
                say(f"FAILED {out.request_id}")
            else:
                say(f"RELEASED {out.request_id} {len(out.outputs)}")
    say("DONE")
    engine.close()
    return 0


def die_with_parent(limit_s: float) -> None:
    """An engine process never outlives its zygote (Linux: PR_SET_PDEATHSIG), nor runs past limit_s (a stray one
    would serve its endless stream forever if the test that owns it were itself killed)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    timer = threading.Timer(limit_s, lambda: os._exit(3))
    timer.daemon = True
    timer.start()


def fork_run(argv: list[str]) -> None:
    if os.fork() != 0:
        return
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        die_with_parent(RUN_LIMIT_S)
        code = run(argv)
    except BaseException:
        traceback.print_exc()
    finally:
        say(f"EXIT {code}")
        os._exit(code)  # never return into the zygote's loop


def zygote(model_dir: str) -> int:
    import loraledger  # noqa: F401  (the imports are the point: every run forks with them done)
    import loraledger.gpu.model_runner  # noqa: F401
    import loraledger.store.migrate  # noqa: F401
    from loraledger.engine_setup import load_tokenizer

    load_tokenizer(model_dir)  # the tokenizer's modules (transformers' too, for a folder that AutoTokenizer reads)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # runs are reaped by the kernel: a killed one leaves no zombie
    say("READY")
    for line in sys.stdin:
        command, _, rest = line.strip().partition(" ")
        if command == "RUN":
            fork_run(json.loads(rest))
        elif command == "SYNC":
            say("SYNCED")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zygote", action="store_true", help="import once, then fork a run per RUN command on stdin")
    p.add_argument("--model", required=True, help="the model folder whose tokenizer the zygote preloads")
    known, rest = p.parse_known_args(argv)
    if known.zygote:
        return zygote(known.model)
    return run(["--model", known.model, *rest])


if __name__ == "__main__":
    sys.exit(main())
