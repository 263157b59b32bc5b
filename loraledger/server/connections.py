"""Connection guards under uvicorn's HTTP/1.1 protocol: a deadline for a request's headers (a connection that sends
nothing, or its headers a byte at a time, is closed) and a cap on one client address's open connections; and a
client that half-closes (shuts down its write side once its request is sent) still gets its answer.

A half-close and a full close look the same when they arrive (an end of file); uvicorn takes both as a disconnect,
so a half-closed client's finished output went to a closed socket and a streamed request was never admitted. After
a whole request the connection stays open for writing, and is closed once the answer is sent; a client that had
really gone is found at the first write (a stream is then aborted and on record as such, as for any client that
leaves). An end of file before the request is whole is a disconnect, as before.

Before its headers are complete a request is not yet the app's, so these live in the protocol (uvicorn takes its
class as `http=`); the body's deadline and the slow clients' budget are the app's (ServerMiddleware).
"""

from __future__ import annotations

import collections

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

KEEP_ALIVE_SECONDS = 5  # an idle connection between two requests is closed after this (uvicorn's own timer)


def guarded_protocol(header_seconds: float, per_client: int) -> type[H11Protocol]:
    """An H11Protocol class (one per server: its per-client counts are the server's) with both guards."""
    open_per_client: collections.Counter[str] = collections.Counter()

    class GuardedH11Protocol(H11Protocol):
        _host: str | None = None
        _header_timer = None
        _seen_cycle = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            host = self.client[0] if self.client else None
            if host is not None and open_per_client[host] >= per_client:
                transport.abort()  # over this client's share: refused before it may send anything
                return
            if host is not None:
                open_per_client[host] += 1
                self._host = host
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_seconds, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.cycle is None or self.cycle.response_complete:  # no request of its own in progress
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self._seen_cycle:  # a request's headers are complete
                self._seen_cycle = self.cycle
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's headers get the same deadline (keep-alive closes an idle one sooner)

        def eof_received(self) -> bool | None:
            cycle = self.cycle
            if (
                cycle is not None
                and not cycle.response_complete
                and self.conn.their_state in (h11.DONE, h11.MUST_CLOSE)
            ):
                cycle.keep_alive = False  # answer, then close
                return True  # keep the transport open for writing
            return None  # the transport closes: a disconnect

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._host is not None:
                open_per_client[self._host] -= 1
                if open_per_client[self._host] <= 0:
                    del open_per_client[self._host]
                self._host = None
            super().connection_lost(exc)

    return GuardedH11Protocol


def uvicorn_options(limits) -> dict:
    """uvicorn.Config keywords that apply a ServerLimits' connection guards."""
    return {
        "http": guarded_protocol(limits.header_seconds, limits.max_connections_per_client),
        "timeout_keep_alive": KEEP_ALIVE_SECONDS,
    }
