"""vLLM's POST /tokenize and /detokenize, with the tokenizer (and chat template) requests on that model use.

Their work runs in worker threads, at most TOKENIZE_THREADS at once (a request waits TOKENIZE_WAIT_SECONDS for one,
then gets 503): these routes are not counted against the server's capacity as generation is, and without a bound of
their own a flood of them took every thread of the shared pool that chat rendering, keys reloads and evidence reads
need.
"""

from __future__ import annotations

import anyio

from loraledger.server.auth import Caller
from loraledger.server.error_responses import APIError, unavailable
from loraledger.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from loraledger.server.serving_chat import OpenAIServingChat
from loraledger.server.serving_engine import check_unicode

TOKENIZE_THREADS = 4  # worker threads the tokenization routes may use at once
TOKENIZE_WAIT_SECONDS = 10.0  # a request waits this long for one, then 503


class OpenAIServingTokenization(OpenAIServingChat):
    _slots: anyio.CapacityLimiter | None = None

    async def _in_thread(self, work, *args):
        """work(*args) in a worker thread of the routes' own few; 503 when none frees up in time."""
        if self._slots is None:
            self._slots = anyio.CapacityLimiter(TOKENIZE_THREADS)
        acquired = False
        with anyio.move_on_after(TOKENIZE_WAIT_SECONDS):
            await self._slots.acquire()
            acquired = True
        if not acquired:
            raise unavailable(
                f"the tokenizer is busy with {TOKENIZE_THREADS} requests; retry shortly", "tokenizer_busy"
            )
        try:
            return await anyio.to_thread.run_sync(work, *args)
        finally:
            self._slots.release()

    async def _tokenizer(self, model: str, caller: Caller, route: str):
        lora = await self.models.resolve(model, caller, route)
        tokenizer = await self.engine.get_lora_tokenizer(lora)
        if tokenizer is None:
            raise APIError(400, "this server has no tokenizer (skip_tokenizer_init)", param="model")
        return lora, tokenizer

    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest, caller: Caller, route: str) -> dict:
        lora, tokenizer = await self._tokenizer(req.model, caller, route)
        if isinstance(req, TokenizeChatRequest):
            prompt, _ = await self.render(req, lora)
            ids = prompt["prompt_token_ids"]
        else:
            bound = self.state.limits.max_rendered_chars
            if len(req.prompt) > bound:
                raise APIError(
                    400, f"the prompt has {len(req.prompt)} characters; this server tokenizes at most {bound} "
                    "(its --max-rendered-chars)", param="prompt",
                )  # fmt: skip
            check_unicode(req.prompt, "prompt")
            ids = await self._in_thread(  # off the event loop: a long text takes a while
                lambda: tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            )
        return {
            "count": len(ids),
            "max_model_len": self.engine.max_model_len,
            "tokens": ids,
            "token_strs": (
                await self._in_thread(tokenizer.convert_ids_to_tokens, ids) if req.return_token_strs else None
            ),
        }

    async def detokenize(self, req: DetokenizeRequest, caller: Caller, route: str) -> dict:
        _, tokenizer = await self._tokenizer(req.model, caller, route)
        vocab = self.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": await self._in_thread(tokenizer.decode, req.tokens)}
