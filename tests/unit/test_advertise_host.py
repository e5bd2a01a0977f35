"""The endpoints a process hands its peers name a host they can reach, never a wildcard."""

from __future__ import annotations

import asyncio
import socket

import pytest
import zmq
import zmq.asyncio

from llmfleet.shared.wire.transport import bind, reachable_host


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", ""])
def test_a_wildcard_bind_is_reached_at_this_machines_address(wildcard):
    assert reachable_host(wildcard) == socket.gethostbyname(socket.gethostname())


def test_an_advertised_host_wins_and_a_named_host_stands():
    assert reachable_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    assert reachable_host("127.0.0.5") == "127.0.0.5"
    assert reachable_host("127.0.0.5", "localhost") == "localhost"


def test_a_peer_reaches_the_advertised_endpoint():
    async def main() -> bytes:
        ctx = zmq.asyncio.Context()
        pull, endpoint = bind(ctx, zmq.PULL, "127.0.0.1", advertise_host="localhost")
        assert endpoint.startswith("tcp://localhost:")
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(endpoint)
        await push.send(b"hello")
        got = await asyncio.wait_for(pull.recv(), 5)
        push.close()
        pull.close()
        ctx.term()
        return got

    assert asyncio.run(main()) == b"hello"
