"""loraledger.demo.serve: the server it starts answers the `openai` snippet and the curl line exactly as printed
(here on the tiny fixture model, with two of its adapters standing for the demo's)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys

from tests.server.live import free_port, wait_healthy

LAUNCH = """
import sys
from pathlib import Path
from loraledger.demo.build import DemoFiles
from loraledger.demo.serve import serve_demo
root, model, pirate, sql, url, port = sys.argv[1:]
files = DemoFiles(Path(root), Path(model), {"pirate": Path(pirate), "sql": Path(sql)})
sys.exit(serve_demo(files, url, port=int(port), device="cpu"))
"""


def test_the_printed_snippet_and_curl_line_work_as_printed(tiny_llama_chat, tmp_path):
    port = free_port()
    adapters = tiny_llama_chat.adapters
    argv = [sys.executable, "-c", LAUNCH, str(tmp_path), str(tiny_llama_chat.model_dir), str(adapters["qv_r4"]),
            str(adapters["all_r8"]), f"sqlite:///{tmp_path / 'audit.db'}", str(port)]  # fmt: skip
    out = tmp_path / "out.txt"
    with out.open("w") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=120, proc=proc)
        printed = out.read_text()
        assert "Demo key (tenant 'demo'): ll-" in printed and str(tmp_path) not in printed.split("Demo key")[1]
        snippet = printed[printed.index("from openai import OpenAI") : printed.index("\nOr curl:")]
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            exec(compile(snippet, "the demo's openai snippet", "exec"), {"__name__": "__main__"})
        assert said.getvalue().strip()
        curl = next(line for line in printed.splitlines() if line.startswith("curl -s "))
        answer = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
        assert answer.returncode == 0 and '"object":"chat.completion"' in answer.stdout, answer.stdout
        assert '"model":"sql"' in answer.stdout
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C, as the printed line says
        assert proc.wait(timeout=60) == 0
