"""`loraledger demo --serve`: the demo's model and adapters behind `loraledger serve` on loopback, with a demo key
and an `openai` snippet and a curl line that work as printed."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from loraledger.demo.mixed_batch import MAX_TOKENS, QUESTIONS

SERVED_NAME = "smollm2"
HOST = "127.0.0.1"


def serve_demo(files, audit_url: str, *, port: int, device: str) -> int:
    """Write a fresh keys file holding one demo key, print how to call the server, then serve until Ctrl-C."""
    from loraledger.cli import main
    from loraledger.server.auth import add_key

    keys = files.root / "demo-keys.toml"
    keys.unlink(missing_ok=True)  # one key, made now: a key printed by an earlier run stops working
    _, key = add_key(keys, tenant="demo", adapters=["*"])
    sys.stdout.write(instructions(key, port, list(files.adapters)))
    sys.stdout.flush()
    argv = ["serve", str(files.model_dir), "--served-model-name", SERVED_NAME, "--lora-modules"]
    argv += [f"{name}={path}" for name, path in files.adapters.items()]
    argv += ["--max-loras", str(len(files.adapters)), "--max-lora-rank", str(_max_rank(files.adapters.values()))]
    argv += ["--api-keys", str(keys), "--audit-url", audit_url, "--host", HOST, "--port", str(port)]
    argv += ["--device", device, "--log-level", "warning"]
    return main(argv)


def instructions(key: str, port: int, adapters: list[str]) -> str:
    base = f"http://{HOST}:{port}/v1"
    question = QUESTIONS[0]
    body = {
        "model": adapters[-1],
        "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    snippet = (
        "from openai import OpenAI\n\n"
        f'client = OpenAI(base_url="{base}", api_key="{key}")\n'
        "r = client.chat.completions.create(\n"
        f'    model="{adapters[0]}", messages=[{{"role": "user", "content": "{question}"}}], '
        f"max_tokens={MAX_TOKENS}, temperature=0\n"
        ")\n"
        "print(r.choices[0].message.content)  # r.id: its key in the audit log, for `loraledger audit show`\n"
    )
    curl = (
        f"curl -s {base}/chat/completions -H {shlex.quote('Authorization: Bearer ' + key)} "
        f"-H 'Content-Type: application/json' -d {shlex.quote(json.dumps(body))}"
    )
    models = ", ".join([SERVED_NAME, *adapters])
    return (
        f"\nServing on {base} (models: {models}) until Ctrl-C; every request goes into the same audit log.\n"
        f"Demo key (tenant 'demo'): {key}\n\nPython (pip install openai):\n\n{snippet}\nOr curl:\n\n{curl}\n\n"
    )


def _max_rank(folders) -> int:
    return max(json.loads((Path(f) / "adapter_config.json").read_text())["r"] for f in folders)
