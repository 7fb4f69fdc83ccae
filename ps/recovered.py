"""What a server does differently with ps.recover: it restores its chunks, commits each round, and knows re-sent pushes.

A replacement server restores every chunk's last committed round from the state file (ps/snapshot.py)
before it acknowledges the PLAN, and every round is committed before any reply of it exists. So per
chunk each worker's outstanding push is of the committed round S or of S+1, and workers send again,
with Flag.RESEND, what the dead server never answered. A RESEND push of S is already in the value:
it is answered from it and not applied. A second copy of an S+1 push (one sat in the outbox while the
worker re-sent it) is dropped when either copy is a RESEND. Everything else is refused as before, and
without ps.recover the flag changes nothing: no peer can get a push applied twice with it.

With ps.replicas a holder that takes over may be up to ps.mirror_every (`lag`) rounds behind what
workers have seen (ps/mirror.py): workers also replay (RESEND | REPLAY) the pushes they were answered
for since, oldest first; a replayed push is applied if its round is the next and dropped if the
server has its round, never answered; and a push of a later round (up to `lag` + 1 ahead: its
sender was ahead of others; or a new push from a worker that was answered that far) is kept, copied,
until its round is the next one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from sluice.errors import SluiceError
from sluice.ps.config import ServerConfig
from sluice.ps.snapshot import STATE_DIR, StateFile, state_tag
from sluice.scheduler.bootstrap import NodeEnv
from sluice.transport.wire import Flag, Message, WireError, keep_payload

if TYPE_CHECKING:
    from sluice.ps.store import Chunk

#: what ShardStore does with a push Recovery.duplicate recognises
APPLIED = 1  # a round already committed: answer from the value, apply nothing
IGNORED = 2  # a second copy of a push already taken this round
EARLY = 3  # a push up to `lag` + 1 rounds ahead (ps.replicas): keep it (keep_early) until its round is next


class Recovery:
    """A server's state file and the rules for pushes that workers send again after a restart."""

    def __init__(self, state: StateFile, lag: int = 0) -> None:
        self.state = state
        #: how many rounds this server's state may be behind what workers have seen (ps.mirror_every with
        #: ps.replicas: a holder's copy taken over; 0 without: its own file has every round any worker saw):
        #: a push (re-sent, replayed, or new from a worker that was ahead) may come up to lag + 1 rounds ahead
        self.lag = lag
        #: (key, chunk) -> (round, ranks whose push of that round came as a RESEND)
        self._resent: dict[tuple[int, int], tuple[int, set[int]]] = {}
        #: (key, chunk) -> the EARLY pushes kept for its next round: (ranks, connection, channel, message)
        self._early: dict[tuple[int, int], list[tuple[tuple[int, ...], str, int, Message]]] = {}
        #: replayed pushes taken: of rounds this server redid, its state having been behind (ps.replicas)
        self.replayed = 0
        #: ps.replicas: told each commit, which it mirrors when the chunk's turn comes (ps/mirror.py)
        self.after_commit: Callable[[Chunk], None] | None = None
        #: ps.replicas: told each round's averaged gradient just before the optimizer steps with it
        self.before_step: Callable[[Chunk, np.ndarray], None] | None = None

    def restore(self, chunks: Sequence[Chunk], recovering: bool) -> list[Chunk]:
        """Give the new `chunks` of a PLAN their place in the file and their committed state; the chunks restored.

        A replacement gets its PLANs again as they were, so whatever the file holds for a chunk is
        restored (the file's name comes from the job secret: another job's state is not found).
        `recovering`, a PLAN marked as sent again (meta `recovery`), also makes a file that held nothing
        an error: the state was lost, not absent.
        """
        if recovering and self.state.problem is not None:
            raise SluiceError(
                f"server {self.state.rank} was restarted but its state file {self.state.path} {self.state.problem}: "
                "was its host rebooted or /dev/shm cleared? Recovery (ps.recover) needs the restarted server on the "
                "host it died on; start the job again"
            )
        self.state.add(chunks)
        return [chunk for chunk in chunks if self.state.restore(chunk)]

    def stepping(self, chunk: Chunk, grad: np.ndarray) -> None:
        """The round about to be applied to `chunk` by its optimizer, with `grad` (read it now: the step may
        overwrite it)."""
        if self.before_step is not None:
            self.before_step(chunk, grad)

    def commit(self, chunk: Chunk) -> None:
        """The round (or broadcast) just applied, made durable; call before creating any reply to it."""
        self.state.commit(chunk)
        if self.after_commit is not None:
            self.after_commit(chunk)

    def duplicate(self, chunk: Chunk, ranks: tuple[int, ...], msg: Message) -> int:
        """APPLIED, IGNORED, EARLY, or 0 (a push like any other, refused or taken as without ps.recover)."""
        resend = msg.flags & Flag.RESEND
        if resend and (msg.round == chunk.round >= 1 or (msg.flags & Flag.REPLAY and 1 <= msg.round <= chunk.round)):
            return APPLIED
        if chunk.round + 2 <= msg.round <= chunk.round + 1 + self.lag:
            return EARLY
        if msg.round != chunk.round + 1:
            return 0
        key = (chunk.key, chunk.chunk)
        if chunk.pushed.issuperset(ranks):
            earlier = self._resent.get(key)
            if resend or (earlier is not None and earlier[0] == msg.round and earlier[1].issuperset(ranks)):
                return IGNORED
        elif resend:
            self.replayed += bool(msg.flags & Flag.REPLAY)
            earlier = self._resent.get(key)
            if earlier is None or earlier[0] != msg.round:
                earlier = self._resent[key] = (msg.round, set())
            earlier[1].update(ranks)
        return 0

    def keep_early(self, chunk: Chunk, ranks: tuple[int, ...], peer: str, channel: int, msg: Message) -> None:
        """Keep an EARLY push (its payload copied: the transport's buffer is not ours to hold) until `due`."""
        early = self._early.setdefault((chunk.key, chunk.chunk), [])
        twice = {rank for kept, _, _, m in early if m.round == msg.round for rank in kept}.intersection(ranks)
        if twice:
            raise WireError(f"worker {min(twice)} sent round {msg.round} of {chunk.describe()} twice ahead of its turn")
        early.append((ranks, peer, channel, keep_payload(msg)))

    def due(self, chunk: Chunk) -> list[tuple[tuple[int, ...], str, int, Message]]:
        """The EARLY pushes of `chunk`'s next round, removed: its round before just completed."""
        early = self._early.get((chunk.key, chunk.chunk))
        if not early:
            return []
        due = [one for one in early if one[3].round == chunk.round + 1]
        if due:
            early[:] = [one for one in early if one[3].round != chunk.round + 1]
        return due

    def close(self, remove: bool = False) -> None:
        self.state.close(remove)


def open_recovery(env: NodeEnv, settings: ServerConfig, directory: str = STATE_DIR, held_by: int = -1,
                  lock_timeout: float = 5.0) -> Recovery:
    """Server `env.rank`'s state file, locked, or SluiceError saying why recovery cannot run. `held_by` >= 0:
    its copy that server held for it on this host (ps.replicas: it took over from a lost host, ps/mirror_links.py)."""
    if not settings.sync:
        raise SluiceError(
            "ps.recover needs ps.sync = true: an asynchronous server applies each push as it comes, so a "
            "replacement could not tell a re-sent push from a new one; turn ps.recover or ps.sync off"
        )
    if not env.secret:
        raise SluiceError("ps.recover needs the job secret (transport.curve on, or sluice launch)")
    if env.rank < 0:
        raise SluiceError("ps.recover needs each server's rank at start (SLUICE_RANK; sluice launch sets it)")
    lag = settings.mirror_rounds if settings.mirrored else 0
    return Recovery(StateFile.open(state_tag(env.secret), env.rank, directory, lock_timeout, held_by), lag)
