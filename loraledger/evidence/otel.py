"""OpenTelemetry: one span per finished request, with the GenAI semantic conventions and the adapter's identity.

The span carries `gen_ai.*` attributes (operation, model, response id, token usage, finish reasons) and
ours: the adapter's name, content fingerprint and revision, the base model's fingerprint, the tenant and
key id, the audit key and the request's place in the log (seq, leaf index), so a trace links to the
audit record and a third party can ask for the receipt's inclusion proof. A caller's W3C
`traceparent` / `tracestate` make the span a child of the caller's trace.

Optional: with the `otel` extra (opentelemetry-sdk) installed, spans go to the global tracer provider
the application configured (or the one given); without it, recording does nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

try:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the otel extra is not installed
    trace = None  # type: ignore[assignment]

PROPAGATED = ("traceparent", "tracestate")


def span_attributes(output: Any, *, operation: str, model: str, caller: Any = None) -> dict[str, Any]:
    """The attributes of a finished RequestOutput's span (None values left out, as OpenTelemetry requires)."""
    body: dict[str, Any] = {}
    if output.receipt is not None:
        try:
            body = json.loads(output.receipt["body"])
        except (KeyError, TypeError, ValueError):
            body = {}
    lora = output.lora_request
    completions = list(output.outputs)
    attrs = {
        "gen_ai.operation.name": operation,
        "gen_ai.system": "loraledger",
        "gen_ai.request.model": model,
        "gen_ai.response.model": model,
        "gen_ai.response.id": output.audit_id,
        "gen_ai.usage.input_tokens": len(output.prompt_token_ids or ()),
        "gen_ai.usage.output_tokens": sum(len(c.token_ids) for c in completions),
        "gen_ai.response.finish_reasons": [c.finish_reason or "unknown" for c in completions],
        "loraledger.adapter.name": lora.lora_name if lora is not None else None,
        "loraledger.adapter.fingerprint": body.get("adapter_fingerprint")
        or getattr(output.metrics, "adapter_fingerprint", None),
        "loraledger.adapter.revision": body.get("adapter_revision"),
        "loraledger.base_model.fingerprint": body.get("base_model_fingerprint"),
        "loraledger.tenant": body.get("tenant") or getattr(caller, "tenant", None),
        "loraledger.key_id": body.get("key_id") or getattr(caller, "key_id", None),
        "loraledger.audit_key": output.audit_id,
        "loraledger.caller_request_id": output.request_id,
        "loraledger.log.seq": body.get("seq"),
        "loraledger.log.leaf_index": body.get("leaf_index"),
    }
    return {k: v for k, v in attrs.items() if v is not None}


class RequestTracing:
    """Records finished requests as spans; a no-op where OpenTelemetry is not installed."""

    def __init__(self, tracer_provider: Any = None) -> None:
        self.enabled = trace is not None
        self._tracer = trace.get_tracer("loraledger", tracer_provider=tracer_provider) if self.enabled else None

    def record(
        self,
        output: Any,
        *,
        operation: str,
        model: str,
        start_ns: int,
        headers: Mapping[str, str] | None = None,
        caller: Any = None,
    ) -> None:
        if self._tracer is None:
            return
        parent = TraceContextTextMapPropagator().extract(dict(headers or {}))
        span = self._tracer.start_span(
            f"{operation} {model}", context=parent, kind=trace.SpanKind.SERVER, start_time=start_ns,
            attributes=span_attributes(output, operation=operation, model=model, caller=caller),
        )  # fmt: skip
        span.end()
