"""LoRARequest: names an adapter for one request, as in vLLM."""

from __future__ import annotations

import msgspec

from loraledger.errors import LoRARequestError


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True, array_like=True):
    """An adapter by name, positive integer id and local folder path.

    Two requests are the same adapter when they carry the same id; the engine refuses an id
    or a name reused with a different path (LoRARequestConflictError).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRARequestError("LoRARequest.lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRARequestError(f"LoRARequest.lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise LoRARequestError("LoRARequest.lora_path must name the adapter folder")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
