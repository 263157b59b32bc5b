"""LLM: vLLM's offline entry point — build once, then `generate(prompts, ...)` or `chat(messages, ...)`."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import msgspec

from loraledger.engine_args import EngineArgs, check_argument_names
from loraledger.errors import LoRARequestError, SamplingParamsError
from loraledger.llm_engine import LLMEngine
from loraledger.lora.request import LoRARequest
from loraledger.outputs import RequestOutput
from loraledger.prompts import PromptType, as_prompt_list
from loraledger.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """`LLM(model=..., enable_lora=True, max_loras=4, ...)`: keyword arguments are EngineArgs fields; an unknown
    one is a ConfigError naming the closest known argument."""

    def __init__(self, model: str, **kwargs) -> None:
        check_argument_names(kwargs, set(EngineArgs.__struct_fields__) - {"model"}, "LLM")
        args = EngineArgs(model=str(model), **kwargs)
        self.llm_engine = LLMEngine(args)
        # vLLM's request ids: generate() and chat() number their requests "0", "1", ... per LLM instance (vLLM's
        # request_counter); the audit log keys each with an id of its own (RequestOutput.audit_id)
        self.request_counter = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: a new SamplingParams with the model's generation_config.json defaults (generation_config="auto"),
        or plain SamplingParams() when it sets none (or generation_config="vllm"). generate() and chat() use it
        when sampling_params is None."""
        return self.llm_engine.engine.get_default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        tenant: str | None = None,
        use_tqdm: bool | Callable = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A bad prompt, parameter or adapter raises its typed error and
        nothing of the batch is returned (the requests already admitted are aborted).

        use_tqdm: show a progress bar of finished requests (tqdm's, on stderr), or a callable that builds the bar
        (called like tqdm: total=..., desc=...), as in vLLM."""
        return self._run(as_prompt_list(prompts), sampling_params, lora_request, tenant, use_tqdm)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list | None = None,
        chat_template_kwargs: dict | None = None,
        *,
        tenant: str | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or a list of them, each
        rendered with its request's chat template (loraledger.chat: `chat_template`, else the adapter's own, else
        the model's) and tokenized as vLLM does; one RequestOutput per conversation, in order. lora_request may be
        one for all or a list (one per conversation). Each output's `prompt` is the rendered text."""
        from loraledger.chat import conversations, render_chat

        convs = conversations(messages)
        n = len(convs)
        loras = _per_prompt(lora_request, n, "lora_request", LoRARequest, LoRARequestError)
        prompts, shas = [], []
        for conv, lora in zip(convs, loras):
            rendered = render_chat(
                self.llm_engine.get_tokenizer(lora),
                conv,
                chat_template=chat_template,
                chat_template_content_format=chat_template_content_format,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
            prompts.append({"prompt_token_ids": rendered.token_ids, "prompt": rendered.text})
            shas.append(rendered.template_sha256)
        return self._run(prompts, sampling_params, loras, tenant, use_tqdm, shas)

    def _run(
        self, prompt_list: list, sampling_params, lora_request, tenant, use_tqdm, chat_shas=None
    ) -> list[RequestOutput]:
        n = len(prompt_list)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, n, "sampling_params", SamplingParams, SamplingParamsError)
        # only the final output is returned here: do not have the engine build and stream the others
        # (replace checks the values again, and the engine keeps a frozen copy of its own)
        params = [msgspec.structs.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        loras = _per_prompt(lora_request, n, "lora_request", LoRARequest, LoRARequestError)
        engine = self.llm_engine.engine
        requests = [(str(next(self.request_counter)), prompt_list[i], params[i], loras[i], tenant) for i in range(n)]
        bar = _progress_bar(use_tqdm, n)
        try:
            return self.llm_engine.call(
                lambda: engine.generate_many(
                    requests, on_finished=None if bar is None else _advance(bar), chat_template_sha256=chat_shas
                )
            )
        finally:
            if bar is not None:
                bar.close()

    def get_tokenizer(self, lora_request: LoRARequest | None = None):
        """The tokenizer requests on `lora_request` use (the adapter's own, if its folder ships one); None with
        skip_tokenizer_init."""
        return self.llm_engine.get_tokenizer(lora_request)

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

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _progress_bar(use_tqdm: bool | Callable, total: int):
    """vLLM's progress bar: tqdm's, or the one the callable `use_tqdm` builds; None for use_tqdm=False."""
    if not use_tqdm or total == 0:
        return None
    if callable(use_tqdm):
        factory = use_tqdm
    else:
        from tqdm.auto import tqdm as factory
    return factory(total=total, desc="Processed prompts", dynamic_ncols=True)


def _advance(bar):
    def on_finished(_output) -> None:
        bar.update(1)

    return on_finished


def _per_prompt(value, n: int, name: str, kind: type, error: type[Exception]) -> list:
    """One value for every prompt: `value` itself, or the entries of a list of them (one per prompt)."""
    if value is None or isinstance(value, kind):
        return [value] * n
    if not isinstance(value, (list, tuple)):
        raise error(
            f"{name} must be a {kind.__name__}, None, or a list of them (one per prompt), got {type(value).__name__}"
        )
    values = list(value)
    if len(values) != n:
        raise error(f"{name} has {len(values)} entries for {n} prompts; give one, or one per prompt")
    for v in values:
        if v is not None and not isinstance(v, kind):
            raise error(f"{name} entries must be {kind.__name__} or None, got {type(v).__name__}")
    return values
