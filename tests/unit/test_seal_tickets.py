"""Sealed listeners' ZAP answers (transport/auth.py): which tickets get in, from where, and what the answer tells."""

from __future__ import annotations

import pytest
import zmq.utils.z85

from sluice.transport.auth import SESSION_BYTES, JobKeys, canonical_address

SECRET = b"s" * 32
NAMES = ["scheduler", "server-0", "worker-0", "worker-1"]
KEYS = JobKeys(SECRET, NAMES)
SESSION = bytes(range(SESSION_BYTES))


def request(name: str, password: bytes, address: str = "10.0.0.2", domain: bytes = b"sluice-seal-ch1",
            mechanism: bytes = b"PLAIN") -> list[bytes]:
    return [b"1.0", b"7", domain, address.encode(), b"", mechanism, name.encode(), password]


def ticket(name: str = "worker-0", receiver: str = "server-0", channel: int = 1, address: str = "10.0.0.2",
           keys: JobKeys = KEYS) -> bytes:
    return keys.seal_ticket(name, receiver, channel, SESSION, address)


def answer(req: list[bytes], receiver: str = "server-0") -> tuple[list[bytes], list[tuple[str, int, bytes | None]]]:
    heard: list[tuple[str, int, bytes | None]] = []
    reply = KEYS.zap_reply(req, receiver, lambda *told: heard.append(told))
    return reply, heard


def test_a_members_ticket_from_its_address_gets_in_under_its_name_and_the_session_is_told() -> None:
    reply, heard = answer(request("worker-0", ticket()))
    assert reply[:5] == [b"1.0", b"7", b"200", b"OK", b"worker-0"]
    value = SESSION.hex().encode()
    assert reply[5] == bytes([9]) + b"X-Session" + len(value).to_bytes(4, "big") + value  # ZMTP metadata
    assert heard == [("worker-0", 1, SESSION)]


@pytest.mark.parametrize("shown, why", [
    (request("worker-0", ticket(), address="10.0.0.9"),
     b"worker-0 dialled from 10.0.0.2 but its connection comes from 10.0.0.9"),  # read off the network, shown elsewhere
    (request("worker-0", ticket(channel=0)), b"not a member of this job"),  # another channel's listener
    (request("worker-0", ticket(receiver="server-1")), b"not a member of this job"),  # another listener's
    (request("worker-1", ticket()), b"not a member of this job"),  # another member's ticket under this name
    (request("worker-0", ticket(keys=JobKeys(b"g" * 32, NAMES))), b"not a member of this job"),  # guessed secret
    (request("stranger", JobKeys(SECRET, ["stranger"]).seal_ticket("stranger", "server-0", 1, SESSION, "10.0.0.2")),
     b"not a member of this job"),  # a name that is no member's
    (request("worker-0", ticket(), mechanism=b"CURVE"), b"not a member of this job"),
    (request("worker-0", ticket()[:-1]), b"not a member of this job"),  # cut short: another address
    (request("worker-0", ticket()[:40]), b"not a member of this job"),  # no whole MAC
    (request("worker-0", b""), b"not a member of this job"),
    (request("worker-0", ticket() + b"\nforged log line"), b"not a member of this job"),  # never logged
    (request("worker-0", ticket(), domain=b"sluice-seal-chX"), b"not a member of this job"),  # no channel
])
def test_what_a_sealed_listener_refuses(shown: list[bytes], why: bytes) -> None:
    reply, heard = answer(shown)
    assert reply[2:4] == [b"400", why] and reply[4:] == [b"", b""]
    assert heard == []


def test_a_sealed_listener_without_its_own_name_admits_nothing() -> None:
    assert answer(request("worker-0", ticket()), receiver="")[0][2] == b"400"


def test_a_ticket_names_its_address_and_hides_the_rest() -> None:
    made = ticket(address="fd00::2")
    assert made.startswith(SESSION) and made.endswith(b"fd00::2") and len(made) == SESSION_BYTES + 32 + 7
    assert answer(request("worker-0", made, address="fd00::2"))[0][2] == b"200"
    assert answer(request("worker-0", made, address="[fd00::2]"))[0][2] == b"200"  # as libzmq may write it


@pytest.mark.parametrize("text, canonical", [
    ("10.0.0.2", "10.0.0.2"), ("[fd00::2]", "fd00::2"), ("FD00:0::2", "fd00::2"), ("::ffff:10.0.0.2", "10.0.0.2"),
    ("fe80::1%eth0", "fe80::1"), ("localhost", ""), ("10.0.0.2\nx", ""), ("", ""),
])
def test_canonical_address(text: str, canonical: str) -> None:
    assert canonical_address(text) == canonical


def test_curve_and_local_listeners_answer_as_before() -> None:
    curve = [b"1.0", b"1", b"sluice", b"10.0.0.2", b"", b"CURVE", bytes(32)]
    assert KEYS.zap_reply(curve, "server-0")[2] == b"400"  # no member's key
    assert KEYS.zap_reply([*curve[:6], zmq.utils.z85.decode(KEYS.public_key("worker-0"))],
                          "server-0")[2:6] == [b"200", b"OK", b"worker-0", b""]  # CURVE: no session told
