"""kill -9 stress: SIGKILL an engine process at a random point, then prove the audit log kept its promises.

    python -m tests.stress.kill9 --rounds 20 [--url URL] [--model DIR --lora NAME=PATH ...] [--seed S]

After every kill (see tests.stress.checks): each output the engine released is on record (n
completions rows and its request_finished event); no request is half-written; every request seen
admitted has its binding row; the event chain verifies; and the next engine start on the same
database records exactly the unfinished requests as `request_interrupted`, plus one
`engine_recovered` naming them. Rounds share one database, so every restart also proves that the
earlier crashes left it usable. Kill points: just after the k-th ADMITTED or RELEASED line, or a
random delay after start; some rounds hold each audit transaction open for 20 ms so that kills land
inside one. Engine processes fork from one warm zygote (tests.stress.zygote), so a round costs an
engine start, not torch's imports. Without --model a tiny Llama and its three adapters are built in
a temporary folder; without --url a SQLite file there is used (the folder is kept if a round fails).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.stress.checks import log_problems, restart_problems
from tests.stress.zygote import ChildError, EngineRun, Zygote, parse_lines, run_argv

KILL_MODES = ("admitted", "released", "timer")
COMMIT_DELAYS_MS = (
    0.0,
    0.0,
    20.0,
)  # one round in three holds its audit transactions open, so that kills land inside them


@dataclass
class RoundResult:
    index: int
    kill_point: str
    admitted: int = 0
    released: int = 0
    interrupted: int = 0
    problems: list[str] = field(default_factory=list)


@dataclass
class StressSummary:
    url: str
    rounds: list[RoundResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def problems(self) -> list[str]:
        return [f"round {r.index} ({r.kill_point}): {p}" for r in self.rounds for p in r.problems]

    @property
    def released(self) -> int:
        return sum(r.released for r in self.rounds)

    @property
    def interrupted(self) -> int:
        return sum(r.interrupted for r in self.rounds)

    def render(self) -> str:
        lines = [
            f"{r.index:3d}  {r.kill_point:<40} admitted {r.admitted:4d}  released {r.released:4d}  "
            f"interrupted {r.interrupted:3d}  {'OK' if not r.problems else 'FAILED'}"
            for r in self.rounds
        ]
        ok = sum(1 for r in self.rounds if not r.problems)
        lines.append(
            f"kill -9 stress on {self.url}: {ok}/{len(self.rounds)} rounds OK, {self.released} released outputs all on record, "
            f"{self.interrupted} interrupted requests recorded at restart, {self.seconds:.0f}s"
        )
        lines += self.problems
        return "\n".join(lines)


def kill_at(run: EngineRun, mode: str, rng: random.Random) -> str:
    """Let the running engine go on until a random point of the given kind, then SIGKILL it; says where."""
    if mode == "admitted":
        k = rng.randint(1, 10)
        run.expect("ADMITTED", k)
        where = f"after ADMITTED #{k}"
    elif mode == "released":
        k = rng.randint(1, 12)
        run.expect("RELEASED", k)
        where = f"after RELEASED #{k}"
    elif mode == "timer":
        delay = rng.uniform(0.0, 1.0)
        run.read_for(delay)
        where = f"{delay * 1000:.0f} ms after start"
    else:
        raise ValueError(f"unknown kill mode {mode!r}; use one of {KILL_MODES}")
    run.kill()
    return where


def run_rounds(
    zygote: Zygote,
    model_dir: str | Path,
    loras: Mapping[str, str | Path],
    url: str,
    *,
    rounds: int,
    seed: int,
    modes: Sequence[str] | None = None,
    commit_delays_ms: Sequence[float] | None = None,
    log: Callable[[str], None] | None = None,
) -> StressSummary:
    """Run `rounds` kill rounds on one database; modes[i] picks round i's kill point and commit_delays_ms[i] how
    long its audit transactions stay open before they commit (default: random; see engine_child.delay_commits)."""
    rng = random.Random(seed)
    tag = uuid.uuid4().hex[:8]
    summary = StressSummary(url=url)
    started = time.monotonic()
    for i in range(rounds):
        mode = modes[i] if modes is not None else rng.choice(KILL_MODES)
        result = RoundResult(index=i, kill_point=mode)
        summary.rounds.append(result)
        delay = commit_delays_ms[i] if commit_delays_ms is not None else rng.choice(COMMIT_DELAYS_MS)
        extra = ["--commit-delay-ms", str(delay)]
        run = zygote.run(run_argv(model_dir, loras, url, f"k9-{tag}-r{i}", seed=seed * 1000 + i, extra=extra))
        try:
            run.expect("ENGINE")
            result.kill_point = kill_at(run, mode, rng) + (f", {delay:g} ms commits" if delay else "")
        except ChildError as exc:
            result.problems.append(str(exc))
            run.kill()
        admitted, released, odd = parse_lines(run.lines)
        result.admitted, result.released = len(admitted), len(released)
        result.problems += [f"the engine process said {line!r}" for line in odd]
        result.problems += log_problems(url, admitted, released)
        problems, interrupted = restart_problems(url, model_dir)
        result.problems += problems
        result.interrupted = len(interrupted)
        if log is not None:
            log(summary.render().splitlines()[i])
    summary.seconds = time.monotonic() - started
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--url", help="audit database URL (default: a SQLite file in a temporary folder)")
    p.add_argument("--model", help="model folder (default: build a tiny Llama with three adapters)")
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="with --model: an adapter to serve (repeatable)",
    )
    p.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="loraledger-kill9-"))
    if args.model:
        model_dir, loras = Path(args.model), dict(spec.split("=", 1) for spec in args.lora)
    else:
        from tests.model_fixtures import build_tiny_model

        tiny = build_tiny_model(workdir, "llama", seed=1)
        model_dir, loras = tiny.model_dir, {name: str(path) for name, path in tiny.adapters.items()}
    url = args.url or f"sqlite:///{workdir / 'audit.sqlite3'}"
    print(f"kill -9 stress: {args.rounds} rounds, seed {args.seed}, database {url}, work folder {workdir}", flush=True)
    with Zygote(model_dir, workdir / "engine.stderr") as zygote:
        summary = run_rounds(
            zygote, model_dir, loras, url, rounds=args.rounds, seed=args.seed, log=lambda line: print(line, flush=True)
        )
    print(summary.render().splitlines()[-1 - len(summary.problems)])
    for problem in summary.problems:
        print(problem)
    if summary.problems:
        print(f"work folder kept for inspection: {workdir}")
        return 1
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
