"""Where a throughput scenario's time goes: `python -m bench.run --only profile --scenario mixed|base`.

Two views of one measured generate() call (after a warm-up), neither needing changes to the engine:

- inside the step, on the executor's worker thread: the torch profiler wraps every
  ModelRunner.launch and .finish call and sums each aten op's self CPU time; the model's parts (LoRA, the
  device ops, input preparation, sampling) are labelled with record_function so that their
  inclusive time shows up next to the ops;
- outside the step, on the engine's event-loop thread (scheduler, admission, output assembly):
  pyinstrument, started inside that thread through the LLM's anyio portal.

The profilers slow the run down (the torch profiler's start/stop around each step lands outside
forward_seconds, so overhead_fraction under profiling is meaningless): read the shares, not the
absolute seconds; `python -m bench.run` gives the unprofiled figures.
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import torch

from bench.bench_assets import model_assets
from bench.offline_engine import OfflineEngine
from bench.patching import wrap
from bench.throughput import WARMUP_SEED, ThroughputConfig, mixed_workload
from bench.workload import base_only

RESULTS = Path(__file__).resolve().parent / "results"

# (module, attribute owner path, label): parts of the step whose inclusive time is worth seeing
_LABELLED = (
    ("loraledger.gpu.model", "Model._lora", "lora delta (shrink + expand)"),
    ("loraledger.gpu.model", "Model._attention", "attention block (qkv, rope, kv write, attn, o)"),
    ("loraledger.gpu.model", "Model._mlp", "mlp block (gate_up, silu, down)"),
    ("loraledger.gpu.ops_torch", "TorchOps.lora_prepare", "ops.lora_prepare"),
    ("loraledger.gpu.ops_torch", "TorchOps.lora_shrink", "ops.lora_shrink"),
    ("loraledger.gpu.ops_torch", "TorchOps.lora_expand", "ops.lora_expand"),
    ("loraledger.gpu.ops_torch", "TorchOps.paged_attention_decode", "ops.paged_attention_decode"),
    ("loraledger.gpu.ops_torch", "TorchOps.prefill_attention", "ops.prefill_attention"),
    ("loraledger.gpu.ops_torch", "TorchOps.rms_norm", "ops.rms_norm"),
    ("loraledger.gpu.ops_torch", "TorchOps.rotary_embedding", "ops.rotary_embedding"),
    ("loraledger.gpu.ops_torch", "TorchOps.write_kv", "ops.write_kv"),
    ("loraledger.gpu.ops_torch", "TorchOps.silu_and_mul", "ops.silu_and_mul"),
    ("loraledger.gpu.model_runner", "ModelRunner._sample", "runner._sample"),
    ("loraledger.gpu.model_runner", "ModelRunner._apply_slot_changes", "runner._apply_slot_changes"),
    ("loraledger.gpu.model_runner", "build_forward_batch", "build_forward_batch"),
    ("loraledger.gpu.model_runner", "ModelRunner.launch", "runner.launch (whole step)"),
    ("loraledger.gpu.model_runner", "ModelRunner.finish", "runner.finish (whole step)"),
)


def _label(module_name: str, path: str, label: str) -> None:
    """Run `path` of `module_name` inside a torch profiler record_function named `label`."""

    def labelled(original):
        def call(*args, **kwargs):
            with torch.profiler.record_function(label):
                return original(*args, **kwargs)

        return call

    wrap(module_name, path, labelled)


class StepProfiler:
    """Runs the torch profiler around each ModelRunner.launch and .finish call (in whatever thread calls them;
    the Executor's step thread calls these two, not execute) and sums it up.

    Steps are kept apart by kind: "prefill" (some sequence brings more than one token) and "decode".
    """

    def __init__(self) -> None:
        # kind -> op or label -> [self us, total us, calls]
        self.ops: dict[str, dict[str, list[float]]] = collections.defaultdict(
            lambda: collections.defaultdict(lambda: [0.0, 0.0, 0])
        )
        self.steps: collections.Counter[str] = collections.Counter()
        self.kinds: dict[int, str] = {}  # runner -> kind of the step it launched last (finish follows launch)
        self.enabled = False

    def install(self) -> None:
        from loraledger.gpu.model_runner import ModelRunner

        for spec in _LABELLED:
            _label(*spec)
        profiler = self

        def profiled(original, kind_of):
            def call(runner, arg):
                if not profiler.enabled:
                    return original(runner, arg)
                kind = kind_of(runner, arg)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    out = original(runner, arg)
                table = profiler.ops[kind]
                for e in prof.key_averages():
                    entry = table[e.key]
                    entry[0] += e.self_cpu_time_total
                    entry[1] += e.cpu_time_total
                    entry[2] += e.count
                return out

            return call

        def launch_kind(runner, plan):
            kind = "prefill" if any(len(w.token_ids) > 1 for w in plan.seqs) else "decode"
            profiler.steps[kind] += 1
            profiler.kinds[id(runner)] = kind
            return kind

        ModelRunner.launch = profiled(ModelRunner.launch, launch_kind)
        ModelRunner.finish = profiled(ModelRunner.finish, lambda runner, step: profiler.kinds.get(id(runner), "decode"))

    def report(self, top: int) -> str:
        labels = {spec[2] for spec in _LABELLED}
        lines = []
        for kind in ("decode", "prefill"):
            table = self.ops.get(kind)
            if not table:
                continue
            step_total = sum(table.get(f"runner.{f} (whole step)", [0, 0, 0])[1] for f in ("launch", "finish")) or 1.0
            lines.append(f"{kind} steps: {self.steps[kind]}, runner.launch + finish {step_total / 1e6:.2f}s in all")
            lines.append("  aten ops by self CPU time (share of the step)")
            ops = sorted(((k, v) for k, v in table.items() if k not in labels), key=lambda kv: -kv[1][0])
            for name, (self_us, _, calls) in ops[:top]:
                lines.append(
                    f"    {name:<52} {self_us / 1e6:8.3f}s {100 * self_us / step_total:5.1f}%  calls {int(calls)}"
                )
            lines.append("  labelled parts by inclusive CPU time")
            for name, (_, total_us, calls) in sorted(
                ((k, v) for k, v in table.items() if k in labels), key=lambda kv: -kv[1][1]
            ):
                lines.append(
                    f"    {name:<52} {total_us / 1e6:8.3f}s {100 * total_us / step_total:5.1f}%  calls {int(calls)}"
                )
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run --only profile", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scenario", choices=("mixed", "base"), default="mixed", help="scenario 1 (mixed adapters) or 3 (base only)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    from pyinstrument import Profiler

    torch.set_num_threads(args.threads)
    cfg = ThroughputConfig(num_threads=args.threads)
    assets = model_assets()

    def workload(seed: int):
        w = mixed_workload(assets, cfg, seed)
        return w if args.scenario == "mixed" else base_only(w)

    steps = StepProfiler()
    steps.install()
    engine = OfflineEngine(assets.model_dir, assets.adapters, num_threads=args.threads)
    try:
        engine.generate(workload(WARMUP_SEED))
        bridge = engine.llm.llm_engine  # calls run on the event loop's thread: where the actors run
        loop_profiler = Profiler(interval=0.0005)
        bridge.call(loop_profiler.start)
        steps.enabled = True
        started = time.perf_counter()
        run = engine.generate(workload(0))
        wall = time.perf_counter() - started
        steps.enabled = False
        bridge.call(loop_profiler.stop)
    finally:
        engine.close()
    e = run.engine
    print(
        f"scenario {args.scenario}: {run.tokens} tokens in {wall:.2f}s under profiling; engine stats: {e['steps']} steps, "
        f"forward {e['forward_seconds']:.2f}s, prepare {e['prepare_seconds']:.2f}s, schedule {e['schedule_seconds']:.3f}s, "
        f"update {e['update_seconds']:.3f}s, step wall {e['wall_seconds']:.2f}s, overhead_fraction {e['overhead_fraction']:.3f}"
    )
    print(steps.report(args.top))
    print("\nevent-loop thread (actors), pyinstrument; epoll.poll is the loop waiting for work (idle):")
    print(
        loop_profiler.output_text(
            unicode=False, color=False, show_all=True, processor_options={"filter_threshold": 0.01}
        )
    )
    print("the same, functions by self time:")
    flat = loop_profiler.output_text(
        unicode=False, color=False, flat=True, processor_options={"filter_threshold": 0.0005}
    )
    print("\n".join(flat.splitlines()[: args.top + 8]))
    RESULTS.mkdir(parents=True, exist_ok=True)
    html = RESULTS / f"profile-{args.scenario}-loop.html"
    html.write_text(loop_profiler.output_html())
    print(f"written: {html}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
