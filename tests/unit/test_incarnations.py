"""A restarted peer's HELLO makes the transport forget what it kept for the dead process (transport/incarnations.py)."""

from __future__ import annotations

import pytest

from sluice.transport.incarnations import Incarnations, hello_token
from sluice.transport.wire import Kind, Message, WireError
from sluice.transport.zmq_receive import RouterPeers


def test_the_first_hello_of_a_new_process_forgets_the_peer_then_each_other_channel_its_route() -> None:
    seen = Incarnations()
    table = [(peer, channel, token, seen.hello(peer, channel, token)) for peer, channel, token in [
        ("aggregator-0", 0, "a1", ), ("aggregator-0", 1, "a1"), ("worker-0", 0, "w1"),
        ("aggregator-0", 1, "a2"),  # restarted: its first connection says so
        ("aggregator-0", 0, "a2"),  # what came on channel 0 before this came from the dead one
        ("aggregator-0", 0, "a2"),  # a second HELLO of the same process changes nothing
        ("aggregator-0", 2, "a2"),  # a channel the dead one never used
        ("worker-0", 0, "w1"),
    ]]
    assert [forget for *_, forget in table] == ["", "", "", "peer", "route", "", "", ""]


@pytest.mark.parametrize("meta", [{}, {"process": 7}, {"process": ""}, {"process": "x" * 65}, {"process": "a b"}])
def test_a_malformed_hello_is_refused(meta: dict[str, object]) -> None:
    with pytest.raises(WireError):
        hello_token(Message(Kind.HELLO, meta=meta))
    assert hello_token(Message(Kind.HELLO, meta={"process": "0f3a"})) == "0f3a"


def test_a_new_process_is_answered_on_the_channel_its_hello_came_on_not_the_one_its_predecessor_was_heard_on() -> None:
    """Unprompted sends to a peer that dialled us (a shared-memory announcement) take the channel it was heard on
    first: surely connected. A restarted process may not have connected that channel yet."""
    peers = RouterPeers(frozenset({"server-1"}))
    peers.remember("server-1", b"server-1", 2)  # the dead process's channel 2 came up first
    peers.remember("server-1", b"server-1", 0)
    assert peers.heard_on == {"server-1": 2}
    peers.new_process("server-1", 0)
    peers.new_process("stranger", 1)  # never heard: nothing kept for it
    assert peers.heard_on == {"server-1": 0}
