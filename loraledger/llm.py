"""LLM: vLLM's offline entry point — build once, then `generate(prompts, sampling_params, lora_request=...)`."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from loraledger.engine_args import EngineArgs
from loraledger.errors import ConfigError, LoRARequestError, SamplingParamsError
from loraledger.llm_engine import LLMEngine
from loraledger.lora_request import LoRARequest
from loraledger.outputs import RequestOutput
from loraledger.prompts import as_prompt_list
from loraledger.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """`LLM(model=..., enable_lora=True, max_loras=4, ...)`: keyword arguments are EngineArgs fields."""

    def __init__(self, model: str, **kwargs) -> None:
        try:
            args = EngineArgs(model=str(model), **kwargs)
        except TypeError as exc:
            raise ConfigError(f"unknown LLM argument: {exc}; see loraledger.EngineArgs for the accepted names") from exc
        self.llm_engine = LLMEngine(args)

    def generate(
        self,
        prompts: object,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        tenant: str | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A bad prompt, parameter or adapter raises its typed error and
        nothing of the batch is returned (the requests already admitted are aborted)."""
        del use_tqdm  # accepted for vLLM compatibility; outputs arrive in one batch here
        prompt_list = as_prompt_list(prompts)
        n = len(prompt_list)
        params = _per_prompt(sampling_params if sampling_params is not None else SamplingParams(), n, "sampling_params", SamplingParams, SamplingParamsError)
        # only the final output is returned here: do not have the engine build and stream the others
        # (replace checks the values again, and the engine keeps a frozen copy of its own)
        params = [msgspec.structs.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        loras = _per_prompt(lora_request, n, "lora_request", LoRARequest, LoRARequestError)
        engine = self.llm_engine.engine
        requests = [(engine.new_request_id(), prompt_list[i], params[i], loras[i], tenant) for i in range(n)]
        return self.llm_engine._portal.call(engine.generate_many, requests)

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_int_id)

    def pin_lora(self, lora_int_id: int) -> bool:
        return self.llm_engine.pin_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    def get_stats(self):
        return self.llm_engine.get_stats()

    def close(self) -> None:
        self.llm_engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _per_prompt(value, n: int, name: str, kind: type, error: type[Exception]) -> list:
    """One value for every prompt: `value` itself, or the entries of a list of them (one per prompt)."""
    if value is None or isinstance(value, kind):
        return [value] * n
    if not isinstance(value, (list, tuple)):
        raise error(f"{name} must be a {kind.__name__}, None, or a list of them (one per prompt), got {type(value).__name__}")
    values = list(value)
    if len(values) != n:
        raise error(f"{name} has {len(values)} entries for {n} prompts; give one, or one per prompt")
    for v in values:
        if v is not None and not isinstance(v, kind):
            raise error(f"{name} entries must be {kind.__name__} or None, got {type(v).__name__}")
    return values
