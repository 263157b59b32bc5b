"""Fair seats: the running batch is shared between requests, so a request with a large n cannot hold back later ones.

Waiting sequences are taken round-robin by request; a request holds at most an equal share of max_num_seqs
while others want seats; and when every seat is taken, a request above its share gives one up (its youngest
sequence is preempted) to a waiting request that has none.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence

from loraledger.scheduling.request_state import SchedRequest, Seq


def fair_share(max_num_seqs: int, num_requests: int) -> int:
    """Seats a request may hold while others want them: an equal part of max_num_seqs per unfinished request."""
    return max(1, max_num_seqs // max(1, num_requests))


def round_robin(waiting: Iterable[Seq]) -> Iterator[Seq]:
    """The waiting sequences, one per request at a time: round k holds each request's k-th waiting
    sequence, requests in the order they first appear in the queue (oldest, or preempted, first)."""
    later: list[tuple[int, int, Seq]] = []
    seen: Counter = Counter()
    for position, seq in enumerate(list(waiting)):
        k = seen[seq.request]
        seen[seq.request] = k + 1
        if k == 0:
            yield seq
        else:
            later.append((k, position, seq))
    later.sort(key=lambda item: item[:2])
    for _, _, seq in later:
        yield seq


def seat_victims(
    running: list[Seq],
    waiting: Sequence[Seq],
    max_num_seqs: int,
    share: int,
    can_run: Callable[[SchedRequest], bool],
) -> list[Seq]:
    """With every seat taken, the sequences of requests above their fair share to preempt so that waiting
    requests with no seat at all (and that `can_run` now) get one in this step: each time the youngest
    sequence of the request holding the most seats (the youngest request among equals)."""
    if len(running) < max_num_seqs or not waiting:
        return []
    seats = Counter(s.request for s in running)
    excess = sum(count - share for count in seats.values() if count > share)
    if excess <= 0:
        return []  # nobody holds more than a share (the usual case: one sequence per request)
    seatless: list = []
    for seq in waiting:
        req = seq.request
        if seats[req] or req in seatless:
            continue
        if not can_run(req):
            continue  # it could not run now anyway: no seat is taken from anyone for it
        seatless.append(req)
        if len(seatless) >= excess:
            break
    victims: list[Seq] = []
    for _ in seatless:
        richest = max(seats, key=lambda r: (seats[r], r.order))
        if seats[richest] <= share:
            break
        victims.append(max((s for s in running if s.request is richest and s not in victims), key=lambda s: s.index))
        seats[richest] -= 1
    return victims
