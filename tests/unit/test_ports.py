"""`free_port`: the port a test server is started on must not be one the kernel is about to hand to someone else
(a local Ray's own servers take dozens of ephemeral ports between the pick and the bind)."""

from __future__ import annotations

import socket

import specray.serve.localcluster as lc


def test_free_ports_lie_below_the_ephemeral_range_and_above_rays_worker_ports():
    low = lc._ephemeral_low()
    ports = {lc.free_port() for _ in range(20)}
    for port in ports:
        assert lc._WORKER_PORT_RANGE.stop <= port < low - 1
        with socket.socket() as s:  # free: a server can bind it
            s.bind(("127.0.0.1", port))
    assert len(ports) > 1  # at random, so two test servers started at once do not race for one port


def test_a_port_held_by_a_server_is_not_handed_out(monkeypatch):
    port = lc.free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        monkeypatch.setattr(lc.random, "sample", lambda pop, k: [port, *(p for p in pop[:k] if p != port)])
        got = lc.free_port()  # the held port comes up first
        assert got != port and lc._WORKER_PORT_RANGE.stop <= got < lc._ephemeral_low() - 1
