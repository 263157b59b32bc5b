"""Incremental detokenization of one sequence (the OutputAssembler keeps one per sequence)."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

# prompt tokens replayed before the first output token, so the first word gets its leading space
# exactly as it would in the middle of a text (SentencePiece/Metaspace decoders strip it at the start)
_CONTEXT_TOKENS = 4


class Detokenizer:
    """tokenizer None (detokenize=False, or no tokenizer at all): every add() returns "" (outputs carry token ids only)."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        if self._backend is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for token in prompt_token_ids[-_CONTEXT_TOKENS:]:
                self._stream.step(self._backend, token)
        self._text = ""

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens, return the text they complete (may be "" while a UTF-8 character is split)."""
        if self._tokenizer is None:
            return ""
        if self._backend is None:  # slow tokenizer: decode everything again (correct, rarely used)
            self._ids.extend(token_ids)
            text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
            if text.endswith("\ufffd"):
                return ""
            delta, self._text = text[len(self._text) :], text
            return delta
        out = []
        for token in token_ids:
            piece = self._stream.step(self._backend, token)
            if piece:
                out.append(piece)
        return "".join(out)
