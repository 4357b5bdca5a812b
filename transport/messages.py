"""Control-plane messages: msgpack maps, versioned and validated on arrival.

Everything that comes off a socket is untrusted input: a stray process, a
rank from another job, a truncated frame or a newer pipeloom may all send
bytes.  So decoding is bounded (``max_*_len``), map keys must be strings, no
extension types are accepted (so nothing is ever unpickled), every message
carries the protocol version, and each message type has a fixed schema that is
checked field by field.  A message that fails any check raises
:class:`MessageError` with the reason; the receiver logs it and carries on.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

import msgpack

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_MESSAGE_BYTES",
    "MessageError",
    "encode",
    "decode",
    "SCHEMAS",
    "DTYPE_NAMES",
    "MAC_BYTES",
    "sign",
    "verify",
]

MAC_BYTES = 16  #: truncated HMAC-SHA256 in front of every frame

PROTOCOL_VERSION = 3  # 2: xfer carries 'last'; 'bye'.  ('hello', never sent by any version, is gone.)  3: heartbeat carries 'stall_s'
MAX_MESSAGE_BYTES = 1 << 20  #: larger frames are rejected before decoding

_MAX_TENSORS = 256
_MAX_DIMS = 16
#: dtypes a transfer may announce (torch's names without the ``torch.`` prefix)
DTYPE_NAMES = frozenset(
    {"float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool", "complex64", "complex128"}
)


class MessageError(ValueError):
    """A control message that was rejected; the text says why."""


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _nonneg(v: Any) -> bool:
    return _int(v) and v >= 0


def _str(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= 64 * 1024


def _opt_int(v: Any) -> bool:
    return v is None or _int(v)


def _tensor_specs(v: Any) -> bool:
    """A list of [shape, dtype, requires_grad] or None (an absent tensor, e.g. a None gradient)."""
    if not isinstance(v, list) or len(v) > _MAX_TENSORS:
        return False
    for spec in v:
        if spec is None:
            continue
        if not (isinstance(spec, list) and len(spec) == 3):
            return False
        shape, dtype, rg = spec
        if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(_nonneg(d) for d in shape)):
            return False
        if not (dtype in DTYPE_NAMES and isinstance(rg, bool)):
            return False
    return True


# type -> {field: validator}.  ``src`` (the sending rank) is common to all.
SCHEMAS: dict[str, dict[str, Any]] = {
    # A tensor transfer: the receiver posts its receives in ``seq`` order per peer.
    "xfer": {
        "seq": _nonneg,
        "step": _nonneg,
        "stage": _nonneg,  # the stage that consumes the payload
        "mb": _nonneg,
        "kind": lambda v: v in ("F", "B"),
        "tensors": _tensor_specs,
        "fast": lambda v: isinstance(v, bool),  # sent into the receives pre-posted for this seq
        "last": lambda v: isinstance(v, bool),  # the sender's last transfer to this rank in this step
    },
    # ``state``: idle / busy / waiting, ``what``: the action (or what is awaited), ``for_s``: since how long,
    # ``stall_s``: how long the sender allows one action of its current step to run (its stall budget)
    "heartbeat": {
        "step": _nonneg,
        "t": lambda v: isinstance(v, float),
        "state": lambda v: v in ("idle", "busy", "waiting"),
        "what": _str,
        "for_s": lambda v: isinstance(v, float) and v >= 0,
        "stall_s": lambda v: isinstance(v, float) and v > 0,
    },
    # the sender's Pipeline closed cleanly: its control connection closing next is no failure
    "bye": {"steps": _nonneg},  # steps this rank completed
    "abort": {
        "step": _nonneg,
        "stage": _opt_int,
        "mb": _opt_int,
        "action": lambda v: v is None or _str(v),
        "error": _str,
        "traceback": _str,
    },
}


def sign(key: bytes, payload: bytes) -> bytes:
    """Prefix ``payload`` with its MAC under the job's secret."""
    return hmac.new(key, payload, hashlib.sha256).digest()[:MAC_BYTES] + payload


def verify(key: bytes, frame: bytes) -> bytes:
    """The payload of a signed frame; MessageError if the MAC does not match.

    A process outside the job does not know the secret, so it can neither
    join the control plane nor inject announcements or aborts.
    """
    if len(frame) < MAC_BYTES:
        raise MessageError(f"frame of {len(frame)} bytes is too short to carry a signature")
    mac, payload = frame[:MAC_BYTES], frame[MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(key, payload, hashlib.sha256).digest()[:MAC_BYTES]):
        raise MessageError("bad signature: the sender does not hold this job's secret")
    return payload


def encode(msg_type: str, src: int, /, **fields: Any) -> bytes:
    """Encode a message of type ``msg_type`` from rank ``src`` (validated on the way out too)."""
    msg = {"v": PROTOCOL_VERSION, "type": msg_type, "src": src, **fields}
    _validate(msg)
    return msgpack.packb(msg, use_bin_type=True)


def decode(data: bytes, *, world_size: int | None = None, rank: int | None = None) -> dict[str, Any]:
    """Decode and validate one frame; raise :class:`MessageError` saying what was wrong."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        msg = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=MAX_MESSAGE_BYTES,
            max_bin_len=0,
            max_array_len=4096,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise MessageError(f"undecodable message ({type(exc).__name__}: {exc})") from None
    _validate(msg, world_size=world_size)
    if rank is not None and msg["src"] == rank:
        raise MessageError(f"{msg['type']}: claims to come from this rank ({rank}) itself")
    return msg


def _validate(msg: Any, *, world_size: int | None = None) -> None:
    if not isinstance(msg, Mapping):
        raise MessageError(f"a message must be a map, got {type(msg).__name__}")
    version = msg.get("v")
    if version != PROTOCOL_VERSION:
        raise MessageError(f"unsupported protocol version {version!r} (this rank speaks {PROTOCOL_VERSION})")
    kind = msg.get("type")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise MessageError(f"unknown message type {kind!r}; known: {', '.join(SCHEMAS)}")
    src = msg.get("src")
    if not _nonneg(src) or (world_size is not None and int(src) >= world_size):  # type: ignore[arg-type]
        raise MessageError(f"{kind}: bad sender rank {src!r}")
    for name, check in schema.items():
        if name not in msg:
            raise MessageError(f"{kind} from rank {src}: missing field {name!r}")
        if not check(msg[name]):
            raise MessageError(f"{kind} from rank {src}: bad value for field {name!r}: {msg[name]!r:.200}")
    extra = set(msg) - set(schema) - {"v", "type", "src"}
    if extra:
        raise MessageError(f"{kind} from rank {src}: unexpected fields {sorted(extra)}")
