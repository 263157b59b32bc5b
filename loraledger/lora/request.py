"""LoRARequest: names an adapter for one request, as in vLLM."""

from __future__ import annotations

import msgspec

from loraledger.errors import LoRARequestError
from loraledger.text import storable_text

MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True, array_like=True):
    """An adapter by name, positive integer id and path; vLLM's fields in vLLM's positional order
    (`LoRARequest(lora_name, lora_int_id, lora_path, base_model_name=None, tensorizer_config_dict=None,
    load_inplace=False)`). lora_path is a local folder or a Hugging Face Hub repo id, `org/name` or
    `org/name@revision` to pin a branch, tag or commit (loraledger/sources; a folder that exists wins).

    Equality and hashing are by lora_name alone, as vLLM defines them (its LoRARequest.__eq__ / __hash__), so a
    set or dict of LoRARequests holds one per adapter name. The engine refuses an id or a name reused with a
    different path (LoRARequestConflictError), unless the request reloads it in place.

    base_model_name: accepted and kept, as vLLM does (it names the model the adapter was trained on; the binding
    records the base model's own fingerprint). tensorizer_config_dict: vLLM's tensorizer loading, not supported
    (LoRARequestError). load_inplace: read the adapter's folder again even though an adapter with this id is
    loaded, and serve requests admitted from then on with the new content (vLLM's in-place reload, used by RL loops
    that re-train an adapter under one name): the new content has its own fingerprint, its own `adapters` row
    and its own prefix-cache blocks; requests already admitted finish on the content they were bound to.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    tensorizer_config_dict: dict | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        # the fields are recorded in the audit log as given: they must be text it can store exactly
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRARequestError("LoRARequest.lora_name must be a non-empty string")
        storable_text(
            self.lora_name, "LoRARequest.lora_name", LoRARequestError, max_chars=MAX_NAME_CHARS, allow_nul=False
        )
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or not 1 <= self.lora_int_id < 1 << 63
        ):
            raise LoRARequestError(
                f"LoRARequest.lora_int_id must be an integer in [1, 2**63), got {_shown(self.lora_int_id)}"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise LoRARequestError(
                "LoRARequest.lora_path must name the adapter folder or Hub repo id (a non-empty string)"
            )
        storable_text(
            self.lora_path, "LoRARequest.lora_path", LoRARequestError, max_chars=MAX_PATH_CHARS, allow_nul=False
        )
        if self.base_model_name is not None:
            storable_text(
                self.base_model_name, "LoRARequest.base_model_name", LoRARequestError, max_chars=MAX_PATH_CHARS
            )
        if self.tensorizer_config_dict is not None:
            raise LoRARequestError(
                "LoRARequest.tensorizer_config_dict: tensorizer loading is not supported; save the adapter with PEFT "
                "(adapter_config.json + adapter_model.safetensors) and give its folder as lora_path"
            )
        if not isinstance(self.load_inplace, bool):
            raise LoRARequestError(f"LoRARequest.load_inplace must be True or False, got {_shown(self.load_inplace)}")

    def __eq__(self, other: object) -> bool:
        # vLLM: LoRARequests are the same adapter when their names are equal (across engines, whatever the id)
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def _shown(value: object) -> str:
    text = (
        repr(value) if not isinstance(value, int) or value.bit_length() < 256 else f"<int of {value.bit_length()} bits>"
    )
    return text if len(text) <= 200 else text[:200] + "..."
