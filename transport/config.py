"""Settings of the transport layer: channels per peer pair, chunking, in-flight bound, packet marks."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TransportConfig:
    #: channels per peer pair; channel 0 carries the most urgent priorities
    channels: int = 3
    #: tensors are cut into chunks of at most this many bytes
    chunk_bytes: int = 1 << 20
    #: per channel and peer, at most this many payload bytes are sent but not yet acknowledged
    #: (ByteScheduler's default credit: 4 M float32 parameters)
    inflight_bytes: int = 16 << 20
    #: IP ToS byte per channel (empty: no marking); e.g. (0xb8, 0x28, 0x00)
    tos: tuple[int, ...] = field(default_factory=tuple)
    #: "tcp" or "ipc"
    protocol: str = "tcp"
    #: address that listening channels bind to
    host: str = "127.0.0.1"
    #: "zmq" is the only backend today; the name picks the Transport implementation
    backend: str = "zmq"
    #: payloads to peers on this host travel through shared memory (/dev/shm) instead of sockets
    shm: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.channels <= 8:
            raise ValueError(f"transport.channels must be 1..8, got {self.channels}")
        if self.chunk_bytes < 4096:
            raise ValueError(f"transport.chunk_bytes must be at least 4096, got {self.chunk_bytes}")
        if self.inflight_bytes < 1:
            raise ValueError(f"transport.inflight_bytes must be positive, got {self.inflight_bytes}")
        if self.tos and len(self.tos) != self.channels:
            raise ValueError(f"transport.tos needs one value per channel ({self.channels}), got {self.tos}")
        if any(not 0 <= t <= 255 for t in self.tos):
            raise ValueError(f"transport.tos values must be bytes 0..255, got {self.tos}")
        if self.protocol not in ("tcp", "ipc"):
            raise ValueError(f"transport.protocol must be 'tcp' or 'ipc', got {self.protocol!r}")
        if self.backend != "zmq":
            raise ValueError(f"transport.backend {self.backend!r} is unknown; the available one is 'zmq'")

    def channel_for(self, priority: int, levels: int) -> int:
        """Channel carrying `priority` out of `levels` priorities (0 most urgent), in even bands."""
        if levels <= 0:
            return 0
        return min(self.channels - 1, priority * self.channels // levels)
