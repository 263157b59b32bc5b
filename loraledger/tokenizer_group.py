"""TokenizerGroup: the base model's tokenizer (or none), and the tokenizers adapters ship beside their weights.

An adapter folder may hold tokenizer files (a trainer saves the tokenizer it trained with next to
the PEFT adapter: tokenizer.json, tokenizer_config.json, ...) or only a chat template
(chat_template.jinja / chat_template.json). As in vLLM (get_lora_tokenizer), such an adapter's
requests are tokenized, detokenized and chat-rendered with the adapter's tokenizer; an adapter with
only a chat template uses the base tokenizer with that template. Unlike vLLM, tokenizer files that
cannot be loaded refuse the request (AdapterFormatError) instead of falling back to the base
tokenizer with a warning: the adapter asked for its own. Loaded tokenizers are kept in an LRU.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from pathlib import Path

from loraledger.errors import AdapterFormatError, ModelLoadError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def load_tokenizer(path: str, *, mode: str = "auto"):
    """The tokenizer of a local folder; never runs code shipped with it. Raises ModelLoadError.

    A folder AutoTokenizer would read into its generic TokenizersBackend (a tokenizer.json, its tokenizer_config.json
    declaring the generic class, a model type that keeps it: loraledger/tokenizer_folder.py) is read by the `tokenizers`
    library alone into a JsonTokenizer, the same tokenizer without importing transformers (18-21 MiB of modules, ~9 MiB
    of AutoTokenizer's tables); any other folder, and tokenizer_mode="slow", get AutoTokenizer."""
    if mode != "slow":
        from loraledger.tokenizer_folder import read_folder

        state = read_folder(path)
        if not isinstance(state, str):
            from loraledger.json_tokenizer import JsonTokenizer

            return JsonTokenizer(state)
    return load_transformers_tokenizer(path, mode=mode)


def load_transformers_tokenizer(path: str, *, mode: str = "auto"):
    """AutoTokenizer for a local folder; never runs code shipped with it. Raises ModelLoadError.

    AutoTokenizer reads the folder's config.json only for what picks the tokenizer class (model_type,
    tokenizer_class, the name): given a bare PretrainedConfig of that file (`_folder_config`), it skips
    AutoConfig, whose import of the model's configuration class pulls in most of transformers (activations,
    hub kernels, accelerate, torch.distributed, sympy): about 70 MiB resident that serving never uses."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            path,
            use_fast=mode != "slow",
            trust_remote_code=False,
            local_files_only=True,
            **_folder_config(Path(path)),
        )
    except Exception as exc:  # OSError / ValueError / a tokenizer class that needs remote code
        raise ModelLoadError(
            f"cannot load the tokenizer from {path!r}: {exc}; the folder needs tokenizer files (tokenizer.json or the like), "
            "or pass skip_tokenizer_init=True to serve token-id prompts only"
        ) from exc


def _folder_config(folder: Path) -> dict:
    """{"config": a PretrainedConfig of folder/config.json carrying its model_type} for AutoTokenizer, or {} (no
    such file, or not a JSON object with a model_type: AutoTokenizer reads the folder as it would)."""
    from transformers import PretrainedConfig

    try:
        values = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        return {}
    # model_type is a class attribute in transformers: a subclass per call carries this folder's
    config_class = type("FolderConfig", (PretrainedConfig,), {"model_type": values["model_type"]})
    try:
        config = config_class.from_dict(values)
    except Exception:  # a value PretrainedConfig refuses: leave the folder to AutoConfig, which says what is wrong
        return {}
    config._name_or_path = str(folder)
    return {"config": config}


class TokenizerGroup:
    def __init__(self, base, *, vocab_size: int, mode: str = "auto", capacity: int = 8) -> None:
        """base: the model's tokenizer, or None (skip_tokenizer_init: no adapter tokenizer is loaded either)."""
        self.base = base
        self._vocab_size = vocab_size
        self._mode = mode
        self._capacity = max(1, capacity)
        self._cache: OrderedDict[tuple[int, str], object] = OrderedDict()
        self._lock = threading.Lock()

    def cached(self, lora) -> bool:
        """Whether get(lora) returns at once (no files to read)."""
        if lora is None or self.base is None:
            return True
        with self._lock:
            return _key(lora) in self._cache

    def get(self, lora=None):
        """The tokenizer for a request on `lora` (a LoRARequest or None): the adapter's own, or the base one.

        May read the adapter folder (the first time): call it off the event loop unless cached(lora).
        Raises AdapterFormatError when the adapter's tokenizer files cannot be used."""
        if lora is None or self.base is None:
            return self.base
        key = _key(lora)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        tokenizer = self._load(lora)
        with self._lock:
            self._cache[key] = tokenizer
            self._cache.move_to_end(key)
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return tokenizer

    def _load(self, lora):
        folder = Path(lora.lora_path)
        if not folder.is_dir():
            return self.base  # the adapter loader reports a missing folder with its own error
        if any((folder / name).is_file() for name in TOKENIZER_FILES):
            try:
                tokenizer = load_tokenizer(str(folder), mode=self._mode)
            except ModelLoadError as exc:
                raise AdapterFormatError(
                    f"the adapter folder holds tokenizer files that cannot be loaded ({exc.__cause__ or exc}); fix or remove them",
                    lora_name=lora.lora_name,
                    lora_path=lora.lora_path,
                ) from exc
            if len(tokenizer) > self._vocab_size:
                raise AdapterFormatError(
                    f"the adapter's tokenizer has {len(tokenizer)} tokens, more than the base model's vocabulary of "
                    f"{self._vocab_size} (adapters that extend the vocabulary are not supported)",
                    lora_name=lora.lora_name,
                    lora_path=lora.lora_path,
                )
            return tokenizer
        template = _chat_template_file(folder)
        if template is None:
            return self.base
        tokenizer = copy.copy(self.base)  # the base tokenizer (its backend shared) with the adapter's chat template
        tokenizer.chat_template = template
        return tokenizer


def _key(lora) -> tuple[int, str]:
    return (lora.lora_int_id, str(lora.lora_path))


def _chat_template_file(folder: Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    as_json = folder / "chat_template.json"
    if as_json.is_file():
        try:
            value = json.loads(as_json.read_text(encoding="utf-8")).get("chat_template")
        except (ValueError, AttributeError) as exc:
            raise AdapterFormatError(
                f"{as_json} is not a JSON object with a 'chat_template': {exc}", lora_path=str(folder)
            ) from exc
        return value if isinstance(value, str) else None
    return None
