"""The control-message decoder against hostile input: nothing crashes, every rejection says why."""

from __future__ import annotations

import random

import msgpack
import pytest

from pipeloom.transport.messages import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, MessageError, decode, encode

GOOD = dict(seq=3, step=1, stage=2, mb=0, kind="F", tensors=[[[4, 8], "float32", True], None], fast=False, last=False)


def test_round_trip() -> None:
    msg = decode(encode("xfer", 1, **GOOD), world_size=4, rank=0)
    assert msg["type"] == "xfer" and msg["src"] == 1 and msg["v"] == PROTOCOL_VERSION
    assert msg["tensors"] == [[[4, 8], "float32", True], None]


def test_encode_refuses_what_decode_would_reject() -> None:
    with pytest.raises(MessageError, match="field 'kind'"):
        encode("xfer", 0, **{**GOOD, "kind": "X"})


@pytest.mark.parametrize(
    "mutation, reason",
    [
        ({"v": PROTOCOL_VERSION + 1}, "protocol version"),
        ({"type": "launch_missiles"}, "unknown message type"),
        ({"type": "hello"}, "unknown message type"),  # a schema nothing ever sent: removed
        ({"src": -1}, "sender rank"),
        ({"src": 9}, "sender rank"),
        ({"src": 0}, "this rank"),
        ({"seq": "3"}, "field 'seq'"),
        ({"seq": True}, "field 'seq'"),
        ({"mb": -1}, "field 'mb'"),
        ({"tensors": [[[4, -8], "float32", True]]}, "field 'tensors'"),
        ({"tensors": [[[4], "object", True]]}, "field 'tensors'"),
        ({"tensors": [[[1]] * 20, "float32", True]}, "field 'tensors'"),
        ({"tensors": [[[4], "float32"]]}, "field 'tensors'"),
        ({"extra": 1}, "unexpected fields"),
    ],
)
def test_each_bad_field_is_named(mutation: dict, reason: str) -> None:
    msg = {"v": PROTOCOL_VERSION, "type": "xfer", "src": 1, **GOOD, **mutation}
    with pytest.raises(MessageError, match=reason):
        decode(msgpack.packb(msg), world_size=4, rank=0)


def test_missing_field() -> None:
    msg = {"v": PROTOCOL_VERSION, "type": "xfer", "src": 1, **GOOD}
    del msg["seq"]
    with pytest.raises(MessageError, match="missing field 'seq'"):
        decode(msgpack.packb(msg), world_size=4)


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "undecodable"),
        (b"\xc1", "undecodable"),
        (msgpack.packb([1, 2]), "must be a map"),
        (msgpack.packb({1: 2}), "undecodable"),  # strict_map_key: non-string keys
        (msgpack.packb({"v": 1, "type": "xfer", "src": 1, "blob": b"\x00" * 10}), "undecodable"),  # no binary payloads
        (msgpack.packb(msgpack.ExtType(1, b"x")), "undecodable"),  # no extension types, so nothing is unpickled
        (b"\x00" * (MAX_MESSAGE_BYTES + 1), "exceeds"),
    ],
)
def test_malformed_frames(data: bytes, reason: str) -> None:
    with pytest.raises(MessageError, match=reason):
        decode(data, world_size=4)


def test_fuzz_random_and_truncated_frames_never_escape_as_other_errors() -> None:
    rng = random.Random(1234)
    valid = encode("xfer", 1, **GOOD)
    frames = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200))) for _ in range(3000)]
    frames += [valid[:k] for k in range(len(valid))]
    frames += [bytes(b ^ (1 << rng.randrange(8)) if rng.random() < 0.05 else b for b in valid) for _ in range(2000)]
    accepted = 0
    for f in frames:
        try:
            msg = decode(f, world_size=4, rank=0)
        except MessageError as exc:
            assert str(exc)
        else:
            accepted += 1
            assert msg["v"] == PROTOCOL_VERSION and msg["type"] == "xfer"
    assert accepted < len(frames)
