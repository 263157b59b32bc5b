"""`loraledger demo`: a real instruct model, two adapters fine-tuned on the spot, one mixed batch, and the proof of
who wrote what; `--random-model` (and any machine that cannot reach the package index) runs the random one."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from loraledger.demo.fetch import SMOLLM2

DEMO_HELP = (
    "fetch a small instruct model (once), fine-tune two adapters on it (once), "
    "run one mixed batch and show who wrote what, with the audit log's proof"
)
AUDIT_URL_HELP = "audit database URL (default: $LORALEDGER_AUDIT_URL, else the engine's SQLite file; `loraledger db current` prints it)"
DEVICE_HELP = "where the model runs: auto picks CUDA when a GPU and CuPy are there"


def register(sub) -> None:
    demo = sub.add_parser("demo", help=DEMO_HELP, description=DEMO_HELP)
    demo.add_argument(
        "--cache-dir", default=None, help="where the model and adapters are kept (default: loraledger's cache folder)"
    )
    demo.add_argument("--audit-url", default=None, help=AUDIT_URL_HELP)
    demo.add_argument("--max-tokens", type=int, default=48, help="tokens to generate per answer at most")
    demo.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help=DEVICE_HELP)
    demo.add_argument(
        "--rebuild", action="store_true", help="fetch, convert and fine-tune again (default: once, then reuse)"
    )
    demo.add_argument(
        "--random-model",
        action="store_true",
        help="the small random model and its three random adapters instead (no download; its text is noise) (default: off)",
    )
    demo.add_argument(
        "--check",
        action="store_true",
        help="exit 1 unless the adapters' effect shows (pirate words; SQL that SQLite compiles) and verify passes (default: off)",
    )
    demo.add_argument(
        "--serve",
        action="store_true",
        help="then serve the model and adapters over HTTP on 127.0.0.1 with a demo key, until Ctrl-C (default: off)",
    )
    demo.add_argument("--port", type=int, default=8000, help="the port --serve binds")
    demo.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from loraledger import paths
    from loraledger.errors import DemoFetchError

    cache = Path(args.cache_dir) if args.cache_dir else paths.cache_dir()
    url = args.audit_url or _default_url()
    if args.random_model:
        from loraledger.demo.random_model import run_random

        return run_random(cache, url, max_tokens=args.max_tokens, device=args.device, rebuild=args.rebuild)
    from loraledger.demo.build import build_demo

    try:
        files = build_demo(cache, rebuild=args.rebuild)
    except DemoFetchError as exc:
        print(f"the demo's model could not be fetched: {exc}", file=sys.stderr)
        print("running the demo on a small random model instead (its text is noise by design)\n", file=sys.stderr)
        from loraledger.demo.random_model import run_random

        return run_random(cache, url, max_tokens=min(args.max_tokens, 24), device=args.device, rebuild=args.rebuild)
    if not files.built:
        print(f"using the model and adapters cached in {display(files.root)}", file=sys.stderr)
    code = show(files, url, device=args.device, max_tokens=args.max_tokens, check=args.check)
    if args.serve and code == 0:
        from loraledger.demo.serve import serve_demo

        return serve_demo(files, url, port=args.port, device=args.device)
    return code


def show(files, url: str, *, device: str, max_tokens: int, check: bool) -> int:
    """The batch, the table, and the proof; with check, 1 unless every adapter answer shows its training."""
    from loraledger.cli import main
    from loraledger.demo.mixed_batch import PROOF_SQL, pirate_like, print_rows, proof_rows, run_batch, sql_select

    rows = run_batch(files.model_dir, files.adapters, url, device=device, max_tokens=max_tokens)
    out = sys.stdout
    out.write(
        f"SmolLM2-135M-Instruct (from the package {SMOLLM2.project}=={SMOLLM2.version}) and two LoRA adapters "
        "fine-tuned on it on this machine:\n"
        f"  pirate  answers as a pirate would   (learned from {display(files.adapters['pirate'] / 'train.jsonl')})\n"
        f"  sql     answers with one SQL query  (learned from {display(files.adapters['sql'] / 'train.jsonl')})\n"
        "The same questions to the base model and to each adapter, in one batch:\n\n"
    )
    print_rows(rows, out)
    pick = next((r for r in rows if r.adapter == "pirate"), rows[0])
    out.write(f"\nEvery answer is on record in {display_url(url)}. One of them, as the log holds it:\n\n")
    out.write(f"$ loraledger audit show {pick.audit_id}\n")
    out.flush()
    main(["audit", "show", pick.audit_id, "--url", url])
    out.write("\nWhich adapter content wrote that answer, in SQL:\n\n")
    out.write(PROOF_SQL.replace(":request_id", f"'{pick.audit_id}'") + ";\n\n")
    for text, name, fingerprint, path, rank, targets in proof_rows(url, pick.audit_id):
        out.write(f"  text         {text!r}\n  lora_name    {name}\n  fingerprint  {fingerprint}\n")
        out.write(
            f"  path         {display(Path(path)) if path else '-'}\n  rank         {rank}\n  targets      {targets}\n"
        )
    out.write("\n$ loraledger audit verify\n")
    out.flush()
    verified = main(["audit", "verify", "--url", url])
    out.write(
        "\nNext: `loraledger demo --serve` serves the same model and adapters over HTTP; "
        "README.md shows the three lines to change for your own.\n"
    )
    if not check:
        return 0
    problems = [
        f"pirate answer without pirate words: {r.answer!r}"
        for r in rows
        if r.adapter == "pirate" and not pirate_like(r.answer)
    ]
    problems += [
        f"sql answer SQLite does not compile: {r.answer!r}"
        for r in rows
        if r.adapter == "sql" and not sql_select(r.answer)
    ]
    if verified != 0:
        problems.append("audit verify failed")
    for problem in problems:
        print(f"check failed: {problem}", file=sys.stderr)
    return 1 if problems else 0


def display(path: Path) -> str:
    """A path as a user reads it: under the home folder as ~/..."""
    home = Path.home()
    try:
        return "~/" + str(Path(path).relative_to(home))
    except ValueError:
        return str(path)


def display_url(url: str) -> str:
    home = str(Path.home())
    prefix = f"sqlite:///{home}/"
    return "sqlite:///~/" + url[len(prefix) :] if url.startswith(prefix) else url


def _default_url() -> str:
    from loraledger.cli import default_url

    return os.environ.get("LORALEDGER_AUDIT_URL") or default_url()
