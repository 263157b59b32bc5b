"""The models a server serves: the base model under its served names and every adapter by name; who may use which
(403 and an access_denied event otherwise), /v1/models, vLLM's load / unload routes (admin keys only), and the
adapters loaded on first use from the LoRA resolvers (loraledger.server.lora_resolvers).

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
import uuid

import anyio
import structlog

from loraledger.errors import LoRARequestError
from loraledger.lora.request import LoRARequest
from loraledger.server.auth import Caller
from loraledger.server.error_responses import APIError, unavailable
from loraledger.server.lora_resolvers import LoRAResolvers
from loraledger.sources import HubNotFoundError, HubOfflineError

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
        self._lock = anyio.Lock()  # guards names and ids; an adapter's load itself runs outside it
        self._loading: dict[str, anyio.Event] = {}  # names whose first load is under way, set when it has ended
        self._resolving: dict[str, _Pending] = {}  # names a resolver is looking for: one search per name at a time
        self._holds: collections.Counter[int] = collections.Counter()  # lora_int_id -> requests on their way in
        self._hold_ended = anyio.Event()  # set when a hold ends (and replaced by whoever waits)
        self._unloading: dict[str, LoRARequest] = {}  # no longer served, still waiting for its holds to end
        config = state.config
        self.resolvers = LoRAResolvers(config.lora_resolvers, config.lora_resolver_max_loras)
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
        if lora is None and self.resolvers.specs:
            lora = await self._on_demand(model)
        if lora is None:
            raise _not_found(model)
        return lora

    def hold(self, lora: LoRARequest | None) -> AdapterHold:
        """Check that `lora` is still served (404 when it was unloaded since the request resolved it) and hold it until
        release(): call with no await between this and handing the request to the engine."""
        if lora is None:
            return AdapterHold(None, 0)
        served = self.adapters.get(lora.lora_name)
        if served is None or served.lora_int_id != lora.lora_int_id:  # (an in-place reload keeps the id)
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

    async def _on_demand(self, model: str) -> LoRARequest | None:
        """The adapter `model` names, loaded from the first resolver that has it (None: none has it). Requests that
        ask for one name meanwhile wait for the same search and load: it happens once."""
        while True:
            pending = self._resolving.get(model)
            if pending is None:
                break
            await pending.done.wait()
            if pending.error is not None:
                raise pending.error
            if pending.searched:
                return pending.lora
            # the search was cancelled (its asker went away): this asker searches
        known = self.adapters.get(model)
        if known is not None:
            return known
        pending = self._resolving[model] = _Pending()
        try:
            pending.lora = await self._search(model)
            pending.searched = True
        except Exception as exc:
            pending.error = exc
            raise
        finally:
            del self._resolving[model]
            pending.done.set()
        return pending.lora

    async def _search(self, model: str) -> LoRARequest | None:
        # a folder resolver reads the disk: off the event loop
        for index, path in await anyio.to_thread.run_sync(self.resolvers.candidates, model):
            if self.resolvers.full(index):
                raise APIError(
                    503, f"the LoRA resolver {self.resolvers.specs[index]} has loaded its limit of "
                    f"{self.resolvers.max_loras} adapters; unload one (POST /v1/unload_lora_adapter) or start the "
                    "server with a higher --lora-resolver-max-loras", type="service_unavailable", code="resolver_full",
                    param="model",
                )  # fmt: skip
            self.resolvers.took(model, index)  # before the load: loads of other names meanwhile count it
            try:
                lora = await self.load(model, path)
            except BaseException as exc:
                self.resolvers.forget(model)
                known = self.adapters.get(model)
                if known is not None and isinstance(exc, APIError) and exc.code == "adapter_exists":
                    return known  # an admin's load of this name ended first: the request runs on it
                if isinstance(exc, (HubNotFoundError, HubOfflineError)):
                    continue  # not in this organisation (or, offline, not in the cache): the next resolver may have it
                raise
            where = str(self.resolvers.specs[index])
            self._log.info("adapter loaded on first use", adapter=model, path=path, resolver=where)
            return lora
        return None

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
        raise _not_found(name)

    async def load(self, name: str, path: str, load_inplace: bool = False) -> LoRARequest:
        """Register, load and fingerprint an adapter; it is on record (the `adapters` table) before any request can
        name it, since it joins the served names only after the engine's add_lora has returned. load_inplace (vLLM's):
        an adapter of that name already loaded is read again, from `path`, under its id; requests admitted from then
        on run on the new content."""
        while True:
            under_way = self._loading.get(name)
            if under_way is not None:
                await under_way.wait()  # a load of this name is under way: this one is answered as if it came after
                continue
            async with self._lock:
                if name in self._loading:
                    continue  # another load of it began while this one waited for the lock
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
                    raise unavailable(f"The lora adapter '{name}' is being unloaded; retry the load shortly",
                                      "adapter_unloading")  # fmt: skip
                if name in self.base_names or name in self.adapters:
                    raise APIError(
                        400,
                        f"The lora adapter '{name}' has already been loaded.",
                        code="adapter_exists",
                        param="lora_name",
                    )
                try:
                    lora = LoRARequest(name, self._next_id, path)
                except LoRARequestError as exc:
                    raise APIError(400, str(exc), param="lora_name") from None
                self._next_id += 1  # never handed out twice, whatever add_lora leaves behind
                self._loading[name] = done = anyio.Event()
            break
        # the load (a Hub download, maybe) runs without the lock: other loads and unloads go on meanwhile
        try:
            await self._state.engine.add_lora(lora)  # typed errors: the handlers map them
        except BaseException:
            # a load that failed half-way (its record timed out, say) must not leave its id or name registered
            with anyio.move_on_after(FORGET_SECONDS, shield=True):
                with contextlib.suppress(Exception):
                    await self._state.engine.remove_lora(lora.lora_int_id)
            raise
        else:
            self.adapters[name] = lora
            self._created[name] = int(time.time())
        finally:
            del self._loading[name]
            done.set()
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
            self.resolvers.forget(name)  # its resolver may load another
            await self._state.engine.remove_lora(lora.lora_int_id)
            del self._unloading[name]
            self._log.info("adapter unloaded", adapter=name)


class _Pending:
    """One resolver search for a name, that the requests asking for it meanwhile wait for."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.searched = False  # the search ran to its end (lora: what it found, None for nothing)
        self.lora: LoRARequest | None = None
        self.error: Exception | None = None


def _not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")


def _card(name: str, created: int, root: str, parent: str | None, max_model_len: int) -> dict:
    """vLLM's model card. Adapters carry the base model's max_model_len (vLLM leaves it null on theirs): an adapter
    runs within the base model's context, and a client sizing prompts by it reads the same number."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": OWNED_BY,
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [_permission(name, created)],
    }


def _permission(name: str, created: int) -> dict:
    """vLLM's ModelPermission object, the same for every card (who may use a model is the API key's business here:
    a card is only listed to a key that may use it). Its id is derived from the name, so a card reads the same in the
    list and in models.retrieve."""
    return {
        "id": f"modelperm-{uuid.uuid5(uuid.NAMESPACE_URL, name).hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
