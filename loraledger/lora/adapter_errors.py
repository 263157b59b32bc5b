"""AdapterErrors: builds the typed errors of one adapter's load, each naming the adapter and its folder."""

from __future__ import annotations


class AdapterErrors:
    """Every error a load raises carries the adapter's name and path, so a caller sees which adapter failed."""

    def __init__(self, lora_name: str | None, lora_path: str):
        self.lora_name, self.lora_path = lora_name, lora_path

    def __call__(self, cls: type[Exception], message: str) -> Exception:
        return cls(message, lora_name=self.lora_name, lora_path=self.lora_path)
