"""BatchState: the requests the policy holds, its waiting queue and running batch, and the sequences to free."""

from __future__ import annotations

import bisect
from collections import deque

from loraledger.scheduling.block_manager import BlockManager
from loraledger.scheduling.request_state import SchedRequest, Seq, SeqStatus


class BatchState:
    def __init__(self, blocks: BlockManager) -> None:
        self._blocks = blocks
        self.requests: dict[str, SchedRequest] = {}  # audit id -> request, until its last sequence ends
        self.seqs: dict[int, Seq] = {}  # the unfinished sequences
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # sorted by Seq.key: oldest first, so the youngest is last
        self._freed: list[int] = []  # ended sequences the executor knows: the next plan tells it to free them

    def enter(self, req: SchedRequest) -> None:
        """Queue a request's sequences (all of them at once: a request is in whole or not at all)."""
        for seq in req.seqs:
            self.seqs[seq.seq_id] = seq
            self.waiting.append(seq)
        self.requests[req.audit_id] = req

    def start_running(self, seq: Seq) -> None:
        seq.status = SeqStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.key)

    def leave_waiting(self, admitted: list[Seq]) -> None:
        """Take the admitted sequences out of the waiting queue, the others keeping their order."""
        n = len(admitted)
        if n <= len(self.waiting) and all(self.waiting[i] is seq for i, seq in enumerate(admitted)):
            for _ in range(n):  # the common case: the head of the queue, in order
                self.waiting.popleft()
            return
        gone = {id(seq) for seq in admitted}
        rest = [seq for seq in self.waiting if id(seq) not in gone]
        self.waiting.clear()
        self.waiting.extend(rest)

    def preempt(self, seq: Seq) -> None:
        """Back to the head of the queue with its blocks freed: recomputed later (its output is unchanged)."""
        self.running.remove(seq)
        self._blocks.free(seq.seq_id)
        seq.num_computed = seq.num_scheduled = seq.pending = 0  # no step is in flight when one preempts
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Seq) -> None:
        """A sequence that left the queues ends: its blocks are freed, and its request once it was the last."""
        seq.status = SeqStatus.FINISHED
        self._blocks.free(seq.seq_id)
        self.seqs.pop(seq.seq_id, None)
        if seq.announced:
            self._freed.append(seq.seq_id)
        req = seq.request
        if all(s.status is SeqStatus.FINISHED for s in req.seqs):
            self.requests.pop(req.audit_id, None)

    def end(self, seq: Seq) -> None:
        """End a sequence wherever it is (waiting or running)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.finish(seq)

    def take_freed(self) -> list[int]:
        freed, self._freed = self._freed, []
        return freed

    def queue_state(self) -> dict:
        """The queue state the engine's stats report (a request is running while any of its sequences is)."""
        running = {s.request for s in self.running}
        waiting = [r for r in self.requests.values() if r not in running]

        def names(reqs) -> list[str]:
            return sorted({r.lora_request.lora_name for r in reqs if r.lora_request is not None})

        return {
            "num_requests_running": len(running),
            "num_requests_waiting": len(waiting),
            "running_lora_adapters": names(running),
            "waiting_lora_adapters": names(waiting),
        }
