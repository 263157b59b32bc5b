"""structlog set-up: JSON-ish key=value lines, each bound to its actor and, for request work, the request id and adapter."""

from __future__ import annotations

import logging
import os

import structlog

_configured = False


def keep_configuration() -> None:
    """Another structlog configuration is in place (the server's JSON logs): configure() leaves it as it is."""
    global _configured
    _configured = True


def configure(level: str | None = None) -> None:
    """Configure structlog once per process (idempotent); LORALEDGER_LOG_LEVEL overrides the level."""
    global _configured
    if _configured:
        return
    _configured = True
    name = (level or os.environ.get("LORALEDGER_LOG_LEVEL") or "WARNING").upper()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.KeyValueRenderer(
                key_order=["timestamp", "level", "event", "actor", "request_id", "adapter"]
            ),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, name, logging.WARNING)),
        cache_logger_on_first_use=True,
    )


def get_logger(actor: str) -> structlog.typing.FilteringBoundLogger:
    configure()
    return structlog.get_logger().bind(actor=actor)


def request_logger(log: structlog.typing.FilteringBoundLogger, request_id: str, adapter: str | None):
    """Every line about a request names the request and the adapter (None = base model)."""
    return log.bind(request_id=request_id, adapter=adapter or "base")
