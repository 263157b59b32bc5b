"""GrammarMask: one token bitmask per step for the constrained rows of a batch, applied to the logits in one call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar as xgr


class GrammarMask:
    """Fills the bitmask rows of the constrained sequences (xgrammar's batch fill, in its own threads) and masks the
    logits of the whole batch at once: every row not allowed by its grammar gets -inf; unconstrained rows are untouched.

    The bitmask is allocated at the first constrained step and grown when a step has more constrained rows than it
    holds. xgrammar is imported then too: an engine that never sees a constrained request never loads it (tens of
    MiB resident, and its matcher's threads).
    """

    def __init__(self, vocab_size: int, rows: int = 64) -> None:
        self.vocab_size = vocab_size
        self._rows = rows
        self._bitmask: torch.Tensor | None = None
        self._batch: xgr.BatchGrammarMatcher | None = None

    def apply(self, logits: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher | None]) -> None:
        """Mask `logits` [N, V] (fp32, in place) with `matchers[i]`'s allowed next tokens for each row i that has one."""
        rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if not rows:
            return
        import xgrammar as xgr

        n = logits.shape[0]
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads="auto")
        if self._bitmask is None or n > self._bitmask.shape[0]:
            held = self._rows if self._bitmask is None else 2 * self._bitmask.shape[0]
            self._bitmask = xgr.allocate_token_bitmask(max(n, held), self.vocab_size)
        bitmask = self._bitmask[:n]  # row i belongs to logits row i; only the constrained rows are filled and read
        self._batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask, indices=rows)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=self.vocab_size, indices=rows
        )
