"""JSON log lines for the server: structlog's (the engine's and the server's) and uvicorn's, one format, each line
with the request id, the tenant and the adapter (null where there is none, e.g. before authentication)."""

from __future__ import annotations

import logging
import logging.config

import structlog

import loraledger.logging as ll_logging

CONTEXT_KEYS = ("request_id", "tenant", "adapter")


def _ensure_context_keys(_logger, _method, event: dict) -> dict:
    for key in CONTEXT_KEYS:
        event.setdefault(key, None)
    return event


def _drop_color(_logger, _method, event: dict) -> dict:
    event.pop("color_message", None)  # uvicorn's ANSI-coloured copy of the message
    return event


def _processors() -> list:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _ensure_context_keys,
    ]


def configure_json(level: str = "info") -> dict:
    """Make every log line JSON on stdout; returns the logging config uvicorn should use (its own loggers, the access
    log included, through the same processors)."""
    numeric = getattr(logging, level.upper(), logging.INFO)
    structlog.configure(
        processors=[*_processors(), structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        cache_logger_on_first_use=False,
    )
    ll_logging.keep_configuration()  # the engine's loggers keep this configuration
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "json": {
                "()": structlog.stdlib.ProcessorFormatter,
                "processors": [
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.JSONRenderer(),
                ],
                "foreign_pre_chain": [
                    *_processors(),
                    structlog.stdlib.add_logger_name,
                    structlog.stdlib.ExtraAdder(),
                    _drop_color,
                ],
            }
        },
        "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stdout"}},
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": logging.getLevelName(numeric), "propagate": False},
            "uvicorn.error": {"handlers": ["default"], "level": logging.getLevelName(numeric), "propagate": False},
            "uvicorn.access": {"handlers": ["default"], "level": logging.getLevelName(numeric), "propagate": False},
        },
    }
