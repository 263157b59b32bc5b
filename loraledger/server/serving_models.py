"""The models a server serves: the base model under its served names and every adapter by name; who may use which
(403 and an access_denied event otherwise), /v1/models, and vLLM's load / unload routes (admin keys only).

An unload returns only once no request can be admitted on the adapter any more. A request checks that its adapter
is still served just before it goes to the engine, and holds it (AdapterHold) until the engine has admitted it (its
first output) or refused it; an unload first stops serving the name, then waits for the holds, then removes the
adapter from the engine. Without the wait, a request that had resolved the name just before the unload reached the
engine just after and was admitted there, the engine reading the adapter again from its path.
"""

from __future__ import annotations

import collections
import contextlib
import time

import anyio
import structlog

from loraledger.errors import LoRARequestError
from loraledger.lora.request import LoRARequest
from loraledger.server.auth import Caller
from loraledger.server.errors import APIError, unavailable

OWNED_BY = "loraledger"
FORGET_SECONDS = 5.0  # undoing a failed load's registration (the loader's own bookkeeping: no store involved)
UNKNOWN_LABEL = "unknown"  # the metrics label of every model name this server does not serve
UNLOAD_WAIT_SECONDS = 30.0  # an unload waits this long for the requests already on their way to the engine


class AdapterHold:
    """A request's claim on its adapter from its last check that the adapter is served until the engine admitted or
    refused it: the adapter is not removed meanwhile. release() is idempotent."""

    def __init__(self, models: OpenAIServingModels | None, int_id: int) -> None:
        self._models, self._int_id = models, int_id

    def release(self) -> None:
        if self._models is not None:
            models, self._models = self._models, None
            models.end_hold(self._int_id)


class OpenAIServingModels:
    def __init__(self, state) -> None:
        self._state = state
        self.base_names: tuple[str, ...] = state.config.served_model_name
        self.model_path = str(state.config.engine_args.model)
        self.adapters: dict[str, LoRARequest] = {}
        self._created: dict[str, int] = {}
        self._next_id = 1
        self._lock = anyio.Lock()  # loads and unloads one at a time: names and ids stay consistent
        self._holds: collections.Counter[int] = collections.Counter()  # lora_int_id -> requests on their way in
        self._hold_ended = anyio.Event()  # set when a hold ends (and replaced by whoever waits)
        self._unloading: dict[str, LoRARequest] = {}  # no longer served, still waiting for its holds to end
        self._log = structlog.get_logger().bind(actor="server")

    @property
    def base_name(self) -> str:
        return self.base_names[0]

    async def resolve(self, model: str, caller: Caller, route: str) -> LoRARequest | None:
        """The LoRARequest a request's `model` names (None: the base model). A name the caller's key may not use is
        refused (403) and on record as access_denied, whether or not the model exists, so a key learns nothing
        about models it may not use; an unknown name it may use is a 404."""
        if not caller.may_use(model):
            await self.deny(model, caller, route)
        if model in self.base_names:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")
        return lora

    def hold(self, lora: LoRARequest | None) -> AdapterHold:
        """Check that `lora` is still served (404 when it was unloaded since the request resolved it) and hold it until
        release(): call with no await between this and handing the request to the engine."""
        if lora is None:
            return AdapterHold(None, 0)
        if self.adapters.get(lora.lora_name) is not lora:
            raise APIError(404, f"The model `{lora.lora_name}` was unloaded.", code="model_not_found", param="model")
        self._holds[lora.lora_int_id] += 1
        return AdapterHold(self, lora.lora_int_id)

    def end_hold(self, int_id: int) -> None:
        self._holds[int_id] -= 1
        if self._holds[int_id] <= 0:
            del self._holds[int_id]
        self._hold_ended.set()

    async def _wait_holds(self, int_id: int) -> bool:
        """Wait (at most UNLOAD_WAIT_SECONDS) until no request holds adapter int_id; False if some still do."""
        with anyio.move_on_after(UNLOAD_WAIT_SECONDS):
            while self._holds[int_id]:
                self._hold_ended = anyio.Event()
                await self._hold_ended.wait()
        return not self._holds[int_id]

    def label(self, model: str) -> str:
        """A model name as a metrics label: a served name, or "unknown" (a caller's made-up names never become series)."""
        return model if model in self.base_names or model in self.adapters else UNKNOWN_LABEL

    async def deny(self, model: str, caller: Caller, route: str):
        state = self._state
        state.metrics.access_denied.labels(adapter=self.label(model)).inc()
        self._log.warning("access denied", adapter=model, route=route)
        ctx = structlog.contextvars.get_contextvars()
        on_record = await state.engine.record_access_denied(
            tenant=caller.tenant,
            key_id=caller.key_id,
            adapter=model,
            route=route,
            caller_request_id=ctx.get("caller_request_id"),
        )
        if not on_record and state.engine.args.audit_url is not None:
            self._log.error(
                "access_denied event not yet on record (the audit store did not answer); the writer retries it",
                adapter=model,
            )
        who = f"key {caller.key_id}" if caller.key_id else "this caller"
        raise APIError(
            403,
            f"{who} may not use model `{model}`",
            type="permission_error",
            code="model_not_permitted",
            param="model",
        )

    def cards(self, caller: Caller) -> list[dict]:
        """vLLM's model cards: the base model (root: its path) and each adapter (root: its path, parent: the base)."""
        max_len = self._state.engine.max_model_len
        out = []
        for name in self.base_names:
            if caller.may_use(name):
                out.append(_card(name, self._state.started, self.model_path, None, max_len))
        for name, lora in self.adapters.items():
            if caller.may_use(name):
                out.append(_card(name, self._created[name], lora.lora_path, self.base_name, max_len))
        return out

    def card(self, name: str, caller: Caller) -> dict:
        """The card of one served name the caller may use; 404 otherwise, so a key learns nothing of other names."""
        for card in self.cards(caller):
            if card["id"] == name:
                return card
        raise APIError(404, f"The model `{name}` does not exist.", code="model_not_found", param="model")

    async def load(self, name: str, path: str, load_inplace: bool = False) -> LoRARequest:
        """Register, load and fingerprint an adapter; it is on record (the `adapters` table) before any request can
        name it, since it joins the served names only after the engine's add_lora has returned. load_inplace (vLLM's):
        an adapter of that name already loaded is read again, from `path`, under its id; requests admitted from then
        on run on the new content."""
        async with self._lock:
            known = self.adapters.get(name)
            if known is not None and load_inplace:
                try:
                    reload = LoRARequest(name, known.lora_int_id, path, load_inplace=True)
                except LoRARequestError as exc:
                    raise APIError(400, str(exc), param="lora_path") from None
                await self._state.engine.add_lora(reload)  # typed errors: the handlers map them
                # kept without the flag: a request naming it uses what was loaded, it does not read the folder again
                self.adapters[name] = LoRARequest(name, known.lora_int_id, path)
                self._log.info("adapter reloaded in place", adapter=name, path=path, lora_int_id=known.lora_int_id)
                return self.adapters[name]
            if name in self._unloading:
                raise unavailable(
                    f"The lora adapter '{name}' is being unloaded; retry the load shortly", "adapter_unloading"
                )
            if name in self.base_names or name in self.adapters:
                raise APIError(
                    400, f"The lora adapter '{name}' has already been loaded.", code="adapter_exists", param="lora_name"
                )
            try:
                lora = LoRARequest(name, self._next_id, path)
            except LoRARequestError as exc:
                raise APIError(400, str(exc), param="lora_name") from None
            self._next_id += 1  # never handed out twice, whatever add_lora leaves behind
            try:
                await self._state.engine.add_lora(lora)  # typed errors: the handlers map them
            except BaseException:
                # a load that failed half-way (its record timed out, say) must not leave its id or name registered
                with anyio.move_on_after(FORGET_SECONDS, shield=True):
                    with contextlib.suppress(Exception):
                        await self._state.engine.remove_lora(lora.lora_int_id)
                raise
            self.adapters[name] = lora
            self._created[name] = int(time.time())
            self._log.info("adapter loaded", adapter=name, path=path, lora_int_id=lora.lora_int_id)
            return lora

    async def unload(self, name: str, lora_int_id: int | None = None) -> None:
        async with self._lock:
            lora = self.adapters.get(name) or self._unloading.get(name)
            if lora is None or (lora_int_id is not None and lora.lora_int_id != lora_int_id):
                raise APIError(
                    404, f"The lora adapter '{name}' cannot be found.", code="adapter_not_found", param="lora_name"
                )
            # no new request can name it; requests already on their way to the engine are admitted first
            self.adapters.pop(name, None)
            self._created.pop(name, None)
            self._unloading[name] = lora
            if not await self._wait_holds(lora.lora_int_id):
                raise unavailable(
                    f"The lora adapter '{name}' is no longer served, but {self._holds[lora.lora_int_id]} request(s) "
                    f"naming it were still being admitted after {UNLOAD_WAIT_SECONDS:g} s; retry the unload",
                    "adapter_unloading",
                )
            await self._state.engine.remove_lora(lora.lora_int_id)
            del self._unloading[name]
            self._log.info("adapter unloaded", adapter=name)


def _card(name: str, created: int, root: str, parent: str | None, max_model_len: int) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": OWNED_BY,
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [],
    }
