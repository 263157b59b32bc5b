"""AdapterRegistry: the adapters an engine knows, by lora_int_id and lora_name, and the rules that keep them apart."""

from __future__ import annotations

from loraledger.errors import LoRARequestConflictError
from loraledger.lora.request import LoRARequest

# resumed requests' adapters not registered here take ids down from here: far from the ids callers count up from 1
RESUMED_IDS_BELOW = 1 << 63


class AdapterRegistry:
    """lora_int_id -> the LoRARequest first registered under it, and lora_name -> that id.

    An id or a name names one folder: registering either again with a different path is refused
    (LoRARequestConflictError), except an in-place reload (load_inplace) under the same name, which
    may read the adapter from a new folder.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, LoRARequest] = {}
        self._ids_by_name: dict[str, int] = {}

    def __contains__(self, int_id: object) -> bool:
        return int_id in self._by_id

    def get(self, int_id: int) -> LoRARequest | None:
        return self._by_id.get(int_id)

    def ids(self) -> list[int]:
        return sorted(self._by_id)

    def register(self, lora: LoRARequest) -> None:
        """Know `lora` (a no-op when it is known already), or raise LoRARequestConflictError naming the clash."""
        known = self._by_id.get(lora.lora_int_id)
        # the registry keeps the adapter, not a request's one-off ask to read it again (pinning resolves what it holds)
        kept = (
            LoRARequest(lora.lora_name, lora.lora_int_id, lora.lora_path, lora.base_model_name)
            if lora.load_inplace
            else lora
        )
        if known is not None and lora.load_inplace and known.lora_name == lora.lora_name:
            self._by_id[lora.lora_int_id] = kept  # an in-place reload may read the adapter from a new folder
            return
        if known is not None and known.lora_path != lora.lora_path:
            raise LoRARequestConflictError(
                f"lora_int_id {lora.lora_int_id} is already registered for path {known.lora_path!r} "
                f"(as {known.lora_name!r}); got path {lora.lora_path!r}. Use a new id for a different adapter, "
                "remove_lora() the old one first, or reload it under the same name with load_inplace=True"
            )
        other = self._ids_by_name.get(lora.lora_name)
        if other is not None and self._by_id[other].lora_path != lora.lora_path:
            raise LoRARequestConflictError(
                f"lora_name {lora.lora_name!r} is already registered for path {self._by_id[other].lora_path!r}; "
                f"got path {lora.lora_path!r}. Use a new name for a different adapter"
            )
        if known is None:
            self._by_id[lora.lora_int_id] = kept
            self._ids_by_name.setdefault(lora.lora_name, lora.lora_int_id)

    def for_resume(self, lora: LoRARequest) -> LoRARequest:
        """A resumed request's adapter as this engine registers it. Its binding's lora_int_id is a handle the engine
        that admitted it gave (a peer sharing the audit database, or this engine's previous run): here that id may
        name another adapter, or be the one a caller (the server numbers its adapters from 1) gives another later.
        So: the adapter registered here under the same name and path, else the highest id free here."""
        same = self._ids_by_name.get(lora.lora_name)
        if same is not None and self._by_id[same].lora_path == lora.lora_path:
            return LoRARequest(lora.lora_name, same, lora.lora_path)
        return LoRARequest(lora.lora_name, self.free_resumed_id(), lora.lora_path)

    def free_resumed_id(self) -> int:
        """The highest id free here below RESUMED_IDS_BELOW (a resumed request's adapter registered on its own)."""
        free = RESUMED_IDS_BELOW - 1
        while free in self._by_id:
            free -= 1
        return free

    def ids_of(self, name: str, path: str) -> list[int]:
        """Every id registered for this name and path (a resumed request's adapter at another commit has its own)."""
        return [i for i, lora in self._by_id.items() if lora.lora_name == name and lora.lora_path == path]

    def remove(self, int_id: int) -> LoRARequest | None:
        """Forget the adapter registered under `int_id`; the LoRARequest it was, or None if there was none."""
        lora = self._by_id.pop(int_id, None)
        if lora is not None and self._ids_by_name.get(lora.lora_name) == int_id:
            del self._ids_by_name[lora.lora_name]
        return lora

    def forget(self, lora: LoRARequest) -> bool:
        """Forget `lora` if its id is registered to it (an adapter whose load failed, so a corrected folder can be
        registered again); False when the id names another adapter by now."""
        if self._by_id.get(lora.lora_int_id) != lora:
            return False
        self.remove(lora.lora_int_id)
        return True
