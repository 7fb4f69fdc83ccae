"""Settings of the transport layer: channels per peer pair, chunking, in-flight bound, packet marks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sluice.transport.tcp_tuning import check_congestion_control


@dataclass(frozen=True)
class TransportConfig:
    #: channels per peer pair; channel 0 carries the most urgent priorities
    channels: int = 3
    #: the highest priority (0 = most urgent) each channel but the last carries, e.g. [3, 20]: channel 0
    #: carries priorities 0-3, channel 1 4-20, channel 2 the rest; empty: even bands over the tensors
    channel_levels: tuple[int, ...] = field(default_factory=tuple)
    #: a tensor of more bytes rides the last channel whatever its priority (0: by priority alone), so that one
    #: TCP connection per peer carries the bulk and keeps its rate: a connection that takes over the bulk from
    #: another starts below the link's rate (under BBR, 45-78% of it for 50-150 ms; docs/priority.md)
    bulk_bytes: int = 4 << 20
    #: tensors are cut into chunks of at most this many bytes; 0: chosen by a calibration at start
    chunk_bytes: int = 0
    #: per channel and peer, at most this many payload bytes are sent but not yet acknowledged;
    #: 0: chosen by a calibration at start
    inflight_bytes: int = 0
    #: a queued message that has waited this long is sent before any newer one, whatever its
    #: priority (the aging bound that keeps bulk traffic from starving)
    aging_ms: float = 1000.0
    #: mark each channel's packets (IP ToS/DSCP) so Linux qdiscs and switches can prioritise them;
    #: the default marks put channel 0, 1, 2 in pfifo_fast bands 0, 1, 2 (see docs/priority.md)
    marks: bool = True
    #: IP ToS byte per channel, overriding the default marks; e.g. [0x90, 0x00, 0x28]
    tos: tuple[int, ...] = field(default_factory=tuple)
    #: Linux SO_PRIORITY per channel; needs a libzmq with its draft option ZMQ_PRIORITY (pyzmq's 4.3.5
    #: lacks it: then this is refused at start, and Linux derives each socket's priority from its ToS)
    so_priority: tuple[int, ...] = field(default_factory=tuple)
    #: "tcp" or "ipc"
    protocol: str = "tcp"
    #: address that listening channels bind to
    host: str = "127.0.0.1"
    #: "zmq" is the only backend today; the name picks the Transport implementation
    backend: str = "zmq"
    #: payloads to peers on this host travel through shared memory (/dev/shm) instead of sockets
    shm: bool = True
    #: authenticate every connection (CURVE keys derived from the job's secret; tickets on this host's Unix
    #: sockets) and encrypt those between hosts;
    #: false: anyone who can reach the ports can join, read and forge (only on a network you trust)
    curve: bool = True
    #: with curve on, the cipher of data connections between hosts: "aes-gcm" seals each message in the
    #: sending and receiving process (AES-256-GCM, keys per connection; a third of CURVE's CPU a byte), proving
    #: each connection with a ticket bound to the address it comes from; "curve" runs CURVE on them, for
    #: networks that translate addresses between hosts (docs/security.md). The scheduler's always run CURVE
    cipher: str = "aes-gcm"
    #: ZeroMQ I/O threads per process: they move every byte on the sockets, and encrypt and decrypt it with
    #: CURVE (about 1 GB/s each); with 2 or more, channel 0 has one to itself and the others share the rest
    io_threads: int = 1
    #: the TCP congestion control of this job's connections (e.g. "cubic"), set on each as it opens; empty: the
    #: host's default (net.ipv4.tcp_congestion_control). Under BBR a parameter server's bursts of rounds keep its
    #: links at 85% of their rate, under cubic 91-94% (docs/priority.md)
    congestion_control: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.channels <= 8:
            raise ValueError(f"transport.channels must be 1..8, got {self.channels}")
        if self.cipher not in ("aes-gcm", "curve"):
            raise ValueError(f"transport.cipher must be aes-gcm or curve, got {self.cipher!r:.40}")
        if not 1 <= self.io_threads <= 16:
            raise ValueError(f"transport.io_threads must be 1..16, got {self.io_threads}")
        if self.chunk_bytes and self.chunk_bytes < 4096:
            raise ValueError(f"transport.chunk_bytes must be 0 (calibrate) or at least 4096, got {self.chunk_bytes}")
        if self.bulk_bytes < 0:
            raise ValueError(f"transport.bulk_bytes must be 0 (off) or positive, got {self.bulk_bytes}")
        if self.inflight_bytes < 0:
            raise ValueError(f"transport.inflight_bytes must be 0 (calibrate) or positive, got {self.inflight_bytes}")
        if self.aging_ms <= 0:
            raise ValueError(f"transport.aging_ms must be positive, got {self.aging_ms}")
        if self.channel_levels and len(self.channel_levels) != self.channels - 1:
            raise ValueError(
                f"transport.channel_levels needs one value per channel but the last ({self.channels - 1}), "
                f"got {list(self.channel_levels)}"
            )
        if any(b <= a for a, b in zip(self.channel_levels, self.channel_levels[1:], strict=False)) or any(
            level < 0 for level in self.channel_levels
        ):
            raise ValueError(f"transport.channel_levels must rise and be non-negative, got {list(self.channel_levels)}")
        if self.so_priority and len(self.so_priority) != self.channels:
            raise ValueError(f"transport.so_priority needs one value per channel ({self.channels}), "
                             f"got {list(self.so_priority)}")
        if self.so_priority:
            check_so_priority()
        if self.tos and len(self.tos) != self.channels:
            raise ValueError(f"transport.tos needs one value per channel ({self.channels}), got {self.tos}")
        if any(not 0 <= t <= 255 for t in self.tos):
            raise ValueError(f"transport.tos values must be bytes 0..255, got {self.tos}")
        if self.protocol not in ("tcp", "ipc"):
            raise ValueError(f"transport.protocol must be 'tcp' or 'ipc', got {self.protocol!r}")
        if self.congestion_control:
            check_congestion_control(self.congestion_control)
        if self.backend != "zmq":
            raise ValueError(f"transport.backend {self.backend!r} is unknown; the available one is 'zmq'")

    def channel_for(self, priority: int, levels: int, nbytes: int = 0) -> int:
        """Channel carrying a tensor of `priority` (0 most urgent) and `nbytes`, of `levels` priorities: the last
        if it is bulk (more than `bulk_bytes`) and there is more than one priority (with one, every chunk is
        first come, first served), else by `channel_levels`, else in even bands of `levels`."""
        if self.bulk_bytes and nbytes > self.bulk_bytes and levels > 1:
            return self.channels - 1
        if self.channel_levels:
            return next((c for c, top in enumerate(self.channel_levels) if priority <= top), self.channels - 1)
        if levels <= 0:
            return 0
        return min(self.channels - 1, max(priority, 0) * self.channels // levels)

    def channel_tos(self) -> tuple[int, ...]:
        """The ToS byte of each channel (empty: packets are not marked)."""
        if self.tos:
            return self.tos
        if not self.marks:
            return ()
        return tuple(default_tos(channel, self.channels) for channel in range(self.channels))

    @property
    def chunk_limit(self) -> int:
        """The chunk size in force before a calibration (or when none runs)."""
        return self.chunk_bytes or DEFAULT_CHUNK_BYTES

    @property
    def inflight_limit(self) -> int:
        return self.inflight_bytes or DEFAULT_INFLIGHT_BYTES

    @property
    def largest_payload(self) -> int:
        """No legal payload frame of this job is larger: a chunk (as configured, or the calibration's
        largest candidate, a local one's). Larger frames are refused by ZeroMQ before they are received."""
        return max(self.chunk_bytes, LOCAL_MAX_CHUNK_BYTES)


#: endpoints of peers on this host (shared memory serves them)
LOCAL_ENDPOINTS = ("tcp://127.", "tcp://localhost:", "tcp://[::1]:", "ipc://")
#: listening on every address: the host's own address is then not known from the setting
_ANY_ADDRESS = ("", "*", "0.0.0.0", "::")


def on_this_host(endpoints: Sequence[str], own_host: str) -> bool:
    """Whether a peer listening on `endpoints` runs on this machine, whose processes listen on `own_host`: on
    the loopback, or on this host's own address (the workers of one host of a multi-host job)."""
    own = () if own_host in _ANY_ADDRESS else (f"tcp://[{own_host}]:" if ":" in own_host else f"tcp://{own_host}:",)
    return bool(endpoints) and all(e.startswith(LOCAL_ENDPOINTS + own) for e in endpoints)

#: used until a calibration has chosen (1 MiB chunks; ByteScheduler's credit of 4 M float32 parameters)
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_INFLIGHT_BYTES = 16 << 20
#: the largest chunk a calibration may choose (scheduler/calibration.py)
MAX_CHUNK_BYTES = 1 << 20
#: the same between a worker and servers that all share its memory, where a chunk is a descriptor on the wire
LOCAL_MAX_CHUNK_BYTES = 4 << 20

#: Linux maps a socket's ToS to a priority and pfifo_fast maps that to a band (0 first). These marks
#: land in bands 0, 1 and 2 and are also DSCP classes: AF42 (0x90), best effort (0x00), AF11 (0x28).
URGENT_TOS, NORMAL_TOS, BULK_TOS = 0x90, 0x00, 0x28


def default_tos(channel: int, channels: int) -> int:
    """Channel 0 urgent, the last channel bulk (when there are 3 or more), the others best effort."""
    if channels == 1:
        return NORMAL_TOS
    if channel == 0:
        return URGENT_TOS
    if channel == channels - 1 and channels >= 3:
        return BULK_TOS
    return NORMAL_TOS if channels >= 3 else BULK_TOS


def check_so_priority() -> None:
    """Refuse, saying what to do, when this libzmq cannot set SO_PRIORITY (a draft option in 4.3)."""
    import zmq  # here, not at the top: the config is read by processes that never open a socket

    probe: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    try:
        probe.setsockopt(zmq.PRIORITY, 0)
    except (zmq.ZMQError, AttributeError):
        raise ValueError(
            f"transport.so_priority is set, but this libzmq ({zmq.zmq_version()}) was built without its draft "
            "option ZMQ_PRIORITY, so SO_PRIORITY cannot be set per channel. Remove transport.so_priority: "
            "Linux derives each socket's priority from its ToS mark (transport.tos / transport.marks)."
        ) from None
    finally:
        probe.close(linger=0)
