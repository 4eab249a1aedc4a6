"""The `direct` transport: a level actor serves the round's requests on a TCP socket of its own, beside Ray.

Why: a round calls every level once per (inner) round, and on GPUs a step takes a few milliseconds. A plain
Ray actor call costs about a millisecond on a loaded host (scheduling, gRPC, the object store's bookkeeping); a
Ray Compiled Graph costs about a quarter of that, but its reader polls its channel, so an idle level actor keeps
a CPU core busy, cores that CPU levels need for their models. A blocking socket costs neither: a request is one
length-prefixed pickle frame each way (`TCP_NODELAY`; the round's messages as plain tuples, `specray.serve.codec`),
and an idle level sleeps in `recv`.

Waiting: a thread blocked in `recv` is parked, and waking it when the frame lands costs tens of microseconds on
bare metal and more on a virtual machine, twice per call (the request wakes the server, the reply the client), on
the round's critical path. Both sides know roughly when their next frame is due (`FrameClock`: the lower and
upper quartiles of the last few waits of the same kind: a client's calls of one shape, a server's gaps between a
reply and the next request), so they park until just before then and poll the socket from there (`POLL_LEAD_S`
before, at most `POLL_MAX_S` past each due time, parked in between). Only waits due within `POLL_UNDER_S` poll:
beside a CPU-speed step a wake-up is nothing, and a polling thread would take time from the models' cores. A
client chooses for its connection (`poll`, off by default): the server polls for that connection's requests
only if it does. Polling pays only where cores are spare: it takes a fifth off one call between two processes,
but on a 2-core box running a cascade's four processes it made rounds slower (benchmarks/README.md section 6).

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
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from specray.serve.codec import decode, encode

__all__ = ["FrameClient", "FrameServer", "FrameClock", "PendingReply", "Reply", "TransportError"]

#: start polling this long before a frame is due
POLL_LEAD_S = 0.0003
#: poll at most this long past the due time, then park until the frame comes
POLL_MAX_S = 0.0005
#: only waits due within this poll (GPU-speed steps); longer ones park as usual
POLL_UNDER_S = 0.05

log = logging.getLogger(__name__)

_LEN = "!Q"  # frame header: payload length, with `_ONE_WAY` set on a frame that gets no reply
_LEN_SIZE = struct.calcsize(_LEN)
_ONE_WAY = 1 << 63


class TransportError(ConnectionError):
    """The connection failed (closed by the peer, refused, timed out): the request's fate is unknown."""


def _send(sock: socket.socket, payload: bytes, one_way: bool = False) -> None:
    sock.sendall(struct.pack(_LEN, len(payload) | (_ONE_WAY if one_way else 0)) + payload)


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
    return _recv_frame(sock)[0]


def _recv_frame(sock: socket.socket) -> tuple[bytes, bool]:
    """A frame's payload, and whether it is one-way (no reply)."""
    (n,) = struct.unpack(_LEN, _recv_exact(sock, _LEN_SIZE))
    return _recv_exact(sock, n & ~_ONE_WAY), bool(n & _ONE_WAY)


def _dumps_exception(exc: BaseException) -> bytes:
    try:
        return pickle.dumps((False, exc), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # an exception that does not pickle still reaches the client, as text
        return pickle.dumps((False, RuntimeError(f"{type(exc).__name__}: {exc}")), protocol=pickle.HIGHEST_PROTOCOL)


class FrameClock:
    """When the next frame of a kind is due: a low and a high quantile (`quantiles`) of the last `window` waits of
    that kind. Waits are often bimodal (a middle level's one or two inner rounds, a target waiting for a round's
    drafts or for the next round at once), so a wait polls near each: from just before the first until a little
    past it, then parked until just before the second (`wait`)."""

    def __init__(self, window: int = 16, quantiles: tuple[float, ...] = (0.25, 0.75)) -> None:
        self.window = window
        self.quantiles = quantiles
        self._recent: dict[Hashable, deque[float]] = {}
        #: waits that polled, and those the frame came to while polling
        self.polled = self.caught = 0

    def due(self, kind: Hashable) -> list[float]:
        """Seconds from the wait's start to its frame, one per quantile (windows that would overlap merged), or
        none before two waits of this kind."""
        recent = self._recent.get(kind)
        if recent is None or len(recent) < 2:
            return []
        ordered = sorted(recent)
        out: list[float] = []
        for q in self.quantiles:
            t = ordered[int(q * (len(ordered) - 1))]
            if not out or t - out[-1] > POLL_LEAD_S + POLL_MAX_S:
                out.append(t)
        return out

    def record(self, kind: Hashable, seconds: float) -> None:
        recent = self._recent.get(kind)
        if recent is None:
            recent = self._recent[kind] = deque(maxlen=self.window)
        recent.append(seconds)

    def wait(self, sock: socket.socket, kind: Hashable, since: float) -> None:
        """Before a blocking read of `sock`: for each time a frame of `kind` is due after `since` (a
        `perf_counter` time) within `POLL_UNDER_S`, park until just before it and poll from there."""
        socks = [sock]
        polled = False
        for due in self.due(kind):
            if due >= POLL_UNDER_S:
                break
            wait = since + due - POLL_LEAD_S - time.perf_counter()
            if wait > 0 and select.select(socks, [], [], wait)[0]:
                return  # came before this window: it woke us as usual
            if not polled:
                self.polled += 1
                polled = True
            stop = since + due + POLL_MAX_S
            while time.perf_counter() < stop:
                if select.select(socks, [], [], 0)[0]:
                    self.caught += 1
                    return


class Reply:
    """The reply to one request (`FrameServer` with `replies=True`). The handler either returns its result, which
    the server sends as usual, or calls `defer()` and returns: some thread sends the reply later (`send` / `fail`)
    on the same connection, while the connection's thread reads the next frames (one-way ones: the client waits
    for this reply before its next request). This lets two requests meet: a level's verification that waits for
    drafts another level sends it (specray.serve.relay)."""

    def __init__(self, conn: socket.socket, lock: threading.Lock) -> None:
        self._conn = conn
        self._lock = lock
        self.deferred = False

    def defer(self) -> Reply:
        self.deferred = True
        return self

    def send(self, value: Any) -> None:
        self._write(pickle.dumps((True, encode(value)), protocol=pickle.HIGHEST_PROTOCOL))

    def fail(self, exc: BaseException) -> None:
        self._write(_dumps_exception(exc))

    def _write(self, payload: bytes) -> None:
        try:
            with self._lock:
                _send(self._conn, payload)
        except OSError as exc:  # the client went away: nobody is waiting for it
            log.debug("direct transport: a deferred reply found its connection closed: %s", exc)


class FrameServer:
    """Serves `handler(request) -> result` on a listening socket, one thread per connection.

    `on_thread_start` runs first in every connection thread (the level sets its torch thread count there).
    `poll`: poll for a request that is due soon (module docstring), on connections whose client asks for it.
    `replies`: call `handler(request, reply)` with the request's `Reply` (None for a one-way frame, whose result
    is dropped), so that it can defer it; else `handler(request)`, and a one-way frame's exception is logged.
    """

    def __init__(self, host: str, handler: Callable[..., Any],
                 on_thread_start: Callable[[], None] | None = None, poll: bool = True, replies: bool = False) -> None:
        self.handler = handler
        self.poll = poll
        self.replies = replies
        self._clocks: set[FrameClock] = set()  # one per open connection (when its requests come)
        self._done = [0, 0]  # polled / caught of the closed connections
        self._stats_lock = threading.Lock()
        self._served = 0
        self._busy_s = 0.0  # in the handler
        self._idle_s = 0.0  # between a reply and the next request on the same connection
        self._idles: deque[float] = deque(maxlen=256)
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
        clock: FrameClock | None = None
        with conn:
            try:
                if not hmac.compare_digest(_recv(conn), self.token.encode()):
                    log.warning("direct transport: a connection presented a wrong token; closed")
                    return
                options = pickle.loads(_recv(conn))  # after the token: only a trusted peer's frames are unpickled
                wants_poll = bool(options.get("poll", False))
                if self.on_thread_start is not None:
                    self.on_thread_start()
                clock, replied = FrameClock(), None
                self._clocks.add(clock)
                send_lock = threading.Lock()  # a deferred reply is sent from another thread
                while True:
                    if replied is not None and wants_poll and self.poll:
                        clock.wait(conn, "request", replied)
                    frame, one_way = _recv_frame(conn)
                    got = time.perf_counter()
                    request = decode(pickle.loads(frame))
                    if one_way:
                        self._one_way(request)
                        continue
                    if replied is not None and wants_poll:  # the clock is only kept for polling
                        clock.record("request", got - replied)
                    later = Reply(conn, send_lock) if self.replies else None
                    try:
                        value = self.handler(request, later) if later is not None else self.handler(request)
                        reply = None if later is not None and later.deferred else pickle.dumps(
                            (True, encode(value)), protocol=pickle.HIGHEST_PROTOCOL)
                    except Exception as exc:  # the request failed: the client raises it
                        if later is not None and later.deferred:  # whoever completes it replies
                            log.exception("direct transport: a handler failed after deferring its reply")
                            reply = None
                        else:
                            reply = _dumps_exception(exc)
                    with self._stats_lock:  # before the reply: a caller that has it sees the request counted
                        self._served += 1
                        self._busy_s += time.perf_counter() - got
                        if replied is not None:
                            self._idle_s += got - replied
                            self._idles.append(got - replied)
                    if reply is None:  # deferred: sent by whoever completes it
                        replied = None
                        continue
                    with send_lock:
                        _send(conn, reply)
                    replied = time.perf_counter()
            except (ConnectionError, OSError):
                return  # the client went away
            finally:
                if clock is not None:
                    self._clocks.discard(clock)
                    self._done[0] += clock.polled
                    self._done[1] += clock.caught

    def _one_way(self, request: Any) -> None:
        try:
            if self.replies:
                self.handler(request, None)
            else:
                self.handler(request)
        except Exception:  # nobody waits for its result: log it
            log.exception("direct transport: a one-way request failed")

    def stats(self) -> dict[str, float]:
        """Requests served, seconds spent serving them and seconds idle between a reply and the next request on
        the same connection (the round's time outside this level: the caller's work and the other levels'),
        with the median of the last 256 idle gaps in ms."""
        with self._stats_lock:
            idles = sorted(self._idles)
            return {"requests": float(self._served), "busy_s": self._busy_s, "idle_s": self._idle_s,
                    "idle_ms_p50": 1000 * idles[len(idles) // 2] if idles else 0.0}

    def polls(self) -> tuple[int, int]:
        """Requests waited for by polling, and those that came while polling, over every connection so far."""
        clocks = list(self._clocks)
        return (self._done[0] + sum(c.polled for c in clocks), self._done[1] + sum(c.caught for c in clocks))

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


class FrameClient:
    """One connection to a `FrameServer`; one request in flight at a time (calls from several threads queue).

    `poll`: poll for replies that are due soon (module docstring), for calls that name their `shape`."""

    def __init__(self, address: tuple[str, int], token: str, timeout_s: float | None = None,
                 poll: bool = False) -> None:
        try:
            self._sock = socket.create_connection(tuple(address), timeout=timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.settimeout(timeout_s)
            _send(self._sock, token.encode())
            _send(self._sock, pickle.dumps({"poll": poll}, protocol=pickle.HIGHEST_PROTOCOL))  # the options
        except OSError as exc:
            raise TransportError(f"cannot connect to {address[0]}:{address[1]}: {exc}") from exc
        self._lock = threading.Lock()
        self.poll = poll
        self.clock = FrameClock()

    def call(self, request: Any, shape: Hashable | None = None) -> Any:
        """Send `request`, return the handler's result or raise its exception. `shape`: what the call's duration
        depends on (calls of one shape take about as long), for polling near its reply. A `TransportError` leaves
        the connection unusable: close it."""
        return self.begin(request, shape).result()

    def begin(self, request: Any, shape: Hashable | None = None) -> PendingReply:
        """Send `request` and return at once; its reply is read by `PendingReply.result`, which must be called:
        the connection is the request's until then (other calls wait). `shape`: as for `call`."""
        payload = pickle.dumps(encode(request), protocol=pickle.HIGHEST_PROTOCOL)
        self._lock.acquire()
        try:
            _send(self._sock, payload)
        except OSError as exc:
            self._lock.release()
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc
        except BaseException:
            self._lock.release()
            raise
        return PendingReply(self, shape if self.poll else None)

    def post(self, request: Any) -> None:
        """Send a one-way request: the server runs it and replies nothing."""
        payload = pickle.dumps(encode(request), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            try:
                _send(self._sock, payload, one_way=True)
            except OSError as exc:
                raise TransportError(f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


class PendingReply:
    """A request in flight on a `FrameClient` (`begin`): `post` sends one-way requests on the same connection
    meanwhile (for example, to tell the server to give up on it), `result` reads the reply and frees the
    connection. Call `result` exactly once."""

    def __init__(self, client: FrameClient, shape: Hashable | None) -> None:
        self._client = client
        self._shape = shape  # polled for near its due time (only kept when the client polls)
        self._sent = time.perf_counter()
        self._open = True

    def post(self, request: Any) -> None:
        payload = pickle.dumps(encode(request), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            _send(self._client._sock, payload, one_way=True)
        except OSError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc

    def result(self) -> Any:
        if not self._open:
            raise RuntimeError("the reply was read already")
        self._open = False
        client, shape = self._client, self._shape
        try:
            if shape is not None:
                client.clock.wait(client._sock, shape, self._sent)
            reply = _recv(client._sock)
            if shape is not None:
                client.clock.record(shape, time.perf_counter() - self._sent)
        except OSError as exc:  # closed, reset, timed out
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            client._lock.release()
        return _unwrap(reply)


def _unwrap(reply: bytes) -> Any:
    ok, value = pickle.loads(reply)
    if not ok:
        raise value
    return decode(value)

