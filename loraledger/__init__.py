"""loraledger: a multi-LoRA LLM inference engine whose every output is on record, bound to the adapter that wrote it."""

from loraledger.async_engine import AsyncEngine
from loraledger.engine_args import EngineArgs
from loraledger.errors import LoraLedgerError
from loraledger.llm import LLM
from loraledger.llm_engine import LLMEngine
from loraledger.lora_request import LoRARequest
from loraledger.outputs import CompletionOutput, RequestMetrics, RequestOutput
from loraledger.sampling_params import RequestOutputKind, SamplingParams
from loraledger.version import __version__

__all__ = [
    "LLM",
    "LLMEngine",
    "AsyncEngine",
    "EngineArgs",
    "SamplingParams",
    "LoRARequest",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "RequestOutputKind",
    "LoraLedgerError",
    "__version__",
]
