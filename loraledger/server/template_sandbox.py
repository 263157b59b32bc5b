"""TemplateSandbox: a chat template a request brought (--trust-request-chat-template) rendered in a worker process
with a deadline and a memory bound, so a template that loops or multiplies strings costs its caller a 400 and the
server nothing: the worker is killed and the next render starts a new one.

Jinja's sandbox stops a template from reaching Python's internals, not from running long or building a huge string,
and a thread cannot be stopped; a process can. The worker renders with loraledger.chat.render_chat, the same code
as the model's own template, on a copy of the tokenizer it is sent once (kept by key).
"""

from __future__ import annotations

import multiprocessing
import pickle
from typing import Any

import anyio

from loraledger.chat import RenderedChat
from loraledger.errors import ChatTemplateError

START_SECONDS = 60.0  # a new worker imports the package (torch included) before its first render
_KEPT_TOKENIZERS = 8


def _serve(conn, memory_headroom: int) -> None:  # the worker process
    import resource

    from loraledger.chat import render_chat

    try:  # bound what a render may allocate beyond what the worker holds once started
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (size + memory_headroom, resource.RLIM_INFINITY))
    except (OSError, ValueError):  # no /proc, or a hard limit below ours: the deadline still holds
        pass
    tokenizers: dict[str, Any] = {}
    while True:
        try:
            key, blob, messages, kwargs, max_chars = conn.recv()
        except EOFError:
            return
        try:
            if blob is not None:
                if len(tokenizers) >= _KEPT_TOKENIZERS:
                    tokenizers.pop(next(iter(tokenizers)))
                tokenizers[key] = pickle.loads(blob)
            rendered = render_chat(tokenizers[key], messages, **kwargs)
            if len(rendered.text) > max_chars:
                raise ChatTemplateError(
                    f"the chat template rendered {len(rendered.text)} characters, over the bound of {max_chars}"
                )
            conn.send(("ok", rendered.text, rendered.token_ids, rendered.template_sha256))
        except ChatTemplateError as exc:
            conn.send(("error", str(exc)))
        except MemoryError:
            conn.send(("error", "the chat template needed more memory than a render may use"))
        except Exception as exc:
            conn.send(("error", f"the chat template could not render the conversation: {type(exc).__name__}"))


class TemplateSandbox:
    """One worker process, one render at a time (the lock); `render` raises ChatTemplateError on a template that
    fails, runs past `seconds`, needs more than `memory_bytes` or renders more than `max_chars` characters."""

    def __init__(self, *, seconds: float, max_chars: int, memory_bytes: int = 512 << 20) -> None:
        self.seconds, self.max_chars, self.memory_bytes = seconds, max_chars, memory_bytes
        self._lock = anyio.Lock()
        self._proc = None
        self._conn = None
        self._sent: set[str] = set()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds threads and a device
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self.memory_bytes), name="chat-template-sandbox", daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn, self._sent = proc, parent, set()

    def _stop(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        self._sent = set()
        if proc is not None:
            proc.kill()
            proc.join(5)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        self._stop()

    def _exchange(self, request: tuple) -> tuple:
        conn = self._conn
        conn.send(request)
        if not conn.poll(START_SECONDS + self.seconds):  # the caller's deadline is shorter; this only frees the thread
            raise TimeoutError
        return conn.recv()

    async def render(self, tokenizer, messages, **kwargs) -> RenderedChat:
        key = f"{id(tokenizer)}:{getattr(tokenizer, 'name_or_path', '')}:{len(tokenizer)}"
        async with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._stop()
                await anyio.to_thread.run_sync(self._start)
            fresh = key not in self._sent
            blob = pickle.dumps(tokenizer) if fresh else None
            # the first render of a new worker waits for its imports too
            limit = self.seconds + (START_SECONDS if not self._sent else 0.0)
            reply = None
            with anyio.move_on_after(limit):
                try:
                    reply = await anyio.to_thread.run_sync(
                        self._exchange, (key, blob, messages, kwargs, self.max_chars), abandon_on_cancel=True
                    )
                except (EOFError, OSError, TimeoutError):
                    reply = None
            if reply is None:
                self._stop()  # killed: whatever it was doing ends with it
                raise ChatTemplateError(
                    f"the request's chat template did not render within {self.seconds:g} s (or its worker died); "
                    "it was stopped"
                )
            if reply[0] == "ok":
                self._sent.add(key)
        if reply[0] == "error":
            raise ChatTemplateError(reply[1])
        _, text, ids, sha = reply
        return RenderedChat(text=text, token_ids=ids, template_sha256=sha)
