"""The direct transport's socket layer (`specray.serve.direct`): frames, errors, and polling near a due frame."""

from __future__ import annotations

import threading
import time

import pytest

from specray.serve import direct
from specray.serve.direct import FrameClient, FrameClock, FrameServer, TransportError


def _server(handler, poll: bool = True) -> FrameServer:
    return FrameServer("127.0.0.1", handler, poll=poll)


def test_clock_gives_the_quartiles_of_recent_waits_per_kind():
    clock = FrameClock(window=4)
    assert clock.due("a") == []
    clock.record("a", 0.010)
    assert clock.due("a") == []  # one wait says little
    for s in (0.012, 0.011, 0.030):
        clock.record("a", s)
    # sorted 10 11 12 30 ms: indices int(0.25 * 3) and int(0.75 * 3)
    assert clock.due("a") == pytest.approx([0.010, 0.012])
    clock.record("a", 0.020)  # the window drops 0.010
    assert clock.due("a") == pytest.approx([0.011, 0.020])
    for _ in range(4):
        clock.record("a", 0.0101)
    assert clock.due("a") == pytest.approx([0.0101])  # windows closer than lead + max poll merge
    assert clock.due("b") == []


def test_replies_errors_and_polling_for_short_calls():
    def handler(request):
        kind, sleep_s = request
        time.sleep(sleep_s)
        if kind == "fail":
            raise ValueError("bad request")
        return kind, sleep_s

    server = _server(handler)
    client = FrameClient(server.address, server.token, poll=True)
    try:
        # due within POLL_UNDER_S: once the clock has seen a few replies, calls poll near their reply (the first
        # calls on a loaded box may be slow, and a reply faster than the clock's low quantile parks as usual)
        for _ in range(40):
            assert client.call(("ok", 0.004), shape=("ok", 1)) == ("ok", 0.004)
            if client.clock.polled >= 3:
                break
        assert client.clock.polled >= 3
        with pytest.raises(ValueError, match="bad request"):
            client.call(("fail", 0.0), shape=("fail", 1))
        polled = client.clock.polled
        long_s = direct.POLL_UNDER_S + 0.01
        for _ in range(3):
            assert client.call(("ok", long_s), shape=("long", 1)) == ("ok", long_s)
        assert client.clock.polled == polled  # a CPU-speed call parks as before
        for _ in range(3):
            assert client.call(("ok", 0.001)) == ("ok", 0.001)  # no shape: never polls
        assert client.clock.polled == polled
    finally:
        client.close()
        server.close()


def test_no_polling_when_turned_off_and_a_wrong_token_is_refused():
    server = _server(lambda r: r, poll=False)
    client = FrameClient(server.address, server.token, poll=False)
    try:
        for i in range(5):
            assert client.call(i, shape="x") == i
        assert client.clock.polled == 0
    finally:
        client.close()
    bad = FrameClient(server.address, "0" * 32)
    with pytest.raises(TransportError):
        bad.call(1)
    bad.close()
    server.close()


def test_a_client_that_does_not_poll_is_not_polled_for():
    server = _server(lambda r: r)  # the server would poll
    client = FrameClient(server.address, server.token)  # polling is off by default
    try:
        for i in range(8):
            time.sleep(0.005)
            assert client.call(i, shape="x") == i
        assert server.polls()[0] == 0 and client.clock.polled == 0
    finally:
        client.close()
        server.close()


def test_a_server_polls_for_requests_that_come_at_a_steady_pace():
    seen = []
    server = _server(seen.append)
    client = FrameClient(server.address, server.token, poll=True)  # the client asks for it
    try:
        for i in range(8):
            time.sleep(0.005)
            client.call(i)
        assert seen == list(range(8))
        assert server.polls()[0] > 0
        st = server.stats()
        assert st["requests"] == 8
        assert 0.0 < st["busy_s"] < st["idle_s"]  # idle ~5 ms before each of the last 7, a trivial handler
        assert st["idle_ms_p50"] >= 4.0
    finally:
        client.close()
        server.close()


def test_a_deferred_reply_is_sent_by_another_connection_and_one_way_frames_get_none():
    """Two clients meet in the server (`replies=True`): the first one's request waits for the second one's
    one-way frame, whose handler thread sends the first one's reply on the first connection. The two frames
    travel on different connections, so either may reach its server thread first: the handler meets them in
    either order, as the target's rendezvous does."""
    lock = threading.Lock()
    parked: dict[str, object] = {}  # key -> a deferred reply whose one-way frame has not come yet
    early: dict[str, tuple[str, object]] = {}  # key -> a one-way frame that came before its request

    def complete(deferred, kind, value):
        if kind == "give":
            deferred.send(("got", value))
        else:
            deferred.fail(KeyError(value))

    def handler(request, reply):
        kind, key, value = request
        if kind in ("wait", "fail-later"):
            deferred = reply.defer()
            with lock:
                came = early.pop(key, None)
                if came is None:
                    parked[key] = deferred
                    return None
            complete(deferred, *came)
            return None
        if kind in ("give", "fail"):  # one-way: reply is None
            assert reply is None
            with lock:
                deferred = parked.pop(key, None)
                if deferred is None:
                    early[key] = (kind, value)
                    return "ignored"
            complete(deferred, kind, value)
            return "ignored"
        return ("echo", value)

    server = FrameServer("127.0.0.1", handler, poll=False, replies=True)
    a = FrameClient(server.address, server.token)
    b = FrameClient(server.address, server.token)
    try:
        pending = a.begin(("wait", "k1", None))
        b.post(("give", "k1", 7))
        assert pending.result() == ("got", 7)
        assert a.call(("echo", None, 3)) == ("echo", 3)  # the connection is free again
        b.post(("give", "k3", 8))  # the one-way frame sent first
        assert a.begin(("wait", "k3", None)).result() == ("got", 8)
        pending = a.begin(("fail-later", "k2", None))
        pending.post(("fail", "k2", "gone"))  # a one-way frame on the waiting connection itself
        with pytest.raises(KeyError, match="gone"):
            pending.result()
        with pytest.raises(RuntimeError, match="read already"):
            pending.result()
        assert a.call(("echo", None, 4)) == ("echo", 4)
    finally:
        a.close()
        b.close()
        server.close()


def test_a_one_way_frame_that_fails_is_logged_and_the_connection_goes_on(caplog):
    def handler(request):
        if request == "boom":
            raise RuntimeError("boom")
        return request

    server = _server(handler, poll=False)
    client = FrameClient(server.address, server.token)
    try:
        client.post("boom")
        assert client.call("after") == "after"
        assert any("one-way request failed" in r.message for r in caplog.records)
    finally:
        client.close()
        server.close()
