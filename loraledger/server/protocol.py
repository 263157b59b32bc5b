"""Request bodies in OpenAI's and vLLM's shapes (pydantic), checked for types here and for values by SamplingParams.

Fields OpenAI's API has and this server does not act on are refused with a 400 naming them (an audited request
does what its record says), except those listed in IGNORED, which change nothing about the output: they are dropped
and the response names them in a `Warning` header. vLLM's extra sampling fields (top_k, min_p, repetition_penalty,
...) are accepted in the body, where the openai client's `extra_body` puts them. OpenAI's legacy `functions` /
`function_call` are taken as the `tools` / `tool_choice` they stand for (legacy_functions.py). Responses are built as
plain dicts (serving_*.py) and encoded with msgspec.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from loraledger.server.legacy_functions import as_tool_messages, as_tools

# fields OpenAI or vLLM accept that change nothing about the output here: dropped, and named in the response's
# Warning header. Billing, storage and routing hints of OpenAI's own service; `verbosity` (a hint to OpenAI's own
# reasoning models), `prediction` (predicted output: a latency hint, the answer is the model's either way);
# vLLM's `kv_transfer_params` (disaggregated prefill: the KV is computed here, the response's is null)
IGNORED = (
    "store", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier",
    "verbosity", "prediction", "kv_transfer_params",
)  # fmt: skip


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _drop_ignored(cls, data: Any, handler) -> Any:
        dropped: tuple[str, ...] = ()
        if isinstance(data, dict) and any(k in data for k in IGNORED):
            dropped = tuple(k for k in IGNORED if k in data)
            data = {k: v for k, v in data.items() if k not in IGNORED}
        body = handler(data)
        body._ignored = dropped
        return body

    @property
    def ignored_fields(self) -> tuple[str, ...]:
        """The IGNORED fields this body held (dropped before validation): the response's Warning header names them."""
        return self._ignored


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Sampling(_Body):
    """The sampling fields completions and chat share (OpenAI's, then vLLM's extras)."""

    model: str = Field(min_length=1, max_length=256)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = Field(default=None, max_length=1024)
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stop_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    use_beam_search: bool | None = False
    priority: int | None = 0
    request_id: str | None = Field(
        default=None, min_length=1, max_length=1024
    )  # vLLM's: the caller's id, if no X-Request-Id
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)  # vLLM's: prefix-cache isolation
    vllm_xargs: dict[str, Any] | None = None  # vLLM: SamplingParams.extra_args (kept on record)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs (StructuredOutputsParams' fields), or
    # vLLM's legacy guided_* fields; one of them per request
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions (OpenAI's legacy completions, with vLLM's extras)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = True


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions (with vLLM's chat extras)."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI for max_completion_tokens; both are taken, as vLLM does
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None  # OpenAI's legacy form of tools: served as tools
    function_call: str | dict[str, Any] | None = None  # ... and of tool_choice
    documents: list[dict[str, Any]] | None = None  # for RAG templates, as transformers' apply_chat_template(documents=)
    reasoning_effort: str | None = Field(default=None, max_length=64)  # to the chat template, as vLLM passes it
    modalities: list[str] | None = None  # output modalities: ["text"] only
    echo: bool | None = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(m != "text" for m in value):
            raise ValueError(f'this server answers in text only; modalities {value} asks for more (send ["text"])')
        return value

    @model_validator(mode="after")
    def _legacy_functions(self) -> ChatCompletionRequest:
        """`functions` / `function_call` become the `tools` / `tool_choice` they stand for (`functions` stays set:
        the answer then also carries the legacy `message.function_call`)."""
        if self.functions is not None or self.function_call is not None:
            self.tools, self.tool_choice = as_tools(self.functions, self.function_call, self.tools, self.tool_choice)
        if any(isinstance(m, dict) and (m.get("role") == "function" or "function_call" in m) for m in self.messages):
            self.messages = as_tool_messages(self.messages)
        return self


class LoadLoRAAdapterRequest(_Body):
    """vLLM's POST /v1/load_lora_adapter body."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's POST /v1/unload_lora_adapter body."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


class TokenizeCompletionRequest(_Body):
    model: str = Field(min_length=1, max_length=256)
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Body):
    model: str = Field(min_length=1, max_length=256)
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Body):
    model: str = Field(min_length=1, max_length=256)
    tokens: list[int]
