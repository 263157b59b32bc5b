"""A TCP relay on loopback for database fault tests: it forwards, cuts, or freezes the traffic to a server.

- `cut()`: every connection is dropped and new ones are refused, until `restore()` (a server that went away).
- `freeze()`: connections stay open and new ones are accepted, but no byte moves either way, until `thaw()`
  (a server that hangs, or a network partition: the client sees no error, only silence).
"""

from __future__ import annotations

import socket
import threading

_CHUNK = 65536


class TcpProxy:
    """Relays 127.0.0.1:port (a free port) to host:port, one pair of threads per connection."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._up = True
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = False
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="tcp-proxy-accept", daemon=True).start()

    # -- faults ----------------------------------------------------------------------------

    def cut(self) -> None:
        self._up = False
        self._drop(*self._live())

    def restore(self) -> None:
        self._up = True

    def freeze(self) -> None:
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self._flowing.set()
        self.cut()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- relaying --------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._up:
                self._drop(client)
                continue
            threading.Thread(target=self._connect, args=(client,), name="tcp-proxy-connect", daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        with self._lock:
            self._open.add(client)
        # frozen: the connection is accepted (as the kernel does for a hung server) and then nothing happens
        self._flowing.wait()
        if self._closed or not self._up:
            self._drop(client)
            return
        try:
            upstream = socket.create_connection(self._target, timeout=5)
        except OSError:
            self._drop(client)
            return
        upstream.settimeout(None)
        with self._lock:
            self._open.add(upstream)
        threading.Thread(target=self._pump, args=(client, upstream), name="tcp-proxy-pump", daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, client), name="tcp-proxy-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(_CHUNK):
                self._flowing.wait()  # frozen: the bytes read are held back (and sent on after thaw)
                dst.sendall(data)
        except OSError:
            pass
        self._drop(src, dst)

    def _live(self) -> list[socket.socket]:
        with self._lock:
            return list(self._open)

    def _drop(self, *socks: socket.socket) -> None:
        for sock in socks:
            with self._lock:
                self._open.discard(sock)
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a pump blocked in recv on it
            except OSError:
                pass
            sock.close()
