"""The problems a verification finds: all counted, the first MAX_PROBLEMS (by sequence number) kept."""

from __future__ import annotations

from typing import Any

from loraledger.audit.results import Problem, VerifyResult


class Problems:
    """The problems found, at most MAX_PROBLEMS kept (the lowest sequence numbers), all counted."""

    def __init__(self) -> None:
        self.count = 0
        self._kept: list[Problem] = []

    def add(
        self,
        sequence: Any,
        message: str,
        request_id: Any = None,
        *,
        table: str | None = None,
        key: dict[str, Any] | None = None,
    ) -> None:
        self.count += 1
        sequence = sequence if is_int(sequence) else None  # a malformed seq is named in the message and key
        request_id = request_id if isinstance(request_id, str) else None
        self._kept.append(Problem(sequence=sequence, message=message, request_id=request_id, table=table, key=key))
        if len(self._kept) > 2 * VerifyResult.MAX_PROBLEMS:
            self._kept = self.sorted()

    def sorted(self) -> list[Problem]:
        key = lambda p: (p.sequence is None, p.sequence or 0)  # noqa: E731
        return sorted(self._kept, key=key)[: VerifyResult.MAX_PROBLEMS]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
