"""What machine 0 keeps for the launchers of a job run one per machine: ranks and the job's starts (the pure book and
messages, literal tables), and its service on 127.0.0.1 with CURVE: ranks in asking order, the same rank asked again,
a machine too many or started differently refused with what to change, a failure starting the job again once,
strangers and malformed requests counted."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time

import pytest
import zmq

from sluice.launch.machine_zero import MachineZero, RankError, RankService, rank_keys
from sluice.launch.node_ranks import Answer, Ask, JobBook, encode_answer, encode_ask, parse_answer, parse_ask
from sluice.transport.request_server import dealer

pytestmark = pytest.mark.timeout(30)
TOKENS = [f"{i:032x}" for i in range(1, 6)]


def _ask(op: str, token: int, host: str, nnodes: int | tuple[int, int] = 3, nproc: int = 4, restarts: int = 0,
         start: int = 0) -> Ask:
    low, high = nnodes if isinstance(nnodes, tuple) else (nnodes, nnodes)
    return Ask(op, TOKENS[token], host, low, high, nproc, restarts, start)


def test_the_book_gives_ranks_in_asking_order_the_same_again_and_refuses_one_too_many_or_a_different_job() -> None:
    book = JobBook((3, 3), 4, 0)
    asks = [_ask("rank", 0, "b"), _ask("rank", 1, "c"), _ask("rank", 0, "b"), _ask("rank", 2, "d"),
            _ask("rank", 3, "e", nnodes=4), _ask("rank", 3, "e", nproc=2), _ask("rank", 3, "e", restarts=1),
            _ask("rank", 3, "e", nnodes=(2, 3)), _ask("join", 3, "e")]
    answers = [book.answer(ask, 0.0) for ask in asks]
    assert [a.rank for a in answers] == [1, 2, 1, None, None, None, None, None, None]
    assert {a.nnodes for a in answers} == {3}  # a fixed count: known from the first
    assert answers[3].error == ("the job's 3 machines are all here (machine 0 and 1 b, 2 c), and d asked to join "
                                "too: is --nnodes right, or does a machine run `sluice launch` twice?")
    assert answers[4].error == ("machine 0 runs --nnodes 3 --nproc-per-node 4 --max-restarts 0, and e was started "
                                "with --nnodes 4 --nproc-per-node 4 --max-restarts 0: start every machine with the "
                                "same")
    assert "--nproc-per-node 2" in answers[5].error and "--max-restarts 1: start" in answers[6].error
    assert "e was started with --nnodes 2:3 " in answers[7].error
    assert answers[8].error == "e asked to join a round, but the job's --nnodes is fixed: start it the same way"
    assert book.given == {TOKENS[0]: (1, "b"), TOKENS[1]: (2, "c")}  # refusals keep nothing


def test_the_first_failure_of_the_current_start_begins_the_next_and_the_last_ends_the_job() -> None:
    book = JobBook((2, 2), 1, 2)
    seen = []
    for op, start in [("start", 0), ("failed", 0), ("failed", 0), ("start", 0), ("failed", 1), ("failed", 2),
                      ("failed", 1)]:
        answer = book.answer(_ask(op, 0, "b", nnodes=2, nproc=1, restarts=2, start=start), 0.0)
        seen.append((answer.start, answer.failures, answer.over))
    # a report of a start already left changes nothing; a failure of the last start (restart 2 of 2) ends the job
    assert seen == [(0, 0, False), (1, 1, False), (1, 1, False), (1, 1, False), (2, 2, False), (2, 2, True),
                    (2, 2, True)]
    book.ready = 2
    assert book.answer(_ask("start", 0, "b", nnodes=2, nproc=1, restarts=2), 0.0).ready == 2


def test_the_failure_that_began_a_start_or_ended_the_job_is_in_every_answer_until_a_join_begins_one() -> None:
    book = JobBook((2, 2), 1, 1)

    def failed(start: int, cause: str) -> Answer:
        return book.answer(Ask("failed", TOKENS[0], "b", 2, 2, 1, 1, start, cause), 0.0)

    assert book.answer(_ask("start", 0, "b", nnodes=2, nproc=1, restarts=1), 0.0).failure == ""
    cause = "machine 1 (b): worker 1 exited with code 1"
    assert failed(0, cause).failure == cause
    # a second report of the start already left (machine 0's, say) keeps the first cause
    assert failed(0, "machine 0 (a): worker 0 reported a peer left").failure.startswith("machine 1 (b): worker 1")
    assert book.answer(_ask("start", 0, "b", nnodes=2, nproc=1, restarts=1), 0.0).failure.startswith("machine 1 (b)")
    ended = failed(1, "machine 0 (a): the scheduler exited with code 1")
    assert ended.over and ended.failure == "machine 0 (a): the scheduler exited with code 1"
    # machine 0's own failure goes through the same book: what it words is made wire-safe as a launcher's is
    book = JobBook((2, 3), 1, 0, last_call_s=30.0, stale_s=100.0)
    book.failed(0, 0.0, "machine 0 (h\u00f6st):\n  worker 0 " + "x" * 300)
    assert book.failure.startswith("machine 0 (h?st): worker 0 xx") and book.failure.endswith("...")
    assert len(book.failure) == 240 and book.over
    book = JobBook((2, 3), 1, 1, last_call_s=30.0, stale_s=100.0)  # an elastic range: a join begins a start
    _round(book, [(0, "join", 0, "b"), (30, "join", 0, "b")])
    book.failed(0, 31.0, "machine 1 (b): worker 1 exited with code 1")
    assert book.start == 1 and book.failure == "machine 1 (b): worker 1 exited with code 1"
    _round(book, [(32, "join", 0, "b"), (62, "join", 0, "b"), (63, "join", 1, "c")])  # c comes while start 1 runs
    assert book.start == 2 and book.failure == ""


def _round(book: JobBook, steps: list[tuple[float, str, int, str]]) -> list[tuple[object, ...]]:
    """Each (time, op, token, host) taken by `book` (a failure: of the current start): (rank, nnodes, start, failures,
    over) of its answer."""
    seen: list[tuple[object, ...]] = []
    for now, op, token, host in steps:
        low, high = book.nodes
        a = book.answer(_ask(op, token, host, nnodes=(low, high), nproc=1, restarts=book.restarts, start=book.start),
                        now)
        assert not a.error, a.error
        seen.append((a.rank, a.nnodes, a.start, a.failures, a.over))
    return seen


def test_an_elastic_round_closes_at_max_or_at_its_last_call_after_min_and_ranks_in_joining_order() -> None:
    book = JobBook((2, 3), 1, 0, last_call_s=30.0, stale_s=100.0)
    assert _round(book, [(0, "join", 0, "b"), (5, "join", 0, "b"), (6, "join", 1, "c"), (7, "join", 0, "b")]) == [
        (None, 0, 0, 0, False), (None, 0, 0, 0, False), (2, 3, 0, 0, False), (1, 3, 0, 0, False)]  # MAX: at once
    book = JobBook((2, 4), 1, 0, last_call_s=30.0, stale_s=100.0)  # here every machine asks in time
    # MIN (machine 0 and b) at 0: the last call ends at 30, with whoever joined by then
    assert _round(book, [(0, "join", 0, "b"), (29.9, "join", 0, "b"), (30, "join", 0, "b")]) == [
        (None, 0, 0, 0, False), (None, 0, 0, 0, False), (1, 2, 0, 0, False)]
    # c comes while start 0 runs, with room: start 1 begins with c first (no failure counted); b joins it, and its
    # last call runs from c's coming (MIN again at 40)
    assert _round(book, [(40, "join", 1, "c"), (40.5, "start", 0, "b"), (41, "join", 0, "b"), (69, "join", 1, "c"),
                         (70, "join", 1, "c"), (70.1, "join", 0, "b")]) == [
        (None, 0, 1, 0, False), (None, 0, 1, 0, False), (None, 0, 1, 0, False), (None, 0, 1, 0, False),
        (1, 3, 1, 0, False), (2, 3, 1, 0, False)]
    assert book.given == {TOKENS[1]: (1, "c"), TOKENS[0]: (2, "b")}


def test_an_elastic_round_drops_a_machine_that_stopped_asking_and_a_full_job_keeps_a_newcomer_waiting() -> None:
    book = JobBook((3, 4), 1, 1, last_call_s=30.0)  # a machine stops asking after STALE_S (10 s)
    # b and c join (MIN at 1); b stops asking: at 12 it is gone, MIN is lost, and d's joining restarts the last call
    steps = [(0.0, "join", 0, "b"), (1.0, "join", 1, "c"), (12.0, "join", 1, "c"), (13.0, "join", 2, "d")]
    steps += [(t + dt, "join", token, host) for t in (20, 30, 40) for dt, token, host in ((0, 1, "c"), (2, 2, "d"))]
    assert _round(book, [*steps, (42.9, "join", 1, "c"), (43.0, "join", 2, "d")]) == [(None, 0, 0, 0, False)] * (
        len(steps) + 1) + [(2, 3, 0, 0, False)]
    assert book.given == {TOKENS[1]: (1, "c"), TOKENS[2]: (2, "d")}
    book = JobBook((2, 2 + 1), 1, 1, last_call_s=30.0)
    assert _round(book, [(0, "join", 0, "b"), (0, "join", 1, "c")])[-1] == (2, 3, 0, 0, False)
    # the job runs on its MAX: e waits (no restart for it); c's machine fails: start 1 takes e first, then the others
    assert _round(book, [(1, "join", 3, "e"), (2, "failed", 1, "c"), (2.1, "join", 0, "b"), (2.2, "join", 1, "c"),
                         (2.3, "join", 3, "e")]) == [
        (None, 3, 0, 0, False), (None, 0, 1, 1, False), (2, 3, 1, 1, False), (None, 3, 1, 1, False),
        (1, 3, 1, 1, False)]
    assert book.waiting == {TOKENS[1]: "c"}  # c came last: it waits for room, as torchrun's redundant node
    for token, host in ((2, "d"), (4, "f")):  # two more wait; a fourth is refused: what the book keeps is bounded
        assert book.answer(_ask("join", token, host, nnodes=(2, 3), nproc=1, restarts=1), 2.5).error == ""
    assert book.answer(_ask("join", 0, "b", nnodes=(2, 3), nproc=1, restarts=1), 2.5).rank == 2  # in the start
    assert "3 machines already wait to join a job of at most 3 (--nnodes 2:3), and y came too" in book.answer(
        Ask("join", "f" * 32, "y", 2, 3, 1, 1), 2.5).error
    assert len(book.waiting) == 3 and "f" * 32 not in book.heard
    assert _round(book, [(3, "failed", 0, "b")])[-1] == (None, 3, 1, 1, True)  # no restart left: over


@pytest.mark.parametrize(("raw", "why"), [
    (b"\xff", "not JSON"),
    (b"[]", "not a machine-0 message"),
    (json.dumps({"v": 2, "op": "rank", "token": TOKENS[0], "host": "h", "min_nodes": 2, "max_nodes": 2, "nproc": 1,
                 "restarts": 0, "start": 0}).encode(), "not a machine-0 message"),  # the protocol before causes
    (json.dumps({"v": 3, "op": "rank", "token": TOKENS[0], "host": "h", "min_nodes": 2, "max_nodes": 2,
                 "nproc": 1}).encode(), "not a machine-0 message"),
])
def test_a_request_that_is_not_one_says_so(raw: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_ask(raw)


@pytest.mark.parametrize(("field", "value", "why"), [
    ("op", "reboot", "op must be one of rank, join, start, failed"),
    ("token", "xyz", "16 to 64 hex digits"), ("token", "A" * 32, "16 to 64 hex digits"),
    ("host", "", "host name"), ("host", "a\nb", "host name"), ("min_nodes", 0, "min_nodes must be an integer from 1"),
    ("max_nodes", 1, "max_nodes must be an integer from 2"), ("nproc", 0, "nproc must be"),
    ("min_nodes", True, "min_nodes must"), ("min_nodes", 3, "max_nodes must be an integer from 3"),
    ("restarts", -1, "restarts must be"), ("start", 10**7, "start must be"), ("start", "1", "start must be"),
    ("cause", None, "cause must be printable ASCII"), ("cause", "x" * 241, "at most 240"),
    ("cause", "worker 3\x1b[2J", "cause must be"), ("cause", "w\u00f6rker", "cause must be"),
])
def test_a_malformed_field_says_what_is_wrong(field: str, value: object, why: str) -> None:
    body = {"v": 3, "op": "rank", "token": TOKENS[0], "host": "h", "min_nodes": 2, "max_nodes": 2, "nproc": 1,
            "restarts": 0, "start": 0, "cause": ""}
    with pytest.raises(ValueError, match=why):
        parse_ask(json.dumps({**body, field: value}).encode())
    with pytest.raises(ValueError, match="over 1024"):
        parse_ask(b" " * 1025)


def test_messages_round_trip_and_an_answer_is_checked_as_a_request_is() -> None:
    ask = Ask("failed", TOKENS[0], "node-7", 2, 4, 8, 3, 2, "machine 1 (node-7): worker 5 exited with code 1")
    assert parse_ask(encode_ask(ask)) == ask
    for answer in (Answer(3, 4, "", 0, 0, 0, False), Answer(None, 0, "no", 2, 1, 1, True, "machine 1 (b): worker 2")):
        assert parse_answer(encode_answer(answer)) == answer
    for bad in (Answer(0, 2, "", 0, 0, 0, False), Answer(None, 0, "", -1, 0, 0, False),
                Answer(None, -1, "", 0, 0, 0, False), Answer(None, 0, "", 0, 0, 0, True, "a\nb")):
        with pytest.raises(ValueError):
            parse_answer(encode_answer(bad))


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank(zero: MachineZero, timeout: float = 5) -> int | None:
    return zero.request("rank", timeout, [].append, until=lambda answer: answer.rank is not None).rank


def test_the_service_hands_out_ranks_and_starts_with_the_job_secret_and_counts_strangers_and_garbage() -> None:
    secret, port, said = os.urandom(32), _port(), []
    keys = rank_keys(secret)
    service = RankService("127.0.0.1", port, keys, JobBook((3, 3), 2, 1), said.append)
    lines = [MachineZero("127.0.0.1", port, keys, _ask("rank", i, host, nproc=2, restarts=1))
             for i, host in enumerate("bcd")]
    try:
        assert [_rank(lines[0]), _rank(lines[0]), _rank(lines[1])] == [1, 1, 2]  # asked again: the same
        with pytest.raises(RankError, match="refuses this machine: the job's 3 machines are all here"):
            _rank(lines[2])
        # machine 1's processes fail: the job's next start, which the others follow once machine 0 started it
        moved = lines[0].request("failed", 5, [].append, 0, lambda answer: answer.start > 0 or answer.over)
        assert (moved.start, moved.ready, moved.over) == (1, 0, False)
        assert service.state() == (1, False) and service.failed(0) == (1, False)  # machine 0's own report: no more
        service.started(1)
        assert lines[1].request("start", 5, [].append).ready == 1
        assert service.failed(1) == (1, True)  # no restart left
        stranger = MachineZero("127.0.0.1", port, rank_keys(os.urandom(32)), _ask("rank", 3, "e", nproc=2))
        started = time.monotonic()  # another secret: no handshake, so no answer, and an error saying what to check
        with pytest.raises(RankError, match=re.escape(
                "did not answer within 1 s: is `sluice launch --nnodes 3` running on 127.0.0.1, with the same "
                "--secret-file")):
            _rank(stranger, 1)
        stranger.close()
        assert time.monotonic() - started < 3
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = dealer(ctx, "127.0.0.1", port, keys, ("node-ranks-client", "node-ranks"), 1024, immediate=False)
        sock.send(b"{not json")  # a member's garbage: refused and counted, and the service answers on
        sock.send(encode_ask(_ask("rank", 1, "c", nproc=2, restarts=1)))
        assert sock.poll(5000) and parse_answer(sock.recv()).rank == 2
        sock.close(linger=0)
        ctx.term()
        deadline = time.monotonic() + 5
        while service.refused < 2 and time.monotonic() < deadline:  # the garbage, the stranger's handshake
            time.sleep(0.05)
        assert service.refused >= 2
    finally:
        for line in lines:
            line.close()
        service.close()
    assert said[:2] == ["machine 1 of 3: b", "machine 2 of 3: c"]
    assert said[2].startswith("refused d: the job's 3 machines are all here")


def test_a_machine_asking_before_machine_0_is_up_gets_its_rank_once_it_is() -> None:
    port, keys = _port(), rank_keys(os.urandom(32))
    began = time.monotonic()
    zero = MachineZero("127.0.0.1", port, keys, _ask("rank", 0, "b", nnodes=2, nproc=1))
    got: list[int | None] = []
    asker = threading.Thread(target=lambda: got.append(_rank(zero, 10)))
    asker.start()
    time.sleep(1.5)  # the asker tried already, with nobody listening
    service = RankService("127.0.0.1", port, keys, JobBook((2, 2), 1, 0), [].append)
    try:
        asker.join(timeout=10)
    finally:
        zero.close()
        service.close()
    assert got == [1] and time.monotonic() - began < 5


def test_a_join_gives_up_soon_on_a_machine_0_that_never_answers_and_at_the_join_timeout_on_one_that_does() -> None:
    port, keys = _port(), rank_keys(os.urandom(32))
    zero = MachineZero("127.0.0.1", port, keys, _ask("join", 0, "b", nnodes=(2, 3), nproc=1))
    began = time.monotonic()
    try:  # nobody serves the port: the short wait for a first answer decides, not the join timeout
        with pytest.raises(RankError, match="did not answer within 1 s"):
            zero.request("join", 30, [].append, until=lambda a: a.rank is not None, silent_s=1)
        assert time.monotonic() - began < 4
    finally:
        zero.close()
    service = RankService("127.0.0.1", port, keys, JobBook((2, 3), 1, 0, last_call_s=60), [].append)
    assert service.waiting(10) == ("start 1 waits for machines (10 s): 1 joined of --nnodes 2:3; it begins once 2 "
                                   "have joined")  # what machine 0's launcher says while it waits
    zero = MachineZero("127.0.0.1", port, keys, _ask("join", 0, "b", nnodes=(2, 3), nproc=1))
    try:  # it answers (the round stays open for its last call), at its first ask after connecting (within ASK_EVERY_S):
        # the join timeout decides
        with pytest.raises(RankError, match=re.escape(
                "answers, but this machine's start did not come within 4 s (torchrun's join_timeout")):
            zero.request("join", 4, [].append, until=lambda a: a.rank is not None, silent_s=2.5)
        assert re.fullmatch(r"start 1 waits for machines \(20 s\): 2 joined of --nnodes 2:3; it begins at 3, or in "
                            r"5[5-9] s", service.waiting(20)), service.waiting(20)
    finally:
        zero.close()
        service.close()
