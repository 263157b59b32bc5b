"""LoRARequest: names an adapter for one request, as in vLLM."""

from __future__ import annotations

import msgspec

from loraledger.errors import LoRARequestError
from loraledger.text import storable_text

MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096  # Linux's PATH_MAX


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True, array_like=True):
    """An adapter by name, positive integer id and local folder path.

    Two requests are the same adapter when they carry the same id; the engine refuses an id
    or a name reused with a different path (LoRARequestConflictError).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        # the fields are recorded in the audit log as given: they must be text it can store exactly
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRARequestError("LoRARequest.lora_name must be a non-empty string")
        storable_text(self.lora_name, "LoRARequest.lora_name", LoRARequestError, max_chars=MAX_NAME_CHARS, allow_nul=False)
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or not 1 <= self.lora_int_id < 1 << 63:
            raise LoRARequestError(f"LoRARequest.lora_int_id must be an integer in [1, 2**63), got {_shown(self.lora_int_id)}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise LoRARequestError("LoRARequest.lora_path must name the adapter folder (a non-empty string)")
        storable_text(self.lora_path, "LoRARequest.lora_path", LoRARequestError, max_chars=MAX_PATH_CHARS, allow_nul=False)

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
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 256 else f"<int of {value.bit_length()} bits>"
    return text if len(text) <= 200 else text[:200] + "..."
