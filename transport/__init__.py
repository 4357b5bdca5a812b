"""pipeloom.transport: the tensor plane (torch.distributed p2p) and the control plane (ZeroMQ + msgpack)."""

from __future__ import annotations

from .control import ControlPlane, choose_bind_host
from .messages import PROTOCOL_VERSION, MessageError, decode, encode
from .tensor import TensorPlane

__all__ = [
    "PROTOCOL_VERSION",
    "ControlPlane",
    "MessageError",
    "TensorPlane",
    "choose_bind_host",
    "decode",
    "encode",
]
