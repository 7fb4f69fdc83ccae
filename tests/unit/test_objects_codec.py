"""The object codec of broadcast_object and allgather_object (worker/objects_codec.py): msgpack, never pickle."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from sluice.worker.objects_codec import Codec, TensorType


class Box:
    """A stand-in for a framework's tensor type: a float64 vector."""

    def __init__(self, values: list[float]) -> None:
        self.values = values


def _encode(box: Box) -> tuple[str, list[int], bytes]:
    return "float64", [len(box.values)], np.array(box.values).tobytes()


def _decode(name: str, shape: list[int], raw: bytes) -> Box:
    if name != "float64":
        raise ValueError(f"dtype {name!r} is not allowed")
    return Box(np.frombuffer(raw, np.float64).reshape(shape).tolist())


CODEC = Codec([TensorType(9, (Box,), "boxes", _encode, _decode)])


def test_plain_values_tuples_and_arrays_round_trip() -> None:
    obj = {"a": [1, 2.5, None, True, "x", b"\x00"], 3: (1, (2, "y")),
           "array": np.arange(6, dtype=np.int16).reshape(2, 3), "scalar": np.float32(0.5)}
    got = Codec().loads(Codec().dumps(obj))
    assert got["a"] == [1, 2.5, None, True, "x", b"\x00"] and got[3] == (1, (2, "y")) and got["scalar"] == 0.5
    assert got["array"].dtype == np.int16 and got["array"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert got["array"].flags.writeable  # a copy, not a view of the message


def test_a_frameworks_tensors_travel_as_its_extension() -> None:
    got = CODEC.loads(CODEC.dumps({"box": Box([1.0, 2.0])}))
    assert isinstance(got["box"], Box) and got["box"].values == [1.0, 2.0]
    with pytest.raises(ValueError, match="unknown extension type 9"):  # a codec without the type refuses it
        Codec().loads(CODEC.dumps(Box([1.0])))


@pytest.mark.parametrize("obj", [{1, 2}, object(), lambda: 0, np.array(["a"]), Box])
def test_what_the_format_cannot_carry_is_refused_at_the_sender_naming_what_can(obj: object) -> None:
    with pytest.raises(TypeError, match=r"cannot be sent without pickle; use None, bool, .* numpy arrays and boxes"):
        CODEC.dumps(obj)


@pytest.mark.parametrize("data", [
    b"\xc1",  # a byte msgpack never writes
    msgpack.packb(msgpack.ExtType(2, msgpack.packb(["object", [1], b"x"]))),  # a dtype not on the list
    msgpack.packb(msgpack.ExtType(2, msgpack.packb(["float64", [2], b"x"]))),  # bytes that do not fill the shape
    msgpack.packb(msgpack.ExtType(2, msgpack.packb(["float64", [-1], b""]))),
    msgpack.packb(msgpack.ExtType(1, msgpack.packb(5))),  # a tuple that holds no list
    msgpack.packb(msgpack.ExtType(9, msgpack.packb(["int8", [1], b"x"]))),  # the framework's decoder refuses it
    msgpack.packb(1) + msgpack.packb(2),  # extra data
])
def test_bytes_that_dumps_did_not_write_raise_value_error(data: bytes) -> None:
    with pytest.raises(ValueError, match="not an object sent by broadcast_object/allgather_object"):
        CODEC.loads(data)
