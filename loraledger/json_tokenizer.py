"""JsonTokenizer: a tokenizer.json folder served by the `tokenizers` library alone, as transformers' TokenizersBackend.

The engine's calls (encode, with the left truncation admission uses; decode; convert_ids_to_tokens; the special token
ids; len; the vocabulary; the Rust tokenizer the detokenizer streams through) run here, with the code paths
TokenizersBackend runs for them, so a plain request never imports transformers. Rendering a chat template borrows
transformers' own apply_chat_template (imported on the first chat). Everything else a transformers tokenizer offers
(other arguments, other methods, xgrammar's vocabulary reading) is served by the AutoTokenizer of the same folder,
loaded on first use. loraledger/tokenizer_folder.py decides which folders qualify and reads them.
"""

from __future__ import annotations

import threading

from loraledger.tokenizer_folder import NAMED_TOKENS, FolderTokenizer

_CLEAN_UPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
              (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))  # fmt: skip


class JsonTokenizer:
    def __init__(self, state: FolderTokenizer) -> None:
        self._tokenizer = state.backend  # the name TokenizersBackend gives it: the detokenizer reads it
        self.name_or_path = state.name_or_path
        self._special = dict(state.special)
        self._extra_special = list(state.extra_special)
        self._chat_template = state.chat_template
        self.clean_up_tokenization_spaces = state.clean_up_tokenization_spaces
        self.truncation_side = state.truncation_side
        self.model_max_length = state.model_max_length
        self._transformers = None  # the AutoTokenizer of the folder, once something needs it
        self._lock = threading.Lock()

    # --- encoding -----------------------------------------------------------------------------------------------
    def encode(self, text, text_pair=None, add_special_tokens: bool = True, truncation=None, max_length=None, **kwargs):
        """The text's ids (PreTrainedTokenizerBase.encode). Here: a str, no truncation or `truncation=True` with
        max_length; any other form goes to transformers' tokenizer."""
        native = isinstance(text, str) and text_pair is None and not kwargs and isinstance(add_special_tokens, bool)
        if not native or truncation not in (None, False, True) or (truncation is True and not _is_length(max_length)):
            return self.transformers_tokenizer().encode(
                text, text_pair, add_special_tokens=add_special_tokens, truncation=truncation, max_length=max_length,
                **kwargs,
            )  # fmt: skip
        if truncation is None and max_length is not None:  # transformers: max_length alone truncates
            if not _is_length(max_length):
                return self.transformers_tokenizer().encode(
                    text, add_special_tokens=add_special_tokens, max_length=max_length
                )
            truncation = True
        self._set_truncation(max_length if truncation else None)
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens, is_pretokenized=False)[0].ids

    def _set_truncation(self, max_length: int | None) -> None:
        """TokenizersBackend.set_truncation_and_padding: the backend truncates as asked, and only then."""
        current = self._tokenizer.truncation
        if max_length is None:
            if current is not None:
                self._tokenizer.no_truncation()
            return
        target = {"max_length": max_length, "stride": 0, "strategy": "longest_first", "direction": self.truncation_side}
        if current is None or {k: current.get(k) for k in target} != target:
            self._tokenizer.enable_truncation(**target)

    # --- decoding -----------------------------------------------------------------------------------------------
    def decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None, **kwargs):
        if kwargs or not (isinstance(token_ids, int) or _is_id_list(token_ids)):
            return self.transformers_tokenizer().decode(
                token_ids, skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs,
            )  # fmt: skip
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = (
            self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        )
        # transformers skips the clean-up for BPE models (it would strip real spaces before punctuation)
        if clean and type(self._tokenizer.model).__name__ != "BPE":
            for before, after in _CLEAN_UPS:
                text = text.replace(before, after)
        return text

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, token: str):
        index = self._tokenizer.token_to_id(token)
        return self.unk_token_id if index is None else index

    # --- vocabulary and special tokens --------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def vocab(self) -> dict[str, int]:
        return self.get_vocab()

    @property
    def backend_tokenizer(self):
        return self._tokenizer

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: str(value) for name, value in self._special.items() if value is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        seen: list[str] = []
        for value in [v for v in self._special.values() if v is not None] + self._extra_special:
            if str(value) not in seen:
                seen.append(str(value))
        return seen

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    # --- chat templates -----------------------------------------------------------------------------------------
    @property
    def chat_template(self):
        return self._chat_template

    @chat_template.setter
    def chat_template(self, value) -> None:
        self._chat_template = value
        self._transformers = None  # (a copy given an adapter's template loads its own, with that template)

    def get_chat_template(self, chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        from transformers import PreTrainedTokenizerBase

        return PreTrainedTokenizerBase.get_chat_template(self, chat_template, tools)

    def apply_chat_template(self, conversation, *args, tokenize: bool = True, **kwargs):
        """To text: transformers' own apply_chat_template run on this tokenizer (it reads the template and the
        special tokens map). Tokenized, or with options that tokenize: transformers' tokenizer does it all."""
        if tokenize or args or kwargs.get("sanitize_control_tokens") or kwargs.get("return_assistant_tokens_mask"):
            return self.transformers_tokenizer().apply_chat_template(conversation, *args, tokenize=tokenize, **kwargs)
        from transformers import PreTrainedTokenizerBase

        return PreTrainedTokenizerBase.apply_chat_template(self, conversation, tokenize=False, **kwargs)

    # --- the rest: transformers' tokenizer of the same folder ------------------------------------------------------
    def transformers_tokenizer(self):
        """The AutoTokenizer of this folder (loaded once; carries this tokenizer's chat template)."""
        with self._lock:
            if self._transformers is None:
                from loraledger.tokenizer_group import load_transformers_tokenizer

                loaded = load_transformers_tokenizer(self.name_or_path)
                loaded.chat_template = self._chat_template
                loaded.truncation_side = self.truncation_side
                self._transformers = loaded
            return self._transformers

    def __call__(self, *args, **kwargs):
        return self.transformers_tokenizer()(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__") or "_special" not in self.__dict__:  # (copy and pickle probe before the state is set)
            raise AttributeError(name)
        key = name.removesuffix("_id")
        if key in NAMED_TOKENS:  # PreTrainedTokenizerBase.__getattr__: bos_token, bos_token_id, ...
            value = self._special.get(key)
            if value is None:
                return None
            return self._token_id(str(value)) if name != key else str(value)
        if name in ("extra_special_tokens", "extra_special_tokens_ids"):
            tokens = [str(t) for t in self._extra_special]
            return self.convert_tokens_to_ids(tokens) if name.endswith("_ids") else tokens
        return getattr(self.transformers_tokenizer(), name)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_transformers"] = None
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"JsonTokenizer(name_or_path={self.name_or_path!r}, vocab_size={self.vocab_size}, special_tokens={self.special_tokens_map})"


def _is_length(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_id_list(value) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
