"""Machine ranks handed out by machine 0 to launchers started without --node-rank: the pure book and messages
(literal tables), and the service on 127.0.0.1 with CURVE: ranks in asking order, the same rank asked again, a
machine too many or started differently refused with what to change, strangers and malformed requests counted."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time

import pytest
import zmq

from sluice.launch.node_ranks import (
    Ask,
    RankBook,
    RankError,
    RankService,
    ask_rank,
    encode_answer,
    encode_ask,
    parse_answer,
    parse_ask,
    rank_keys,
)
from sluice.transport.request_server import dealer

pytestmark = pytest.mark.timeout(30)
TOKENS = [f"{i:032x}" for i in range(1, 6)]


def test_the_book_gives_ranks_in_asking_order_the_same_again_and_refuses_one_too_many_or_a_different_job() -> None:
    book = RankBook(3, 4)
    asks = [Ask(TOKENS[0], "b", 3, 4), Ask(TOKENS[1], "c", 3, 4), Ask(TOKENS[0], "b", 3, 4), Ask(TOKENS[2], "d", 3, 4),
            Ask(TOKENS[3], "e", 4, 4), Ask(TOKENS[3], "e", 3, 2)]
    answers = [book.give(ask) for ask in asks]
    assert [rank for rank, _ in answers] == [1, 2, 1, None, None, None]
    assert answers[3][1] == ("the job's 3 machines are all here (machine 0 and 1 b, 2 c), and d asked for a rank "
                             "too: is --nnodes right, or does a machine run `sluice launch` twice?")
    assert answers[4][1].startswith("machine 0 runs --nnodes 3 --nproc-per-node 4, and e was started with --nnodes 4 "
                                    "--nproc-per-node 4: start every machine with the same")
    assert "--nproc-per-node 2" in answers[5][1]
    assert book.given == {TOKENS[0]: (1, "b"), TOKENS[1]: (2, "c")}  # refusals keep nothing


@pytest.mark.parametrize(("raw", "why"), [
    (b"\xff", "not JSON"),
    (b"[]", "not a rank message"),
    (json.dumps({"v": 2, "token": TOKENS[0], "host": "h", "nnodes": 2, "nproc": 1}).encode(), "not a rank message"),
    (json.dumps({"v": 1, "token": TOKENS[0], "host": "h", "nnodes": 2}).encode(), "not a rank message"),
    (json.dumps({"v": 1, "token": "xyz", "host": "h", "nnodes": 2, "nproc": 1}).encode(), "16 to 64 hex digits"),
    (json.dumps({"v": 1, "token": "A" * 32, "host": "h", "nnodes": 2, "nproc": 1}).encode(), "16 to 64 hex digits"),
    (json.dumps({"v": 1, "token": TOKENS[0], "host": "", "nnodes": 2, "nproc": 1}).encode(), "host name"),
    (json.dumps({"v": 1, "token": TOKENS[0], "host": "a\nb", "nnodes": 2, "nproc": 1}).encode(), "host name"),
    (json.dumps({"v": 1, "token": TOKENS[0], "host": "h", "nnodes": 1, "nproc": 1}).encode(), "nnodes must be"),
    (json.dumps({"v": 1, "token": TOKENS[0], "host": "h", "nnodes": 2, "nproc": 0}).encode(), "nnodes must be"),
    (json.dumps({"v": 1, "token": TOKENS[0], "host": "h", "nnodes": True, "nproc": 1}).encode(), "nnodes must be"),
    (b" " * 1025, "over 1024"),
])
def test_a_malformed_request_says_what_is_wrong(raw: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_ask(raw)


def test_messages_round_trip_and_an_answer_holds_a_rank_or_an_error() -> None:
    ask = Ask(TOKENS[0], "node-7", 4, 8)
    assert parse_ask(encode_ask(ask)) == ask
    assert parse_answer(encode_answer(3, "")) == (3, "")
    assert parse_answer(encode_answer(None, "no")) == (None, "no")
    for bad in (encode_answer(0, ""), encode_answer(None, ""), encode_answer(2, "and an error")):
        with pytest.raises(ValueError):
            parse_answer(bad)


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_service_hands_out_ranks_with_the_job_secret_and_counts_strangers_and_garbage() -> None:
    secret, port, said = os.urandom(32), _port(), []
    keys = rank_keys(secret)
    service = RankService("127.0.0.1", port, keys, 3, 2, said.append)
    try:
        quiet = [].append
        assert ask_rank("127.0.0.1", port, keys, Ask(TOKENS[0], "b", 3, 2), 5, quiet) == 1
        assert ask_rank("127.0.0.1", port, keys, Ask(TOKENS[0], "b", 3, 2), 5, quiet) == 1  # asked again: the same
        assert ask_rank("127.0.0.1", port, keys, Ask(TOKENS[1], "c", 3, 2), 5, quiet) == 2
        with pytest.raises(RankError, match="gives this machine no rank: the job's 3 machines are all here"):
            ask_rank("127.0.0.1", port, keys, Ask(TOKENS[2], "d", 3, 2), 5, quiet)
        started = time.monotonic()  # another secret: no handshake, so no answer, and an error saying what to check
        with pytest.raises(RankError, match=re.escape(
                "did not give this machine a rank within 1 s: is `sluice launch --nnodes 3` running on 127.0.0.1, "
                "with the same --secret-file")):
            ask_rank("127.0.0.1", port, rank_keys(os.urandom(32)), Ask(TOKENS[3], "e", 3, 2), 1, quiet)
        assert time.monotonic() - started < 3
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = dealer(ctx, "127.0.0.1", port, keys, ("node-ranks-client", "node-ranks"), 1024, immediate=False)
        sock.send(b"{not json")  # a member's garbage: refused and counted, and the service answers on
        sock.send(encode_ask(Ask(TOKENS[1], "c", 3, 2)))
        assert sock.poll(5000) and parse_answer(sock.recv()) == (2, "")
        sock.close(linger=0)
        ctx.term()
        deadline = time.monotonic() + 5
        while service.refused < 2 and time.monotonic() < deadline:  # the garbage, the stranger's handshake
            time.sleep(0.05)
        assert service.refused >= 2
    finally:
        service.close()
    assert said[:2] == ["machine 1 of 3: b", "machine 2 of 3: c"]
    assert said[2].startswith("refused a rank to d: the job's 3 machines are all here")


def test_a_machine_asking_before_machine_0_is_up_gets_its_rank_once_it_is() -> None:
    port, keys = _port(), rank_keys(os.urandom(32))
    ctx_started = time.monotonic()
    got: list[int] = []
    asker = threading.Thread(target=lambda: got.append(
        ask_rank("127.0.0.1", port, keys, Ask(TOKENS[0], "b", 2, 1), 10, [].append)))
    asker.start()
    time.sleep(1.5)  # the asker tried already, with nobody listening
    service = RankService("127.0.0.1", port, keys, 2, 1, [].append)
    try:
        asker.join(timeout=10)
    finally:
        service.close()
    assert got == [1] and time.monotonic() - ctx_started < 5
