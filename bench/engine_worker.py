"""One engine (loraledger or vLLM's CPU build) in a process of its own, driven over stdin/stdout by bench.vs_vllm_cpu.

Run as a script by the interpreter of the engine's own environment (vLLM's lives in its own venv, where
loraledger is not installed), so it imports only the standard library at the top. Protocol: one JSON
object per line. After the engine is built it prints {"ready": true, "load_seconds", "memory"}; then
for each {"prompts": [[ids]], "adapters": [index or null], "max_tokens": n} it runs one greedy
generate() over the whole batch and prints {"seconds", "tokens", "ids"}; {"memory": true} answers the
process tree's memory; end of input ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# run as a script, this file's folder (bench/) heads sys.path, and its modules would shadow packages the
# engines import (bench/kernels.py against `kernels`): drop it; loraledger's worker gets the repository root
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def tree_memory(root: int | None = None) -> dict:
    """Resident bytes of this process and its descendants (vLLM may run its engine core in a child):
    total, anonymous and file-backed, from /proc/PID/status."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    total = {"rss": 0, "anon": 0, "file": 0, "processes": 0}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        fields = {}
        try:
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    key, _, value = line.partition(":")
                    if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                        fields[key] = int(value.split()[0]) * 1024
        except OSError:
            continue
        total["rss"] += fields.get("VmRSS", 0)
        total["anon"] += fields.get("RssAnon", 0)
        total["file"] += fields.get("RssFile", 0) + fields.get("RssShmem", 0)
        total["processes"] += 1
    return total


class Loraledger:
    def __init__(self, args) -> None:
        sys.path.insert(0, os.path.dirname(_HERE))
        from loraledger import LLM, LoRARequest, SamplingParams

        self.SamplingParams = SamplingParams
        extra = {"enable_lora": True, "max_loras": args.max_loras, "max_lora_rank": args.rank} if args.lora else {}
        self.llm = LLM(
            model=args.model,
            device="cpu",
            dtype=args.dtype,
            audit_url=None,
            num_threads=args.threads,
            max_num_seqs=args.max_num_seqs,
            kv_cache_bytes=args.kv_cache_bytes,
            **extra,
        )
        self.kv_cache_bytes = args.kv_cache_bytes
        self.loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(args.adapter or [])]

    def generate(self, prompts, adapters, max_tokens):
        params = self.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        requests = [None if a is None else self.loras[a] for a in adapters] if self.loras else None
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=requests)
        return [list(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        self.llm.close()


class Vllm:
    def __init__(self, args) -> None:
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        self.SamplingParams = SamplingParams
        extra = {"enable_lora": True, "max_loras": args.max_loras, "max_lora_rank": args.rank} if args.lora else {}
        self.llm = LLM(
            model=args.model,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            enforce_eager=True,
            **extra,
        )
        self.kv_cache_bytes = int(float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")) * (1 << 30))
        self.loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(args.adapter or [])]

    def generate(self, prompts, adapters, max_tokens):
        params = self.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        requests = [None if a is None else self.loras[a] for a in adapters] if self.loras else None
        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, lora_request=requests, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    def close(self) -> None:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("loraledger", "vllm"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--adapter", action="append", help="adapter folder (repeat; index = order)")
    parser.add_argument("--max-loras", type=int, default=6)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-bytes", type=int, default=None, help="loraledger's KV cache (vLLM: its env)")
    args = parser.parse_args()
    out = sys.stdout
    sys.stdout = sys.stderr  # engines' prints and progress bars stay off the protocol channel
    started = time.perf_counter()
    engine = (Loraledger if args.engine == "loraledger" else Vllm)(args)
    ready = {
        "ready": True,
        "load_seconds": time.perf_counter() - started,
        "memory": tree_memory(),
        "kv_cache_bytes": engine.kv_cache_bytes,
    }
    out.write(json.dumps(ready) + "\n")
    out.flush()
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("memory"):
                out.write(json.dumps({"memory": tree_memory()}) + "\n")
            else:
                t0 = time.perf_counter()
                ids = engine.generate(cmd["prompts"], cmd["adapters"], cmd["max_tokens"])
                seconds = time.perf_counter() - t0
                out.write(json.dumps({"seconds": seconds, "tokens": sum(map(len, ids)), "ids": ids}) + "\n")
            out.flush()
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
