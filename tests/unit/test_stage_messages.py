"""Stage messages (worker/pipeline/frames.py) and a stage's exchange (worker/pipeline/exchange.py).

The exchange is driven through the real wire codec (encode then decode) with a transport that records
what it is given: the logic of checks, waits and bounds, without sockets (the integration tests in
tests/integration/test_pipeline.py run real jobs).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from sluice.errors import SluiceError
from sluice.transport import zvc
from sluice.transport.wire import Kind, Message, WireError, decode, encode
from sluice.worker.pipeline.exchange import OVERHEAD_BYTES, Neighbours, StageExchange
from sluice.worker.pipeline.frames import (
    BACKWARD,
    FORWARD,
    SKIP_AFTER_DENSE,
    Assembly,
    Compression,
    Received,
    build,
    read,
)
from sluice.worker.pipeline.layout import StagePlace
from tests.unit.stage_helpers import Recorder

NAMES = ["worker-0", "worker-1", "worker-2"]


def through_wire(msg: Message) -> Message:
    return decode([bytes(f) if not isinstance(f, bytes) else f for f in encode(msg)])


def sparse(n: int = 1000, density: float = 0.3, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.where(rng.random(n) < density, rng.standard_normal(n), 0).astype(np.float32)


# ---------------------------------------------------------------------------- frames
def tensor_of(messages: list[Message], limit: int = 1 << 20) -> Received:
    """The tensor the messages carry, assembled from their pieces in reverse order."""
    pieces = [read(through_wire(m), limit) for m in reversed(messages)]
    assembly = Assembly(pieces[0])
    for piece in pieces[1:]:
        assert assembly.add(piece) is None
    assert assembly.complete()
    return assembly.tensor()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64"])
@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("piece", [64, 1 << 20])
def test_round_trip(dtype: str, compress: bool, piece: int) -> None:
    storage = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int64": np.int64}[dtype]
    array = (sparse(96) * 100).astype(storage).reshape(4, 2, 12)
    messages = build(FORWARD, 1, 7, 3, 1, 2, array, dtype, 1, compress, piece)
    size = messages[0].meta["size"]  # type: ignore[index]
    assert len(messages) == -(-size // piece) and all(m.nbytes <= piece for m in messages)
    assert [(m.round, m.chunk, m.key, m.sender) for m in messages] == [(7, 3, 1, 1)] * len(messages)
    got = tensor_of(messages)
    assert (got.slot, got.of, got.dtype, got.wire_bytes) == (1, 2, dtype, size)
    assert got.array.shape == (4, 2, 12) and got.array.dtype == np.dtype(storage)
    assert got.array.tobytes() == array.tobytes()
    assert messages[0].meta["zvc"] == compress  # type: ignore[index]


def test_raw_pieces_are_views_of_the_tensor_and_empty_tensors_travel() -> None:
    array = np.arange(100, dtype=np.float32)
    messages = build(FORWARD, 0, 0, 0, 0, 1, array, "float32", 0, False, 128)
    assert len(messages) == 4 and all(np.shares_memory(m.payload, array) for m in messages)
    empty = tensor_of(build(BACKWARD, 0, 0, 0, 0, 1, np.zeros((0, 3), np.float32), "float32", 0, True, 128))
    assert empty.array.shape == (0, 3)


def test_dense_tensor_travels_raw_even_with_compression_on() -> None:
    dense = np.arange(1, 101, dtype=np.float32)
    (msg,) = build(FORWARD, 0, 0, 0, 0, 1, dense, "float32", 0, True, 1 << 20)
    assert msg.meta is not None and msg.meta["zvc"] is False and msg.nbytes == 400


def test_compression_counts_ratio_and_skips_dense_slots() -> None:
    compression = Compression(True)
    array = sparse(4096, 0.1)
    messages = build(FORWARD, 0, 0, 0, 0, 1, array, "float32", 0, compression.wanted(0), 1 << 20)
    compression.count(0, array.nbytes, messages, True)
    assert compression.ratio == pytest.approx(array.nbytes / messages[0].nbytes) and compression.ratio > 4
    dense = np.ones(4096, np.float32)
    compression.count(1, dense.nbytes, build(FORWARD, 0, 0, 0, 1, 2, dense, "float32", 0, True, 1 << 20), True)
    assert [compression.wanted(1) for _ in range(SKIP_AFTER_DENSE + 1)] == [False] * SKIP_AFTER_DENSE + [True]
    assert compression.wanted(0) and not Compression(False).wanted(0)


def _piece_msg(compress: bool = True, piece: int = 1 << 20) -> Message:
    return through_wire(build(FORWARD, 0, 0, 0, 0, 1, sparse(), "float32", 0, compress, piece)[0])


def _meta(**changes: Any) -> Any:
    def change(msg: Message) -> None:
        assert msg.meta is not None
        msg.meta = {**msg.meta, **changes}
    return change


@pytest.mark.parametrize(("change", "message"), [
    (lambda m: setattr(m, "meta", None), "meta must have exactly"),
    (lambda m: setattr(m, "meta", {**m.meta, "extra": 1}), "meta must have exactly"),
    (_meta(of=0), "a micro-batch carries 1 to 64"),
    (_meta(of=65), "a micro-batch carries 1 to 64"),
    (lambda m: setattr(m, "key", 1), "slot 1 of 1"),
    (_meta(dtype="bool"), "not one a stage message carries"),
    (_meta(dtype="complex64"), "not one a stage message carries"),
    (_meta(zvc=1), "not one a stage message carries"),
    (_meta(shape=[-1]), "shape must be a list"),
    (_meta(shape=[1] * 9), "shape must be a list"),
    (_meta(shape=[1 << 39, 1 << 39]), "over this stage's limit"),
    (_meta(size=10), "cannot hold"),
    (_meta(size=5000), "cannot hold"),
    (_meta(piece=0), "does not cut"),
    (_meta(at=3), "does not cut"),
    (_meta(at=1 << 20), "does not cut"),
    (lambda m: (setattr(m, "payload", memoryview(bytes(m.payload)[:-1])), setattr(m, "shape", (m.shape[0] - 1,))),
     "must be .* bytes of uint8"),
    (lambda m: setattr(m, "payload", None), "bytes of uint8, got uint8"),
])
def test_malformed_pieces_are_refused(change: Any, message: str) -> None:
    msg = _piece_msg()
    change(msg)
    with pytest.raises(WireError, match=message):
        read(msg, 1 << 20)


def test_a_raw_tensor_must_be_exactly_its_bytes() -> None:
    msg = _piece_msg(compress=False)
    _meta(size=3996)(msg)
    with pytest.raises(WireError, match="3996 bytes cannot hold"):
        read(msg, 1 << 20)


def test_a_tensor_in_one_piece_of_its_own_memory_is_kept_and_one_in_several_is_copied() -> None:
    array = np.arange(100, dtype=np.float32).reshape(10, 10)
    whole = read(through_wire(build(FORWARD, 0, 0, 0, 0, 1, array, "float32", 0, False, 1 << 20)[0]), 1 << 20)
    kept = Assembly(whole, adopt=True).tensor().array
    assert np.shares_memory(kept, np.frombuffer(whole.data, np.uint8)) and kept.tolist() == array.tolist()
    assert not np.shares_memory(Assembly(whole).tensor().array, np.frombuffer(whole.data, np.uint8))
    first, *rest = [read(through_wire(m), 1 << 20) for m in build(FORWARD, 0, 0, 0, 0, 1, array, "float32", 0,
                                                                   False, 128)]
    assembly = Assembly(first, adopt=True)  # a first piece of several cannot be the tensor's memory
    assert not assembly.complete() and all(assembly.add(piece) is None for piece in rest)
    assert assembly.tensor().array.tolist() == array.tolist()


def test_element_limit_holds_before_anything_is_allocated() -> None:
    with pytest.raises(WireError, match="over this stage's limit of 999"):
        read(_piece_msg(), 999)


def test_pieces_twice_or_of_another_tensor_do_not_fit() -> None:
    messages = [through_wire(m) for m in build(FORWARD, 0, 0, 0, 0, 1, sparse(), "float32", 0, False, 1024)]
    assembly = Assembly(read(messages[0], 1 << 20))
    assert assembly.add(read(messages[0], 1 << 20)) == "it came twice"
    other = through_wire(build(FORWARD, 0, 0, 0, 0, 1, sparse(2000), "float32", 0, False, 1024)[1])
    assert "otherwise than an earlier piece" in str(assembly.add(read(other, 1 << 20)))
    assert not assembly.complete()


def test_a_corrupted_zvc_frame_fails_when_decoded() -> None:
    msg = _piece_msg()
    frame = bytearray(msg.payload)
    frame[zvc.HEADER_BYTES] ^= 0xFF  # the mask no longer counts the values that follow
    msg.payload = memoryview(bytes(frame))
    assembly = Assembly(read(msg, 1 << 20))
    with pytest.raises(WireError):
        assembly.tensor()


def test_a_zvc_frame_of_another_dtype_fails_when_decoded() -> None:
    frame = zvc.encode(sparse().astype(np.float16))
    msg = _piece_msg()
    _meta(size=len(frame))(msg)
    msg.payload, msg.shape = memoryview(bytes(frame)), (len(frame),)
    assembly = Assembly(read(msg, 1 << 20))
    with pytest.raises(WireError, match="holds 1000 float16, its message says"):
        assembly.tensor()


# ---------------------------------------------------------------------------- the exchange
def exchange(rank: int, size: int = 3, stages: int = 3, **kw: Any) -> tuple[StageExchange, Recorder]:
    wire = Recorder()
    hosts = kw.pop("hosts", ["h0"] * size)
    kw.setdefault("direct", False)  # the transport's path; direct lanes: tests/unit/test_lanes.py
    ex = StageExchange(wire, StagePlace(rank, size, stages), Neighbours(NAMES[:size], hosts),  # type: ignore[arg-type]
                       kw.pop("timeout", 5.0), lambda priority: priority, **kw)
    return ex, wire


def deliver(target: StageExchange, source: Recorder, peer: str | None = None) -> None:
    for _, _, msg in source.sent:
        target.on_message(peer or f"worker-{msg.sender}", through_wire(msg))
    source.sent.clear()


def test_activations_forward_and_gradients_back() -> None:
    first, wire0 = exchange(0)
    middle, wire1 = exchange(1)
    for ex in (first, middle):
        ex.begin(0, 2)
    first.send(FORWARD, 0, 1, [(sparse(64), "float32"), (np.arange(3, dtype=np.int64), "int64")], 1)
    assert [(peer, channel) for peer, channel, _ in wire0.sent] == [("worker-1", 1)] * 2
    deliver(middle, wire0)
    got = middle.receive(FORWARD, 0, 1)
    assert [g.dtype for g in got] == ["float32", "int64"] and np.array_equal(got[0].array, sparse(64))
    middle.send(BACKWARD, 0, 1, [(np.ones(64, np.float32), "float32")], 0)
    assert wire1.sent[0][0] == "worker-0"
    deliver(first, wire1)
    assert np.array_equal(first.receive(BACKWARD, 0, 1)[0].array, np.ones(64, np.float32))
    assert wire0.refused == wire1.refused == []


def test_auto_compresses_only_towards_another_host() -> None:
    same, _ = exchange(1, hosts=["a", "a", "a"])
    assert not same.compression[FORWARD].enabled and not same.compression[BACKWARD].enabled
    split, _ = exchange(1, hosts=["a", "a", "b"])
    assert split.compression[FORWARD].enabled and not split.compression[BACKWARD].enabled
    forced, _ = exchange(1, compress="on")
    assert forced.compression[FORWARD].enabled and forced.compression[BACKWARD].enabled


def _forward(step: int, micro: int, slot: int = 0, of: int = 1, sender: int = 0, n: int = 8) -> Message:
    (msg,) = build(FORWARD, sender, step, micro, slot, of, np.ones(n, np.float32), "float32", 1, False, 1 << 20)
    return through_wire(msg)


@pytest.mark.parametrize(("peer", "msg", "problem"), [
    ("worker-2", _forward(0, 0), "come only from worker 0"),
    ("worker-0", _forward(0, 0, sender=2), "come only from worker 0"),
    ("worker-0", through_wire(build(BACKWARD, 0, 0, 0, 0, 1, np.ones(2, np.float32), "float32", 0, False, 64)[0]),
     "come only from worker 2"),
    ("worker-0", _forward(2, 0), "step 2 is neither this stage's step 0 nor the next"),
    ("worker-0", _forward(0, 4), "micro-batch 4 is beyond the step's 4"),
    ("worker-0", Message(Kind.STAGE_FORWARD, sender=0, meta={"of": 1}), "meta must have exactly"),
    ("worker-0", Message(Kind.GROUP_DATA, sender=0), "this stage has no replicas"),
])
def test_the_exchange_refuses_what_does_not_fit(peer: str, msg: Message, problem: str) -> None:
    middle, wire = exchange(1)
    middle.begin(0, 4)
    middle.on_message(peer, msg)
    assert len(wire.refused) == 1 and problem in wire.refused[0], wire.refused


def test_duplicates_old_steps_and_the_held_bytes_limit() -> None:
    middle, wire = exchange(1, max_held_bytes=2 * OVERHEAD_BYTES + 100)
    middle.begin(3, 4)
    middle.on_message("worker-0", _forward(3, 0, of=2))
    middle.on_message("worker-0", _forward(3, 0, of=2))  # the same slot again
    middle.on_message("worker-0", _forward(3, 0, slot=1, of=3))  # disagrees on the count
    middle.on_message("worker-0", _forward(4, 0, n=32))  # the next step, but over the limit (32 + 128 > 100)
    middle.on_message("worker-0", _forward(2, 0))  # an older step
    full = f"already holds {OVERHEAD_BYTES + 32} bytes (limit {2 * OVERHEAD_BYTES + 100})"
    expected = ["came twice", "an earlier one said 2", full, "step 2 is neither"]
    assert [want in got for want, got in zip(expected, wire.refused, strict=True)] == [True] * 4
    middle.on_message("worker-0", _forward(3, 0, slot=1, of=2))
    assert len(middle.receive(FORWARD, 3, 0)) == 2
    middle.on_message("worker-0", _forward(3, 0, slot=1, of=2))  # taken already
    assert "came twice" in wire.refused[-1]


def test_a_next_step_message_waits_for_its_step() -> None:
    middle, wire = exchange(1)
    middle.begin(0, 1)
    middle.on_message("worker-0", _forward(1, 3))  # the next step may have more micro-batches
    middle.begin(1, 4)
    assert middle.receive(FORWARD, 1, 3)[0].array.shape == (8,) and not wire.refused


def test_the_deadline_names_the_stage_and_worker_waited_for() -> None:
    last, _ = exchange(2, timeout=0.2, hosts=["h0", "h1", "h2"])
    last.begin(5, 2)
    started = time.monotonic()
    with pytest.raises(SluiceError) as caught:
        last.receive(FORWARD, 5, 1)
    assert 0.2 <= time.monotonic() - started < 2
    text = str(caught.value)
    assert text.startswith("stage 2 (worker 2 on h2) waited for the activations of micro-batch 1 of step 5 from "
                           "stage 1 (worker 1 on h1): not complete after 0.2 s (nothing came)"), text
    assert "raise scheduler.op_timeout" in text


def test_the_jobs_failure_ends_a_wait_at_once() -> None:
    first, _ = exchange(0)
    first.begin(0, 1)
    threading.Timer(0.1, first.fail, ["worker 2 was lost"]).start()
    started = time.monotonic()
    with pytest.raises(SluiceError, match="the job failed: worker 2 was lost"):
        first.receive(BACKWARD, 0, 0)
    assert time.monotonic() - started < 1.5


def test_first_and_last_stages_refuse_what_they_cannot_do() -> None:
    first, _ = exchange(0)
    with pytest.raises(SluiceError, match="stage 0 receives no activations"):
        first.receive(FORWARD, 0, 0)
    with pytest.raises(SluiceError, match="stage 0 has no stage to send gradients to"):
        first.send(BACKWARD, 0, 0, [], 0)


def test_a_tensor_that_does_not_decode_fails_the_receive_at_once() -> None:
    middle, wire = exchange(1, timeout=30)
    middle.begin(0, 1)
    msg = _piece_msg()
    frame = bytearray(msg.payload)
    frame[zvc.HEADER_BYTES] ^= 0xFF
    msg.payload = memoryview(bytes(frame))
    middle.on_message("worker-0", msg)
    started = time.monotonic()
    with pytest.raises(SluiceError, match="a tensor of it is malformed: tensor 0: "):
        middle.receive(FORWARD, 0, 0)
    assert time.monotonic() - started < 1 and len(wire.refused) == 1


def test_pieces_of_one_tensor_assemble_in_any_order() -> None:
    middle, wire = exchange(1)
    middle.begin(0, 1)
    array = sparse(3000)
    for msg in reversed(build(FORWARD, 0, 0, 0, 0, 1, array, "float32", 1, True, 256)):
        middle.on_message("worker-0", through_wire(msg))
    (got,) = middle.receive(FORWARD, 0, 0)
    assert np.array_equal(got.array, array) and not wire.refused


def test_a_timed_out_wait_says_what_was_refused_from_the_stage_it_waits_for() -> None:
    middle, _ = exchange(1, timeout=0.2)
    middle.begin(0, 1)
    middle.on_message("worker-0", _forward(0, 3))
    with pytest.raises(SluiceError, match=r"\(nothing came; 1 of its messages were refused, the last as: micro-batch 3 "
                                          r"is beyond the step's 1\); stage 0 \(worker 0 on h0\) is slow"):
        middle.receive(FORWARD, 0, 0)
