"""The `direct` transport: a level actor serves the round's requests on a TCP socket of its own, beside Ray.

Why: a round calls every level once per (inner) round, and on GPUs a step takes a few milliseconds. A plain
Ray actor call costs about a millisecond on a loaded host (scheduling, gRPC, the object store's bookkeeping); a
Ray Compiled Graph costs about a quarter of that, but its reader polls its channel, so an idle level actor keeps
a CPU core busy, cores that CPU levels need for their models. A blocking socket costs neither: a request is one
length-prefixed pickle frame each way (`TCP_NODELAY`), and an idle level sleeps in `recv`.

Ray stays in charge of everything else: it places and restarts the actor, and the address and a per-incarnation
token travel in the actor's `info()`. A connection must present the token before any frame is unpickled, so
only a process that can call the actor through Ray can send it requests. A request's exception travels back and
is raised in the client; a closed connection (the actor died) or a timeout is a `ConnectionError` the client
maps to `LevelUnavailable`.
"""

from __future__ import annotations

import hmac
import logging
import pickle
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["FrameClient", "FrameServer", "TransportError"]

log = logging.getLogger(__name__)

_LEN = "!Q"  # frame header: payload length
_LEN_SIZE = struct.calcsize(_LEN)


class TransportError(ConnectionError):
    """The connection failed (closed by the peer, refused, timed out): the request's fate is unknown."""


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack(_LEN, len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("connection closed")
        got += k
    return bytes(buf)


def _recv(sock: socket.socket) -> bytes:
    (n,) = struct.unpack(_LEN, _recv_exact(sock, _LEN_SIZE))
    return _recv_exact(sock, n)


def _dumps_exception(exc: BaseException) -> bytes:
    try:
        return pickle.dumps((False, exc), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # an exception that does not pickle still reaches the client, as text
        return pickle.dumps((False, RuntimeError(f"{type(exc).__name__}: {exc}")), protocol=pickle.HIGHEST_PROTOCOL)


class FrameServer:
    """Serves `handler(request) -> result` on a listening socket, one thread per connection.

    `on_thread_start` runs first in every connection thread (the level sets its torch thread count there).
    """

    def __init__(self, host: str, handler: Callable[[Any], Any],
                 on_thread_start: Callable[[], None] | None = None) -> None:
        self.handler = handler
        self.on_thread_start = on_thread_start
        self.token = secrets.token_hex(16)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(16)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        threading.Thread(target=self._accept, name="specray-direct-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="specray-direct", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                if not hmac.compare_digest(_recv(conn), self.token.encode()):
                    log.warning("direct transport: a connection presented a wrong token; closed")
                    return
                if self.on_thread_start is not None:
                    self.on_thread_start()
                while True:
                    request = pickle.loads(_recv(conn))
                    try:
                        reply = pickle.dumps((True, self.handler(request)), protocol=pickle.HIGHEST_PROTOCOL)
                    except Exception as exc:  # the request failed: the client raises it
                        reply = _dumps_exception(exc)
                    _send(conn, reply)
            except (ConnectionError, OSError):
                return  # the client went away

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


class FrameClient:
    """One connection to a `FrameServer`; one request in flight at a time (calls from several threads queue)."""

    def __init__(self, address: tuple[str, int], token: str, timeout_s: float | None = None) -> None:
        try:
            self._sock = socket.create_connection(tuple(address), timeout=timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.settimeout(timeout_s)
            _send(self._sock, token.encode())
        except OSError as exc:
            raise TransportError(f"cannot connect to {address[0]}:{address[1]}: {exc}") from exc
        self._lock = threading.Lock()

    def call(self, request: Any) -> Any:
        """Send `request`, return the handler's result or raise its exception. A `TransportError` leaves the
        connection unusable: close it."""
        payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            try:
                _send(self._sock, payload)
                reply = _recv(self._sock)
            except OSError as exc:  # closed, reset, timed out
                raise TransportError(f"{type(exc).__name__}: {exc}") from exc
        ok, value = pickle.loads(reply)
        if not ok:
            raise value
        return value

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
