"""A tokenizer folder read the way transformers (5) reads it into TokenizersBackend, by the `tokenizers` library alone.

read_folder() says whether AutoTokenizer would make a plain TokenizersBackend of a folder (its tokenizer.json as the
backend, the tokenizer_config.json around it) and, when it would, builds the same Rust tokenizer and the same
Python-side state: special tokens, added tokens, chat templates, decode's clean-up. Anything outside the cases
reasoned out below (a model type AutoTokenizer gives a class of its own, legacy files, a config key not listed, a
tokenizer.json with truncation or padding) returns the reason instead, and the caller loads AutoTokenizer.
tests/test_json_tokenizer.py checks each case against AutoTokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# the names tokenizer_config.json declares for the generic class (PreTrainedTokenizerFast is its alias in transformers 5)
GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# model types for which AutoTokenizer keeps a declared generic class: transformers maps each to no class, to the
# generic one, or to a class of its own that it uses only for types it lists as declaring a wrong class on the Hub
# (qwen2 is listed: its folders get Qwen2Tokenizer). Mistral's types are left out (tekken files, the pre-tokenizer
# regex patch of transformers' TokenizersBackend). tests/test_json_tokenizer.py checks the list against transformers.
PLAIN_MODEL_TYPES = frozenset({"llama", "qwen3", "gemma2", "gemma3", "phi3"})
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys whose effect on TokenizersBackend is known (most are only kept in its init_kwargs)
_KNOWN_KEYS = frozenset(
    {
        *NAMED_TOKENS,
        "tokenizer_class", "backend", "added_tokens_decoder", "additional_special_tokens", "extra_special_tokens",
        "chat_template", "clean_up_tokenization_spaces", "model_max_length", "padding_side", "truncation_side",
        "model_input_names", "add_bos_token", "add_eos_token", "add_prefix_space", "errors", "legacy",
        "is_local", "local_files_only", "use_default_system_prompt", "spaces_between_special_tokens",
        "processor_class", "name_or_path", "split_special_tokens", "do_lower_case", "vocab_size",
    }
)  # fmt: skip


@dataclass
class FolderTokenizer:
    """What TokenizersBackend holds after loading the folder: the Rust tokenizer and the Python-side state."""

    backend: object  # tokenizers.Tokenizer
    name_or_path: str
    special: dict[str, object]  # NAMED_TOKENS -> str | AddedToken | None
    extra_special: list = field(default_factory=list)  # str | AddedToken
    chat_template: str | dict | None = None
    clean_up_tokenization_spaces: bool = False
    truncation_side: str = "right"
    model_max_length: int = int(1e30)


def read_folder(path: str) -> FolderTokenizer | str:
    """The folder's tokenizer as TokenizersBackend would hold it, or why AutoTokenizer must read it instead."""
    folder = Path(path)
    config = _json(folder / "tokenizer_config.json")
    if not (folder / "tokenizer.json").is_file() or not isinstance(config, dict):
        return "no tokenizer.json with a tokenizer_config.json object beside it"
    reason = _class_reason(folder, config)
    if reason is not None:
        return reason
    if "added_tokens_decoder" not in config and any(
        (folder / name).exists() for name in ("special_tokens_map.json", "added_tokens.json")
    ):
        return "legacy special_tokens_map.json / added_tokens.json"
    return _build(folder, path, config)


def _class_reason(folder: Path, config: dict) -> str | None:
    """None when AutoTokenizer resolves the folder to TokenizersBackend itself, loaded from its tokenizer.json."""
    if config.get("tokenizer_class") not in GENERIC_CLASSES:
        return f"tokenizer_class {config.get('tokenizer_class')!r} is not the generic class"
    unknown = sorted(set(config) - _KNOWN_KEYS)
    if unknown:
        return f"tokenizer_config.json keys not reasoned about: {unknown}"
    if config.get("split_special_tokens", False) is not False or config.get("init_inputs"):
        return "split_special_tokens / init_inputs"
    if isinstance(config.get("extra_special_tokens"), dict):
        return "model-specific special tokens"
    if config.get("padding_side", "right") not in ("right", "left"):
        return "padding_side"
    if config.get("truncation_side", "right") not in ("right", "left"):
        return "truncation_side"
    model = folder / "config.json"
    if model.exists():
        values = _json(model)
        if not isinstance(values, dict) or values.get("model_type") not in PLAIN_MODEL_TYPES or "model_name" in values:
            return "config.json's model_type is not one AutoTokenizer keeps the generic class for"
    return None


def _build(folder: Path, path: str, config: dict) -> FolderTokenizer | str:
    try:
        return _build_backend(folder, path, config)
    except Exception as exc:  # what transformers would refuse too: AutoTokenizer says it in its own words
        return f"{type(exc).__name__}: {exc}"


def _build_backend(folder: Path, path: str, config: dict) -> FolderTokenizer | str:
    from tokenizers import AddedToken, Tokenizer, processors

    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    if backend.truncation is not None or backend.padding is not None:
        return "tokenizer.json sets truncation or padding"
    added: dict[int, AddedToken] = {}  # the init kwargs' added_tokens_decoder, as _from_pretrained builds it
    if "added_tokens_decoder" in config:
        for idx, token in config["added_tokens_decoder"].items():
            if not isinstance(token, dict):
                return "added_tokens_decoder entry is not a dict"
            added[int(idx)] = AddedToken(**token)
    else:  # tokenizer.json's own added_tokens, as the backend just read them
        added.update(backend.get_added_tokens_decoder())
    by_text = {str(token): token for token in added.values()}
    special: dict[str, object] = {}
    for name in NAMED_TOKENS:
        value = _added_token(config.get(name))
        if value is not None and not isinstance(value, (str, AddedToken)):
            return f"{name} is neither a str nor an AddedToken"
        special[name] = by_text.get(str(value), value) if by_text and value is not None else value
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if not isinstance(extra, (list, tuple)):
        return "extra special tokens are not a list"
    extra = [_added_token(t) for t in extra]
    if not all(isinstance(t, (str, AddedToken)) for t in extra):
        return "extra special tokens are neither str nor AddedToken"
    _add_special_tokens(backend, added, special, extra)
    backend.encode_special_tokens = False
    # (TokenizersBackend's Mistral regex check leaves the backend as it is: a local folder whose config.json, if any,
    # names a model type of PLAIN_MODEL_TYPES)
    if backend.post_processor is None:  # TokenizersBackend.update_post_processor with no BOS/EOS added
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    return FolderTokenizer(
        backend=backend,
        name_or_path=path,
        special=special,
        extra_special=extra,
        chat_template=_chat_template(folder, config.get("chat_template")),
        clean_up_tokenization_spaces=config.get("clean_up_tokenization_spaces", False),
        truncation_side=config.get("truncation_side", "right"),
        model_max_length=config.get("model_max_length", int(1e30)),
    )


def _add_special_tokens(backend, added: dict, special: dict, extra: list) -> None:
    """TokenizersBackend.__init__'s tokens_to_add: every entry of added_tokens_decoder (in id order) and each special
    token the backend does not hold yet, added through backend.add_tokens (a token already held with the same flags is
    left as it is; other flags replace the held ones)."""
    from tokenizers import AddedToken

    to_add = [token for _, token in sorted(added.items())]
    held = [t.content for _, t in sorted(backend.get_added_tokens_decoder().items())] + [str(t) for t in to_add]
    for value in [v for v in special.values() if v is not None] + extra:
        if str(value) not in held and value not in to_add:
            to_add.append(value)
    if not to_add:
        return
    named = [str(v) for v in special.values() if v]
    tokens = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in named:
            token.special = True
        tokens.append(token)
    backend.add_tokens(tokens)


def _added_token(value):
    """convert_added_tokens: a serialized AddedToken ({"__type": "AddedToken", ...}) to the object."""
    from tokenizers import AddedToken

    if isinstance(value, dict) and value.get("__type") == "AddedToken":
        return AddedToken(**{k: v for k, v in value.items() if k != "__type"})
    if isinstance(value, (list, tuple)):
        return [_added_token(v) for v in value]
    return value


def _chat_template(folder: Path, configured) -> str | dict | None:
    """chat_template.jinja and additional_chat_templates/*.jinja take priority over the config's entry."""
    templates: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in extra_dir.glob("*.jinja"):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if len(templates) == 1 and "default" in templates:
        return templates["default"]
    if templates:
        return templates
    if isinstance(configured, (list, tuple)):
        return {t["name"]: t["template"] for t in configured}
    return configured


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
