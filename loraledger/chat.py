"""Chat conversations rendered to prompt token ids with a chat template, as vLLM's LLM.chat renders them.

One module for every entry point that takes chat messages (LLM.chat now, the HTTP server's
/v1/chat/completions later). The rules are vLLM's:
- the template is the one given, else the tokenizer's (an adapter that ships its own tokenizer or
  chat template brings its own: loraledger.tokenizer_group); none at all is an error (transformers
  no longer has a default template);
- it is rendered by transformers' apply_chat_template (a sandboxed Jinja environment) to text, and
  the text is tokenized without adding special tokens: the template writes them (no second BOS);
- message content is a str, or a list of {"type": "text", "text": ...} parts, joined with "\\n"
  for templates that take a string (vLLM's "string" content format; "openai" keeps the parts);
- add_generation_prompt and continue_final_message cannot both be True.
The sha256 of the template text used comes with the result, to be put on record with the request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from loraledger.digests import text_sha256
from loraledger.errors import ChatTemplateError, NoTokenizerError

CONTENT_FORMATS = ("auto", "string", "openai")
# apply_chat_template arguments that chat_template_kwargs may not set: they decide what comes back, not the text
_RESERVED = frozenset(
    {"conversation", "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)


class RenderedChat(msgspec.Struct, frozen=True):
    text: str  # the template's output
    token_ids: list[int]  # text tokenized without special tokens added
    template_sha256: str  # sha256 hex of the chat template's text


def conversations(messages: object) -> list[list[Mapping]]:
    """One conversation (a list of messages) or several (a list of such lists), as vLLM's LLM.chat takes them."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(
            f"messages must be a list of message dicts, or a list of such lists, got {type(messages).__name__}"
        )
    items = list(messages)
    if items and all(isinstance(m, Sequence) and not isinstance(m, (str, bytes, Mapping)) for m in items):
        return [list(c) for c in items]
    return [items]


def resolve_chat_template(tokenizer, chat_template: str | None = None, tools=None) -> str:
    """The template text to render with: `chat_template` (a template, or the name of one of the tokenizer's),
    else the tokenizer's own (its "tool_use" one when tools are given and it has one)."""
    if tokenizer is None:
        raise NoTokenizerError(
            "chat needs a tokenizer and its chat template, and this engine was built with skip_tokenizer_init=True"
        )
    if chat_template is not None and not isinstance(chat_template, str):
        raise ChatTemplateError(
            f"chat_template must be a str (the template itself), got {type(chat_template).__name__}"
        )
    try:
        return tokenizer.get_chat_template(chat_template, tools)
    except ValueError as exc:
        raise ChatTemplateError(
            f"no chat template to render the conversation with ({exc}); pass chat_template=..., or use a tokenizer "
            "(or an adapter folder) that has one"
        ) from None


def render_chat(
    tokenizer,
    messages: Sequence[Mapping],
    *,
    chat_template: str | None = None,
    chat_template_content_format: str = "auto",
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list | None = None,
    chat_template_kwargs: Mapping | None = None,
    documents: list | None = None,
) -> RenderedChat:
    """Render one conversation and tokenize it as vLLM does. Raises ChatTemplateError (a PromptError).

    chat_template_kwargs go to the template as extra variables and, as in vLLM, may also set
    chat_template, add_generation_prompt, continue_final_message, tools and documents. `documents` (a list of
    dicts, e.g. {"title", "text"}) go to the template as transformers' apply_chat_template(documents=...) gives them
    to retrieval-augmented templates."""
    if chat_template_content_format not in CONTENT_FORMATS:
        raise ChatTemplateError(
            f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, got {chat_template_content_format!r}"
        )
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise ChatTemplateError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
    extra = dict(chat_template_kwargs or {})
    if not all(isinstance(k, str) for k in extra):
        raise ChatTemplateError("chat_template_kwargs keys must be str")
    reserved = sorted(_RESERVED & set(extra))
    if reserved:
        raise ChatTemplateError(
            f"chat_template_kwargs may not set {reserved}: they decide what rendering returns, not the text"
        )
    chat_template = extra.pop("chat_template", chat_template)
    add_generation_prompt = extra.pop("add_generation_prompt", add_generation_prompt)
    continue_final_message = extra.pop("continue_final_message", continue_final_message)
    tools = extra.pop("tools", tools)
    documents = extra.pop("documents", documents)
    if documents is not None and not (
        isinstance(documents, Sequence) and not isinstance(documents, (str, bytes))
        and all(isinstance(d, Mapping) for d in documents)
    ):  # fmt: skip
        raise ChatTemplateError("documents must be a list of dicts (for example {'title': ..., 'text': ...})")
    if not isinstance(add_generation_prompt, bool) or not isinstance(continue_final_message, bool):
        raise ChatTemplateError("add_generation_prompt and continue_final_message must be True or False")
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError(
            "add_generation_prompt and continue_final_message cannot both be True: continue the final message, or "
            "start a new assistant message (pass add_generation_prompt=False with continue_final_message=True)"
        )
    template_text = resolve_chat_template(tokenizer, chat_template, tools)
    conversation = [_message(m, i, chat_template_content_format) for i, m in enumerate(messages)]
    if not conversation:
        raise ChatTemplateError("the conversation has no messages")
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=template_text,
            tools=tools,
            documents=None if documents is None else [dict(d) for d in documents],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **extra,
        )
    except Exception as exc:  # Jinja's errors, and the template's own raise_exception(...)
        raise ChatTemplateError(
            f"the chat template could not render the conversation: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(text, str):
        raise ChatTemplateError(f"the chat template rendered {type(text).__name__}, not text")
    token_ids = list(tokenizer.encode(text, add_special_tokens=False))
    return RenderedChat(text=text, token_ids=token_ids, template_sha256=text_sha256(template_text))


def _message(message: object, index: int, content_format: str) -> dict:
    """A copy of one message with its content as the template takes it."""
    if not isinstance(message, Mapping):
        raise ChatTemplateError(
            f"message {index} must be a dict with 'role' and 'content', got {type(message).__name__}"
        )
    out = dict(message)
    role = out.get("role")
    if not isinstance(role, str) or not role:
        raise ChatTemplateError(f"message {index} needs a 'role' (a non-empty str), got {role!r}")
    content = out.get("content")
    if content is None or isinstance(content, str):
        return out
    if isinstance(content, Sequence) and not isinstance(content, (bytes, Mapping)):
        parts = []
        for part in content:
            if isinstance(part, str):
                part = {"type": "text", "text": part}
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError(
                    f"message {index}: content parts must be {{'type': 'text', 'text': str}} (this engine takes text only), got {part!r:.80}"
                )
            parts.append({"type": "text", "text": part["text"]})
        out["content"] = parts if content_format == "openai" else "\n".join(p["text"] for p in parts)
        return out
    raise ChatTemplateError(
        f"message {index}: content must be a str or a list of text parts, got {type(content).__name__}"
    )
