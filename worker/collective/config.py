"""Settings of the collective engine: the coordinator tree, allreduce algorithms, fusion and hybrid routing."""

from __future__ import annotations

from dataclasses import dataclass, field

ALGORITHMS = ("auto", "ring", "tree")
FUSIONS = ("balanced", "greedy")
MODES = ("auto", "ps", "allreduce")
LOCAL_GROUPS = ("auto", "torch", "sluice")


@dataclass(frozen=True)
class CollectiveConfig:
    #: fan-out of the coordinator tree (each controller hears from at most this many children);
    #: 0: a flat coordinator, every rank reporting to rank 0 (Horovod's shape)
    arity: int = 4
    #: the coordinator batches requests and ready bits for this many milliseconds per cycle
    cycle_ms: float = 1.0
    #: an operation some ranks submitted and others did not fails after this many seconds, naming
    #: the ranks that did not submit it (Horovod only warns)
    stall_timeout: float = 60.0
    #: "ring" (reduce-scatter then allgather), "tree" (reduce up the coordinator tree, then down), or
    #: "auto": the tree below tree_below_bytes (fewer hops), the ring above (least bytes per link)
    algorithm: str = "auto"
    #: with algorithm "auto", tensors smaller than this many bytes use the tree
    tree_below_bytes: int = 4 << 20
    #: allreduces of at most this many bytes carry their data up the coordinator tree with their request,
    #: and get their result down with the decision: two hops instead of four (0: never; carry.py; not
    #: with fusion = "greedy", Horovod's way)
    carry_bytes: int = 256 << 10
    #: the coordinator's messages between workers on one host go over direct lanes (Unix sockets its own threads
    #: write and read: two thread wake-ups a hop instead of five) rather than through the transport
    lanes: bool = True
    #: gradients of one dtype are laid out in one registered buffer, cut into equal groups of at most
    #: this many bytes, each sent as one message stream (0: no fusion, each gradient alone)
    fusion_bytes: int = 16 << 20
    #: "balanced": groups planned once from the sizes and backward order, sent with no copy (seed 004);
    #: "greedy": Horovod's way, for comparison: each gradient negotiated alone, and what one cycle
    #: decides copied into fusion buffers of up to fusion_bytes (allreduce only)
    fusion: str = "balanced"
    #: where each gradient goes: "ps" (the servers), "allreduce", or "auto" (see docs/collective.md);
    #: a job with no servers uses allreduce whatever this says
    mode: str = "auto"
    #: shell-style name patterns of gradients that go through allreduce, whatever `mode` says
    allreduce_patterns: tuple[str, ...] = field(default_factory=tuple)
    #: shell-style name patterns of gradients that go through the servers, whatever `mode` says
    ps_patterns: tuple[str, ...] = field(default_factory=tuple)
    #: fused gradients summed inside each host first, each local rank's share alone crossing the hosts, then
    #: gathered inside the host (BytePS's hierarchy: worker/hierarchy.py); where every host runs as many
    #: workers, more than one, on more than one host
    hierarchical: bool = True
    #: what sums a fused group inside the host and where torch gradients wait meanwhile: "auto" (CUDA gradients
    #: stay on the device, summed by an NCCL group of the host's workers, only each one's share copied to the
    #: host; CPU ones by Sluice's shared memory, measured faster than gloo), "torch" (CPU gradients too by
    #: torch's group, gloo), "sluice" (every gradient staged in host memory, summed by Sluice's shared memory)
    local_group: str = "auto"

    def __post_init__(self) -> None:
        if self.arity < 0 or self.arity == 1:
            raise ValueError(f"collective.arity must be 0 (flat) or at least 2, got {self.arity}")
        if self.cycle_ms <= 0:
            raise ValueError(f"collective.cycle_ms must be positive, got {self.cycle_ms}")
        if self.stall_timeout <= 0:
            raise ValueError(f"collective.stall_timeout must be positive, got {self.stall_timeout}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"collective.algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.fusion not in FUSIONS:
            raise ValueError(f"collective.fusion must be one of {', '.join(FUSIONS)}, got {self.fusion!r}")
        if self.local_group not in LOCAL_GROUPS:
            raise ValueError(f"collective.local_group must be one of {', '.join(LOCAL_GROUPS)}, "
                             f"got {self.local_group!r}")
        if self.mode not in MODES:
            raise ValueError(f"collective.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.fusion_bytes < 0 or self.tree_below_bytes < 0 or not 0 <= self.carry_bytes <= 16 << 20:
            raise ValueError("collective.fusion_bytes and collective.tree_below_bytes must be 0 or positive, "
                             "collective.carry_bytes from 0 to 16 MiB")
