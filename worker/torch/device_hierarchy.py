"""Device-resident fused groups: summed in the host by torch's group, only this rank's share copied to the host.

BytePS's hierarchy with the gradients left where they are (OSDI'20): a fused group's buffer stays on
its device; the host's workers reduce-scatter it in their local group (worker/local_group.py: NCCL for
CUDA tensors, gloo for CPU ones), each copies its share alone into its registered host buffer, the
share crosses the hosts through Sluice (`cross`, the caller's: the servers or the allreduce engine),
comes back the same way and is allgathered into the group's buffer. With one worker on the host the
whole group is its share: no local group, only the copies.

On CUDA every step after the autograd hook runs on a side stream, ordered by events: the hook records
where backward stands, the side stream waits for it, reduce-scatters and copies the share to pinned
memory; a thread of this object's own waits for that copy (the one host synchronisation, off the
critical path) and starts the crossing; when it completes, the same thread queues the copy back and
the allgather on the side stream and records the event that `DeviceHandle.wait` makes the caller's
stream wait on. Reduce-scatters are issued by the hook in the order groups fill, the same on every
worker; allgathers by the thread in that order too, each on a lane of its own (NCCL matches a lane's
collectives by their order).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import secrets
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from sluice.scheduler.bootstrap import state_tag
from sluice.transport.dtypes import STORAGE
from sluice.worker.collective.ops import OpHandle
from sluice.worker.hierarchy import Hierarchy, StepThread
from sluice.worker.local_group import LocalGroup
from sluice.worker.node import WorkerNode
from sluice.worker.topology import share_bounds

log = logging.getLogger(__name__)

#: cross(share) starts the share's sum across the hosts (in place); its handle has add_done_callback and error
Cross = Callable[[np.ndarray], Any]
_SCATTER, _GATHER = 0, 1  # the local group's lanes
PAGE = mmap.PAGESIZE


def own_pages(address: int, nbytes: int, page: int = PAGE) -> tuple[int, int]:
    """Where a buffer of `nbytes` has whole pages of its own inside an allocation at `address` a page larger:
    its offset there (to the next page boundary) and the bytes to lock (`nbytes` rounded up to pages)."""
    return (-address) % page, -(-max(nbytes, 1) // page) * page


class DeviceHandle(OpHandle):
    """A device-resident group's sum: `wait` returns once it is queued; the caller's stream then waits on `event`."""

    def __init__(self, what: str, timeout: float) -> None:
        super().__init__(what, timeout)
        self.event: torch.cuda.Event | None = None

    def wait(self, timeout: float | None = None) -> None:
        super().wait(timeout)
        if self.event is not None:  # the allgather and the copy back, on the side stream: no host wait
            torch.cuda.current_stream(self.event.device).wait_event(self.event)


class _Group:
    """One fused group's device-side buffers: where its share is summed (and its padded copy where uneven)."""

    def __init__(self, length: int, local_size: int, rank: int, like: torch.Tensor) -> None:
        padded, bounds = share_bounds(length, local_size)
        self.start, self.end = bounds[rank]
        chunk = padded // local_size
        self.padded = torch.zeros(padded, dtype=like.dtype, device=like.device) if padded != length else None
        self.share = torch.zeros(chunk, dtype=like.dtype, device=like.device) if local_size > 1 else None


class DeviceHierarchy:
    """This worker's device-resident path: its local group (if the host has others), side stream and thread."""

    def __init__(self, node: WorkerNode, hierarchy: Hierarchy | None, device: torch.device, backend: str) -> None:
        self.node, self.hierarchy, self.device = node, hierarchy, device
        self.local_rank, self.local_size = (hierarchy.local_rank, hierarchy.local_size) if hierarchy else (0, 1)
        self._timeout = node.control_settings.op_timeout
        self.local: LocalGroup | None = None
        if hierarchy is not None:
            # the group's store is this host's, named by a number the host's workers agree on: a new one each
            # time they form it (an elastic job's next generation meets in a file of its own)
            nonce = np.array([secrets.randbits(62)], np.int64)
            hierarchy.local.broadcast("local_group.nonce", nonce, hierarchy.local.members[0], "int64").wait()
            first = hierarchy.local.members[0]  # the host's first worker's rank: a number of this host's own
            self.local = LocalGroup(state_tag(node.env.secret), first, int(nonce[0]), self.local_rank,
                                    self.local_size, backend, self._timeout, lanes=2)
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._groups: dict[str, _Group] = {}
        self._pinned: list[np.ndarray] = []
        #: fused groups summed this way, by their local group or (alone on the host) whole
        self.summed = 0
        self._steps = StepThread("sluice-device-hierarchy")
        #: groups whose crossing ended, by ticket, and the next ticket to gather: allgathers go in issue order
        self._crossed: dict[int, Callable[[], None]] = {}
        self._next_gather = 0
        self._tickets = 0

    def allreduce(self, name: str, flat: torch.Tensor, host: torch.Tensor, array: np.ndarray, cross: Cross,
                  hierarchical: bool = True) -> DeviceHandle:
        """Sum `flat` (1-D, on the device) over the job in place: this rank's share through `host` (registered
        memory as long as `flat`, of its dtype, pinned: only the share's span is used), whose wire storage is
        `array`, crossing by `cross`; the whole group where not `hierarchical` (or alone on the host). Call
        from the thread that fills the groups (the autograd hook), in the same order on every worker of the host."""
        done = DeviceHandle(f"device-resident allreduce {name!r}", self._timeout)
        local_size = self.local_size if hierarchical else 1
        self.summed += 1
        if self.hierarchy is not None and local_size > 1:
            self.hierarchy.groups += 1
        group = self._groups.get(name)
        if group is None:
            group = self._groups[name] = _Group(flat.numel(), local_size, self.local_rank if local_size > 1 else 0,
                                                flat)
        ticket, self._tickets = self._tickets, self._tickets + 1
        host_share = host[group.start:group.end]
        valid = group.end - group.start
        queued = time.monotonic()
        with self._on_side():
            source = flat
            if group.padded is not None:
                group.padded[:flat.numel()].copy_(flat)
                source = group.padded
            work = None
            if self.local is not None and group.share is not None:
                work = self.local.reduce_scatter(source, group.share, _SCATTER)
                device_share = group.share[:valid]
            else:
                device_share = flat[group.start:group.end]
            copied = self._copy_out(work, device_share, host_share)

        def crossing() -> None:
            try:
                copied()
            except Exception as exc:  # the host's sum failed, on every worker of the host alike: none gathers
                failed = f"inside the host (reduce-scatter of {name!r}): {type(exc).__name__}: {exc}"
                self._then(ticket, lambda: done.finish(error=failed))
                return
            finally:
                self._trace("D2H", name, queued, host_share.numel() * host_share.element_size())
            if valid == 0:  # every worker of this local rank has an empty share of a small group
                self._then(ticket, lambda: self._gather(name, flat, group, host_share, done, None))
                return
            try:
                handle = cross(array[group.start:group.end])
            except Exception as exc:  # the node failed, say: the host's other workers still wait to gather
                lost = f"{type(exc).__name__}: {exc}"
                self._then(ticket, lambda: self._gather(name, flat, group, host_share, done, lost))
                return
            handle.add_done_callback(lambda h: self._steps.put(
                lambda: self._then(ticket, lambda: self._gather(name, flat, group, host_share, done, h.error))))

        self._steps.put(crossing)
        return done

    def host_buffer(self, alloc: Callable[[tuple[int, ...], str], np.ndarray], count: int, dtype: str) -> np.ndarray:
        """`count` elements of registered memory from `alloc` (the PS client's) that a group's shares go through;
        for CUDA page-locked (cudaHostRegister), so that copies to and from it run on the side stream without the
        host. CUDA locks whole pages and refuses a page locked twice: the buffer gets pages of its own, carved
        out of an allocation a page larger than it needs. Unlocked (refused), copies are correct but block."""
        if self._side is None:
            return alloc((count,), dtype)
        item = np.dtype(STORAGE[dtype]).itemsize
        raw = alloc(((own_pages(0, count * item)[1] + PAGE) // item,), dtype)
        skip, locked = own_pages(raw.ctypes.data, count * item)
        buffer = raw[skip // item: (skip + locked) // item]
        failed = torch.cuda.cudart().cudaHostRegister(buffer.ctypes.data, locked, 0)  # type: ignore[no-untyped-call]
        if int(failed):
            log.warning("could not page-lock %d bytes for copies from the GPU (CUDA error %d): they will block",
                        locked, int(failed))
        else:
            self._pinned.append(buffer)
        return buffer[:count]

    def close(self) -> None:
        self._steps.close()
        if self._side is not None:
            self._side.synchronize()  # no copy still reads the buffers unpinned next
        for host in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(host.ctypes.data)  # type: ignore[no-untyped-call]
        self._pinned = []
        if self.local is not None:
            self.local.close()

    # ------------------------------------------------------------------ steps (the thread's, after the first)
    def _copy_out(self, work: Any, device_share: torch.Tensor, host_share: torch.Tensor) -> Callable[[], None]:
        """Queue the share's copy to the host after the reduce-scatter `work`; what blocks until it is there."""
        if self._side is None:  # CPU: gloo runs the sum on its own threads; the copy waits for it, on our thread
            def settle() -> None:
                if work is not None:
                    work.wait()
                host_share.copy_(device_share)
            return settle
        if work is not None:
            work.wait()  # the side stream waits for the sum, the host does not
        host_share.copy_(device_share, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._side)
        return event.synchronize

    def _then(self, ticket: int, gather: Callable[[], None]) -> None:
        """Group `ticket`'s crossing ended: gather it once every group issued before it is gathered."""
        self._crossed[ticket] = gather
        while self._next_gather in self._crossed:
            self._crossed.pop(self._next_gather)()
            self._next_gather += 1

    def _gather(self, name: str, flat: torch.Tensor, group: _Group, host_share: torch.Tensor, done: DeviceHandle,
                crossing_error: str | None) -> None:
        """The share back on the device and every rank's share into `flat`, even after a failed crossing (the
        host's other workers gather it too); `done` then finishes, with the crossing's error if any."""
        started = time.monotonic()
        valid = group.end - group.start
        try:
            with self._on_side(after_caller=False):  # the side stream has the order; this thread queued nothing
                blocking = self._side is None
                if self.local is not None and group.share is not None:
                    group.share[:valid].copy_(host_share, non_blocking=not blocking)
                    target = group.padded if group.padded is not None else flat
                    # on the CPU this waits; on CUDA the side stream waits for the gather, not the host
                    self.local.allgather(group.share, target, _GATHER).wait()
                    if group.padded is not None:
                        flat.copy_(group.padded[:flat.numel()], non_blocking=not blocking)
                else:
                    flat[group.start:group.end].copy_(host_share, non_blocking=not blocking)
                if self._side is not None:
                    done.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    done.event.record(self._side)
        except Exception as exc:
            crossing_error = crossing_error or f"inside the host (allgather of {name!r}): {type(exc).__name__}: {exc}"
        self._trace("H2D", name, started, host_share.numel() * host_share.element_size())
        done.finish(error=crossing_error)

    def _on_side(self, after_caller: bool = True) -> contextlib.AbstractContextManager[Any]:
        """The side stream (made to wait for what the caller's stream queued so far), or nothing on the CPU."""
        if self._side is None:
            return contextlib.nullcontext()
        if after_caller:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._side)

    def _trace(self, kind: str, name: str, start: float, nbytes: int) -> None:
        trace = self.node.trace
        if trace is not None:
            trace.copy(kind, name, start, time.monotonic(), nbytes)


#: one per worker node and device, made by the first fused gradients that need it
_MADE: dict[tuple[int, str], DeviceHierarchy] = {}


def made(node: WorkerNode) -> list[DeviceHierarchy]:
    """The node's device-resident paths so far (a job's check of which path its gradients took)."""
    return [made for (owner, _), made in _MADE.items() if owner == id(node)]


def device_hierarchy(node: WorkerNode, device: torch.device) -> DeviceHierarchy:
    """This node's device-resident path for `device` (its local group formed at the first call: every worker of
    the host makes its fused gradients alike); closed with the node."""
    key = (id(node), str(device))
    made = _MADE.get(key)
    if made is None:
        made = _MADE[key] = DeviceHierarchy(node, node.hierarchy(), device, "nccl" if device.type == "cuda" else "gloo")

        def close() -> None:
            _MADE.pop(key, None)
            made.close()
        node.on_close(close)
    return made
