"""Checks of the text a caller hands the engine: it must be a str the audit log can store and hash."""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=Exception)


def storable_text(
    value: object, what: str, error: type[E], *, max_chars: int | None = None, allow_nul: bool = True
) -> str:
    """`value` as a plain str, or `error` naming `what` and the problem.

    Refused: anything not a str; lone surrogates ("\\ud800": not Unicode text, so not UTF-8, so the
    audit log cannot store or hash it); more than `max_chars` characters; NUL where `allow_nul` is
    False (a key the database must store exactly: PostgreSQL text cannot hold NUL).
    """
    if not isinstance(value, str):
        raise error(f"{what} must be a str, got {type(value).__name__}")
    text = str.__str__(value)  # a plain str, whatever a subclass overrides
    if max_chars is not None and len(text) > max_chars:
        raise error(f"{what} has {len(text)} characters, more than the {max_chars} allowed")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(
            f"{what} holds a lone surrogate (U+{ord(text[exc.start]):04X} at index {exc.start}), which is not valid Unicode "
            "text; decode the bytes it came from with errors='replace' or fix the text"
        ) from None
    if not allow_nul and "\x00" in text:
        raise error(f"{what} holds a NUL character (at index {text.index(chr(0))}), which cannot be stored; remove it")
    return text
