"""The cluster's job registry on real sockets: jobs see each other, strangers and garbage are refused, takeover."""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import zmq

from sluice.scheduler.jobs_registry import JobState
from sluice.scheduler.registry_client import RegistryLink, query
from sluice.scheduler.registry_service import (
    MAX_JOBS,
    MAX_REQUEST_BYTES,
    SERVER_NAME,
    Request,
    encode_reply,
    encode_request,
    load_keys,
    parse_reply,
    parse_request,
    registry_keys,
    split_endpoint,
)

SECRET = b"cluster registry secret 0123456789"
A = JobState("tcp://10.0.0.1:5555", 101, 1000.0, 4, 2, True, 2, 300.0, 40, 1010.0)
B = replace(A, job="tcp://10.0.0.2:5555", started=1005.0, level=0, attained_mib=1.0, rounds=2)


def _free_port() -> int:
    with socket.socket() as probe:  # the OS picks it; the registry binds it a moment later
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _until(condition: object, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return
        time.sleep(0.02)
    raise AssertionError("not within the deadline")


def _exchange(link: RegistryLink, state: JobState, within: float = 5.0) -> list[JobState]:
    """Report until a reply comes back (the first reports go out once the connection is up)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        link.report(state, time.monotonic())
        time.sleep(0.05)
        jobs = link.receive(time.monotonic())
        if jobs is not None:
            return jobs
    raise AssertionError(f"no reply from the registry at {link.endpoint}")


@pytest.mark.timeout(30)
def test_requests_and_replies_take_only_their_schema() -> None:
    request = Request(7, "report", state=A)
    assert parse_request(encode_request(request)) == request
    assert parse_request(encode_request(Request(8, "withdraw", job=A.job))).job == A.job
    assert parse_reply(encode_reply(3, [A, B], 2)) == (3, [A, B], 2)
    body = json.loads(encode_request(request))
    for bad in (b"not json", b"[]", json.dumps({**body, "op": "drop"}).encode(),
                json.dumps({**body, "extra": 1}).encode(), json.dumps({**body, "seq": -1}).encode(),
                json.dumps({**body, "v": 2}).encode(),
                json.dumps({**body, "state": {**asdict(A), "pid": "1"}}).encode(),
                json.dumps({"v": 1, "seq": 1, "op": "withdraw", "job": ""}).encode(),
                b" " * (MAX_REQUEST_BYTES + 1)):
        with pytest.raises(ValueError):
            parse_request(bad)
    reply = json.loads(encode_reply(3, [A], 0))
    for bad in (b"{}", json.dumps({**reply, "jobs": [{"job": 1}]}).encode(),
                json.dumps({**reply, "refused": -1}).encode(),
                json.dumps({**reply, "jobs": [asdict(A)] * (MAX_JOBS + 1)}).encode()):
        with pytest.raises(ValueError):
            parse_reply(bad)
    assert split_endpoint("[::1]:29450") == ("::1", 29450)
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_endpoint("node1")


@pytest.mark.timeout(30)
def test_load_keys_wants_a_private_secret_file_unless_curve_is_off(tmp_path: Path) -> None:
    assert load_keys("", curve=False) is None
    with pytest.raises(ValueError, match="registry_secret_file"):
        load_keys("", curve=True)
    secret = tmp_path / "registry.secret"
    secret.write_bytes(SECRET + b"\n")
    secret.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_keys(str(secret), curve=True)
    secret.chmod(0o600)
    keys = load_keys(str(secret), curve=True)
    assert keys is not None and keys.public_key(SERVER_NAME) == registry_keys(SECRET).public_key(SERVER_NAME)


def _hostile(ctx: zmq.Context[zmq.Socket[bytes]], url: str, curve_secret: bytes | None, server_secret: bytes,
             frames: list[list[bytes]]) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve_secret is not None:  # a client of keys derived from curve_secret, of the server's real public key
        registry_keys(curve_secret).secure_client(sock, "registry-client", SERVER_NAME)
        sock.setsockopt(zmq.CURVE_SERVERKEY, registry_keys(server_secret).public_key(SERVER_NAME))
    sock.connect(url)
    for message in frames:
        sock.send_multipart(message)
    return sock


@pytest.mark.timeout(60)
def test_jobs_see_each_other_through_the_served_registry_and_strangers_are_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    """Two schedulers' links (standing for two hosts); a stranger without the secret, one with another
    secret, and a holder of the secret sending garbage, oversized and multi-frame requests: each refused
    and counted, and the registry keeps answering."""
    endpoint = f"127.0.0.1:{_free_port()}"
    keys = registry_keys(SECRET)
    serving, other = RegistryLink(endpoint, keys, serve=True), RegistryLink(endpoint, keys, serve=False)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        assert serving.server is not None and other.server is None
        _exchange(serving, A)
        assert [j.job for j in _exchange(other, B)] == [A.job, B.job]  # oldest first
        assert [j.job for j in _exchange(serving, replace(A, rounds=41))] == [A.job, B.job]
        assert serving.jobs[0].rounds == 41 and serving.refused == 0
        url = serving.server.endpoint
        garbage = [[b"not json"], [b"{}"], [encode_request(Request(1, "report", state=A)), b"extra"],
                   [json.dumps({"v": 1, "seq": 1, "op": "report", "state": {**asdict(B), "level": -1}}).encode()],
                   [b"x" * (MAX_REQUEST_BYTES + 100)]]
        with caplog.at_level(logging.WARNING, "sluice.scheduler"):
            socks = [_hostile(ctx, url, None, SECRET, [[encode_request(Request(1, "withdraw", job=A.job))]]),
                     _hostile(ctx, url, b"not the cluster's secret, guessed", SECRET,
                              [[encode_request(Request(1, "withdraw", job=A.job))]]),
                     _hostile(ctx, url, SECRET, SECRET, garbage),
                     _hostile(ctx, url, SECRET, SECRET, [[b"y" * (1 << 20)]])]  # over the frame cap: cut unread
            _until(lambda: serving.server is not None and serving.server.refused >= len(garbage) + 2)
        assert serving.server.rejects.total == len(garbage)
        # and the failed handshakes: at least one of each stranger (ZeroMQ retries a refused handshake)
        assert serving.server.refused >= len(garbage) + 2
        assert "job registry: refused a request" in caplog.text
        for sock in socks:
            assert not sock.poll(100)  # nobody got a reply, nor a table
            sock.close()
        jobs, refused = query(endpoint, keys, timeout_s=5)  # `sluice jobs --registry`: still serving, A not withdrawn
        assert [j.job for j in jobs] == [A.job, B.job] and refused >= len(garbage) + 2
        other.withdraw(B.job)
        _until(lambda: [j.job for j in query(endpoint, keys)[0]] == [A.job])
        with pytest.raises(TimeoutError, match="registry secret file"):  # the wrong secret gets no answer
            query(endpoint, registry_keys(b"another cluster's secret 0123456"), timeout_s=0.5)
    finally:
        ctx.destroy(linger=0)
        other.close()
        serving.close()


@pytest.mark.timeout(60)
def test_registry_lost_then_taken_over_by_a_scheduler_on_its_host(caplog: pytest.LogCaptureFixture) -> None:
    """The serving job ends: a link that may not serve logs it once and carries on; one on the registry's
    host that may serve binds the port and the table is back within a report."""
    endpoint = f"127.0.0.1:{_free_port()}"
    first = RegistryLink(endpoint, None, serve=True, deadline_s=0.3)
    bystander = RegistryLink(endpoint, None, serve=False, deadline_s=0.3)
    heir = RegistryLink(endpoint, None, serve=True, deadline_s=0.3)
    try:
        assert first.server is not None and heir.server is None and heir.serve  # the port was taken: a client
        for link, state in ((first, A), (bystander, B), (heir, replace(B, job="tcp://10.0.0.3:1"))):
            _exchange(link, state)
        first.close()
        with caplog.at_level(logging.INFO, "sluice.scheduler"):
            for _ in range(10):  # ten report periods with nobody serving it for the bystander
                bystander.report(B, time.monotonic())
                time.sleep(0.1)
                assert bystander.receive(time.monotonic()) is None
            assert bystander.reachable is False
            assert caplog.text.count("has not answered") == 1  # logged once, not once a period
            heir.report(B, time.monotonic())
            time.sleep(0.4)
            heir.receive(time.monotonic())  # the deadline passed: it binds the port now
            assert heir.server is not None and "serving the cluster's job registry" in caplog.text
            assert [j.job for j in _exchange(bystander, B)] == [B.job]
            assert "answers again" in caplog.text
    finally:
        for link in (bystander, heir):
            link.close()


@pytest.mark.timeout(30)
def test_a_registry_host_that_is_not_this_one_is_never_served() -> None:
    link = RegistryLink(f"192.0.2.1:{_free_port()}", None, serve=True)  # TEST-NET-1: no host of ours
    try:
        assert link.server is None and not link.serve
    finally:
        link.close()



@pytest.mark.timeout(30)
def test_the_config_wants_a_registry_secret_unless_curve_is_off() -> None:
    from sluice.launch.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="registry_secret_file"):
        load_config(None, {}, ["jobs.registry=node1:29450"])
    with pytest.raises(ConfigError, match="HOST:PORT"):
        load_config(None, {}, ["jobs.registry=node1", "transport.curve=false"])
    assert load_config(None, {}, ["jobs.registry=node1:29450", "transport.curve=false"]).jobs.registry_serve
    assert load_config(None, {"SLUICE_JOBS_REGISTRY": "node1:29450", "SLUICE_JOBS_REGISTRY_SECRET_FILE": "/s"},
                       []).jobs.registry_secret_file == "/s"
