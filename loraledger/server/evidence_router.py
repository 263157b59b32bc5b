"""The /evidence routes: readable by any caller the server accepts (behind a key where keys are configured)."""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import PlainTextResponse, Response

from loraledger.errors import EvidenceError
from loraledger.server.auth import Caller, authenticate
from loraledger.server.serving_evidence import bad_request

router = APIRouter(prefix="/evidence")
MAX_INDEX = (1 << 63) - 1


def _evidence(request: Request):
    return request.app.state.server.evidence


def _json(body: object) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")


@router.get("/checkpoint")
async def checkpoint(request: Request, caller: Caller = Depends(authenticate)) -> Response:
    """The log's tree now, as a C2SP signed checkpoint (text/plain)."""
    try:
        return PlainTextResponse(await _evidence(request).checkpoint())
    except EvidenceError as exc:
        raise bad_request(exc) from None


@router.get("/log-key")
async def log_key(request: Request, caller: Caller = Depends(authenticate)) -> Response:
    return PlainTextResponse(await _evidence(request).log_key() + "\n")


@router.get("/proof/inclusion")
async def inclusion(request: Request, leaf: int = Query(ge=0, le=MAX_INDEX), size: int | None = Query(None, ge=1, le=MAX_INDEX),
                    caller: Caller = Depends(authenticate)) -> Response:  # fmt: skip
    try:
        return _json(await _evidence(request).inclusion(leaf, size))
    except EvidenceError as exc:
        raise bad_request(exc) from None


@router.get("/proof/consistency")
async def consistency(request: Request, old: int = Query(ge=1, le=MAX_INDEX), new: int | None = Query(None, ge=1, le=MAX_INDEX),
                      caller: Caller = Depends(authenticate)) -> Response:  # fmt: skip
    try:
        return _json(await _evidence(request).consistency(old, new))
    except EvidenceError as exc:
        raise bad_request(exc) from None


@router.get("/receipt/{audit_key}")
async def receipt(audit_key: str, request: Request, caller: Caller = Depends(authenticate)) -> Response:
    return _json(await _evidence(request).receipt(audit_key[:256], caller))
