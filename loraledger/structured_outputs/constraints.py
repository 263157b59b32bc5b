"""StructuredOutputsParams (vLLM's fields and rules) and the canonical form that names a constraint."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from loraledger.digests import text_sha256
from loraledger.errors import StructuredOutputError
from loraledger.text import storable_text

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SPEC_CHARS = 256 << 10  # a schema, pattern, grammar or list of choices, as canonical text
MAX_CHOICES = 4096
# JSON kinds: whitespace between tokens comes in runs of at most this many characters (room for pretty-printed JSON's
# newline and indentation); unbounded, a model that favours whitespace never closes the object
MAX_JSON_WHITESPACE = 16


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A constraint on what a request may generate; exactly one kind is set (vLLM's rule).

    json: a JSON schema (dict, or its JSON text); regex: a pattern the whole output matches;
    choice: the output is exactly one of these strings; grammar: an EBNF grammar (GBNF style,
    as xgrammar takes it, `root ::= ...`); json_object: any JSON object. The options shape the JSON
    kinds: disable_any_whitespace (no whitespace between JSON tokens but xgrammar's ", " and ": "; otherwise runs
    of at most MAX_JSON_WHITESPACE whitespace characters), disable_additional_properties
    (objects of the schema that do not say otherwise get `additionalProperties: false`);
    whitespace_pattern is vLLM's field, refused here with the reason (the grammar engine has no such option).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        canonical_constraint(self)  # refuse a bad constraint where it is built, as vLLM does

    @property
    def kind(self) -> str:
        return canonical_constraint(self).kind


class Constraint(msgspec.Struct, frozen=True):
    """A checked constraint: its kind, the canonical JSON text that defines it, and that text's sha256.

    Two requests with the same canonical text get the same compiled grammar and the same digest on record.
    """

    kind: str
    spec: Any  # the kind's value, normalised: schema dict, pattern, list of choices, grammar text, True
    any_whitespace: bool
    canonical: str
    sha256: str


def canonical_constraint(params: StructuredOutputsParams) -> Constraint:
    """The Constraint `params` defines; StructuredOutputError says which rule a bad one breaks."""
    if not isinstance(params, StructuredOutputsParams):
        raise StructuredOutputError(
            f"SamplingParams.structured_outputs must be a StructuredOutputsParams, got {type(params).__name__}"
        )
    given = [k for k in KINDS if _is_set(k, getattr(params, k))]
    if len(given) != 1:
        what = "none is" if not given else f"{', '.join(given)} are"
        raise StructuredOutputError(
            f"StructuredOutputsParams needs exactly one kind of constraint ({', '.join(KINDS)}), but {what} set; "
            "give one (vLLM's rule)"
        )
    kind = given[0]
    for flag in ("disable_any_whitespace", "disable_additional_properties"):
        if not isinstance(getattr(params, flag), bool):
            raise StructuredOutputError(
                f"StructuredOutputsParams.{flag} must be True or False, got {getattr(params, flag)!r}"
            )
    if params.whitespace_pattern is not None:
        raise StructuredOutputError(
            "StructuredOutputsParams.whitespace_pattern is not supported by this engine's grammar engine (xgrammar); "
            "leave it out, or use disable_any_whitespace=True for JSON without whitespace"
        )
    spec = _spec(kind, getattr(params, kind), params.disable_additional_properties)
    body = {"kind": kind, "spec": spec}
    if kind in ("json", "json_object"):
        body["any_whitespace"] = not params.disable_any_whitespace
        if not params.disable_any_whitespace:
            body["max_whitespace"] = MAX_JSON_WHITESPACE  # part of what the digest names: it shapes the grammar
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    try:
        canonical.encode("utf-8")
    except UnicodeEncodeError:
        raise StructuredOutputError(
            f"StructuredOutputsParams.{kind} holds a lone surrogate (not Unicode text, so the audit log cannot store or hash it)"
        ) from None
    if len(canonical) > MAX_SPEC_CHARS:
        raise StructuredOutputError(
            f"StructuredOutputsParams.{kind} is {len(canonical)} characters in canonical form, above the limit of {MAX_SPEC_CHARS}"
        )
    return Constraint(
        kind=kind,
        spec=spec,
        any_whitespace=not params.disable_any_whitespace,
        canonical=canonical,
        sha256=text_sha256(canonical),
    )


def frozen_params(params: StructuredOutputsParams) -> StructuredOutputsParams:
    """A copy holding the normalised values (the engine's, independent of the caller's object)."""
    c = canonical_constraint(params)
    values: dict[str, Any] = {c.kind: json.loads(json.dumps(c.spec))}
    if params.disable_any_whitespace:
        values["disable_any_whitespace"] = True
    if params.disable_additional_properties:
        values["disable_additional_properties"] = True
    return StructuredOutputsParams(**values)


def from_canonical(canonical: str) -> StructuredOutputsParams:
    """The StructuredOutputsParams a Constraint's canonical text stands for (its canonical text is the same)."""
    body = json.loads(canonical)
    values: dict[str, Any] = {body["kind"]: body["spec"]}
    if body["kind"] in ("json", "json_object") and not body.get("any_whitespace", True):
        values["disable_any_whitespace"] = True
    return StructuredOutputsParams(**values)


def _is_set(kind: str, value: object) -> bool:
    if kind == "json_object":
        return value is not None and value is not False  # vLLM's json_object=False means "not this kind"
    return value is not None


def _spec(kind: str, value: object, no_additional: bool) -> Any:
    where = f"StructuredOutputsParams.{kind}"
    if kind == "json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError as exc:
                raise StructuredOutputError(
                    f"{where} is not valid JSON ({exc}); give a JSON schema as a dict or its JSON text"
                ) from None
        if not isinstance(schema, dict):
            raise StructuredOutputError(f"{where} must be a JSON schema object (a dict), got {type(schema).__name__}")
        try:
            schema = json.loads(json.dumps(schema, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise StructuredOutputError(f"{where} must be plain JSON data: {exc}") from None
        return _closed_objects(schema) if no_additional else schema
    if kind == "json_object":
        if value is not True:
            raise StructuredOutputError(f"{where} must be True (or None / False for another kind), got {value!r}")
        return True
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or len(value) > MAX_CHOICES:
            raise StructuredOutputError(f"{where} must be a non-empty list of at most {MAX_CHOICES} strings")
        if not all(isinstance(c, str) and c for c in value):
            raise StructuredOutputError(f"{where} must hold non-empty strings only")
        return [storable_text(c, f"{where}: a choice", StructuredOutputError) for c in value]
    if not isinstance(value, str) or not value:  # regex, grammar
        raise StructuredOutputError(f"{where} must be a non-empty string, got {type(value).__name__}")
    return storable_text(value, where, StructuredOutputError)


def _closed_objects(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema without additionalProperties gets it set to false."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
