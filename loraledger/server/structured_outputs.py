"""A request body's constraint as StructuredOutputsParams: OpenAI's response_format, vLLM's structured_outputs and its
legacy guided_* fields; one source per request, each bad shape a 400 that names the field."""

from __future__ import annotations

from typing import Any

from loraledger.errors import StructuredOutputError
from loraledger.server.error_responses import APIError
from loraledger.structured_outputs import StructuredOutputsParams

# vLLM's legacy extra fields -> StructuredOutputsParams' field
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs_for(req) -> StructuredOutputsParams | None:
    """The request's constraint, or None. StructuredOutputError (a 400) names a bad value; APIError a bad shape."""
    sources = []
    response_format = getattr(req, "response_format", None)
    if response_format is not None and response_format.get("type") not in (None, "text"):
        sources.append(("response_format", _from_response_format(response_format)))
    if req.structured_outputs is not None:
        sources.append(("structured_outputs", _from_fields(req.structured_outputs, "structured_outputs")))
    guided = {field: getattr(req, name) for name, field in GUIDED.items() if getattr(req, name) is not None}
    if guided or req.guided_whitespace_pattern is not None:
        if req.guided_whitespace_pattern is not None:
            guided["whitespace_pattern"] = req.guided_whitespace_pattern
        sources.append(("guided_*", _from_fields(guided, "guided_*")))
    if len(sources) > 1:
        names = ", ".join(name for name, _ in sources)
        raise APIError(
            400, f"the request constrains its output in more than one way ({names}); use one", param=sources[1][0]
        )
    return sources[0][1] if sources else None


def _from_response_format(fmt: dict[str, Any]) -> StructuredOutputsParams:
    kind = fmt.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                400,
                "response_format json_schema needs json_schema.schema, a JSON schema object",
                param="response_format",
            )
        return StructuredOutputsParams(json=schema)
    raise APIError(
        400,
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format",
    )


def _from_fields(fields: dict[str, Any], where: str) -> StructuredOutputsParams:
    known = set(StructuredOutputsParams.__struct_fields__)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise APIError(400, f"{where} has unknown fields {unknown}; known: {sorted(known)}", param=where)
    try:
        return StructuredOutputsParams(**fields)
    except StructuredOutputError:
        raise
    except TypeError as exc:
        raise StructuredOutputError(f"{where}: {exc}") from None
