"""loraledger: a multi-LoRA LLM inference engine whose every output is on record, bound to the adapter that wrote it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from loraledger.version import __version__

# public name -> module; imported on first use so `loraledger audit ...` does not pay for torch
_EXPORTS = {
    "LLM": "loraledger.llm",
    "LLMEngine": "loraledger.llm_engine",
    "AsyncEngine": "loraledger.async_engine",
    "AsyncLLMEngine": "loraledger.async_llm_engine",
    "EngineArgs": "loraledger.engine_args",
    "AsyncEngineArgs": "loraledger.engine_args",
    "SamplingParams": "loraledger.sampling_params",
    "RequestOutputKind": "loraledger.sampling_params",
    "LoRARequest": "loraledger.lora.request",
    "RequestOutput": "loraledger.outputs",
    "CompletionOutput": "loraledger.outputs",
    "Logprob": "loraledger.outputs",
    "RequestStateStats": "loraledger.outputs",
    "RequestMetrics": "loraledger.outputs",
    "PromptType": "loraledger.prompts",
    "TextPrompt": "loraledger.prompts",
    "TokensPrompt": "loraledger.prompts",
    "LoraLedgerError": "loraledger.errors",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from loraledger.async_engine import AsyncEngine
    from loraledger.async_llm_engine import AsyncLLMEngine
    from loraledger.engine_args import AsyncEngineArgs, EngineArgs
    from loraledger.errors import LoraLedgerError
    from loraledger.llm import LLM
    from loraledger.llm_engine import LLMEngine
    from loraledger.lora.request import LoRARequest
    from loraledger.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, RequestStateStats
    from loraledger.prompts import PromptType, TextPrompt, TokensPrompt
    from loraledger.sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'loraledger' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
