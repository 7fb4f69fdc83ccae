"""Interleaved and zero-bubble pipeline orders (pure): V model chunks per worker, the backward split into I and W.

Each of P workers holds V chunks of the model; chunk c of worker r is virtual stage c * P + r, so a
micro-batch goes round the workers V times. Worker r runs its forwards in rounds of R micro-batches
(R = M / max(1, M // P); M must be a multiple of max(1, M // P)): R forwards of chunk 0, R of chunk 1,
..., then chunk 0 again; its backwards likewise from the last chunk down. Both orders are those of
torch.distributed.pipelining's ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble, worked out
here from the same rules:

- Interleaved 1F1B (Megatron-LM's interleaved schedule): (V - 1) R + 2 (P - 1 - r) forwards first (at
  most V M), then a forward and a backward in turn, then the backwards left. A stage's chunks are a
  V-th of its work, so the fill and the drain take a V-th of 1F1B's: with forward and backward of
  equal length the idle fraction is (P - 1) / (V M + P - 1), the bubble (P - 1) / (V M) of the work.
- Interleaved zero bubble (ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24, when
  V = 1): each backward is split into I, the inputs' gradient (what the stage before waits for), and
  W, the weights' gradient (which nobody waits for). (V - 1) R + P - 1 - r forwards first, then a
  forward and an I in turn, then the Is left; worker r runs each W r backwards after its I, and the
  last r at the end. The Ws deferred fill the drain's bubbles: with F = I = W the bubble is a third of
  1F1B's, and as in 1F1B a worker holds at most P micro-batches (forward done, W not).
"""

from __future__ import annotations

from sluice.worker.pipeline.schedule import Action


def rounds(stages: int, micro: int) -> int:
    """R, the micro-batches of one chunk a worker runs in a row; ValueError if M is not a multiple of M // P."""
    count = max(1, micro // stages)
    if micro % count:
        raise ValueError(f"interleaved schedules run the micro-batches in rounds of about P: {micro} micro-batches "
                         f"on {stages} stages make {count} rounds, and {micro} is not a multiple of {count} "
                         f"(take M <= P or a multiple of M // P, as torch's ScheduleInterleaved1F1B does)")
    return micro // count


def _check(stages: int, micro: int, virtual: int) -> int:
    if stages < 1 or micro < 1 or virtual < 1:
        raise ValueError(f"an interleaved pipeline needs at least one stage, micro-batch and chunk per stage, got "
                         f"{stages}, {micro} and {virtual}")
    return rounds(stages, micro)


class _Counter:
    """The next micro-batch of each chunk, for one kind of action."""

    def __init__(self, virtual: int) -> None:
        self.next = [0] * virtual

    def take(self, chunk: int) -> int:
        self.next[chunk] += 1
        return self.next[chunk] - 1


def _actions(kind: str, chunks: list[int], rank: int, stages: int, virtual: int) -> list[Action]:
    """One action per entry of `chunks` (the chunk of the k-th forward or backward), each chunk's
    micro-batches in order; the virtual stage named only with more than one chunk."""
    counter = _Counter(virtual)
    return [Action(kind, counter.take(c), c * stages + rank if virtual > 1 else None) for c in chunks]


def interleaved_1f1b(stages: int, micro: int, virtual: int) -> list[list[Action]]:
    """Each worker's order: forwards of chunk 0, 1, ... in rounds, a warm-up of (V-1) R + 2 (P-1-r)
    forwards, then one forward and one backward (last chunk first) in turn, then the backwards left."""
    per_round = _check(stages, micro, virtual)
    orders = []
    total = virtual * micro
    for rank in range(stages):
        warmup = min((virtual - 1) * per_round + 2 * (stages - 1 - rank), total)
        forwards = _actions("F", [(k // per_round) % virtual for k in range(total)], rank, stages, virtual)
        backwards = _actions("B", [virtual - 1 - (k // per_round) % virtual for k in range(total)], rank, stages,
                             virtual)
        order = forwards[:warmup]
        for k in range(total - warmup):
            order += [forwards[warmup + k], backwards[k]]
        orders.append(order + backwards[total - warmup:])
    return orders


def interleaved_zero_bubble(stages: int, micro: int, virtual: int) -> list[list[Action]]:
    """Each worker's order with the backward split: a warm-up of (V-1) R + P-1-r forwards, then one
    forward and one I in turn, then the Is left; worker r runs the W of each backward after the I r
    backwards later (rank 0 at once), the last r Ws at the end. ZB-H1 when V = 1."""
    per_round = _check(stages, micro, virtual)
    orders = []
    total = virtual * micro
    for rank in range(stages):
        warmup = min((virtual - 1) * per_round + stages - 1 - rank, total)
        chunks = [virtual - 1 - (k // per_round) % virtual for k in range(total)]
        forwards = _actions("F", [(k // per_round) % virtual for k in range(total)], rank, stages, virtual)
        inputs = _actions("I", chunks, rank, stages, virtual)
        weights = _actions("W", chunks, rank, stages, virtual)
        order = forwards[:warmup]
        for k in range(total):
            if warmup + k < total:
                order.append(forwards[warmup + k])
            order.append(inputs[k])
            if k >= rank:
                order.append(weights[k - rank])
        orders.append(order + weights[max(0, total - rank):])
    return orders
