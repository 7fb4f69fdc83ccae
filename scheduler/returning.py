"""A replaced server or aggregator registering again (ps.recover): welcomed, planned again, announced (pure).

The rendezvous (scheduler/rendezvous.py) hands these a node that registers under a name the job
already has, while it runs: a server restarted by the launcher (on its host, or on its mirror's with
ps.replicas) or an aggregator restarted. It gets its old id, every PLAN again (scheduler/recovery.py
keeps them) and, an aggregator, the routings still in use (scheduler/hierarchy/switch.py); once it
acknowledged the plans, SERVER_BACK or AGGREGATOR_BACK tells the others its new endpoints, and they
send it again what it had left unanswered (scheduler/resend.py, ps/relay.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sluice.scheduler.members import Node, address_book
from sluice.transport.wire import Kind, Message, WireError, meta_field

if TYPE_CHECKING:
    from sluice.scheduler.rendezvous import Out, Rendezvous


def server_returns(machine: Rendezvous, node: Node, msg: Message, now: float) -> list[Out]:
    """A replaced server registered again (ps.recover): welcome it as before, then re-plan it."""
    servers = machine._of_role("server")
    old = [s.endpoints for s in servers]
    refused = _refused(machine, node, msg, now)
    if refused:
        return refused
    holder = machine.recovery.took_over(node.rank, old, node.endpoints)  # before the welcome: it names the mirrors
    outs = [(node.name, machine.welcome(node, address_book(machine.nodes.values())))]
    if holder is not None:  # ps.replicas: its host was lost; it restores from the mirror there
        machine.notes.append(f"{node.describe()} came back on the host of server {holder}, which held its mirror")
        outs.append((servers[holder].name, machine._msg(Kind.MIRROR_RELEASE, rank=node.rank)))
    return outs + _plan_again(machine, node, [])


def aggregator_returns(machine: Rendezvous, node: Node, msg: Message, now: float) -> list[Out]:
    """A replaced aggregator registered again (ps.recover): welcome it, give it its plans and the routings in
    use again; once it acknowledged the plans, its children send it again what it left unanswered."""
    refused = _refused(machine, node, msg, now)
    if refused:
        return refused
    outs = [(node.name, machine.welcome(node, address_book(machine.nodes.values())))]
    return outs + _plan_again(machine, node, machine.switch.installed(node.name))


def _refused(machine: Rendezvous, node: Node, msg: Message, now: float) -> list[Out]:
    """An ERROR for a replacement started with another configuration; else nothing, its new endpoints and pid
    taken (it keeps its old id and rank)."""
    if meta_field(msg, "fingerprint", str) != machine.fingerprint:
        return [(node.name, machine._msg(Kind.ERROR, error=f"the replacement of {node.describe()} was started "
                                                           "with a different configuration"))]
    endpoints = meta_field(msg, "endpoints", list)
    if not all(isinstance(e, str) for e in endpoints) or (node.role == "server" and not endpoints):
        raise WireError("REGISTER endpoints must be a list of strings (non-empty for a server)")
    node.endpoints, node.pid = endpoints, meta_field(msg, "pid", int)
    machine.last_seen[node.name] = now
    return []


def _plan_again(machine: Rendezvous, node: Node, routings: list[Out]) -> list[Out]:
    """Its plans again (and `routings`); announced at once when it has none to acknowledge."""
    plans = machine.recovery.replaced(node.name)
    routed = f" and {len(routings)} routings" if routings else ""
    machine.notes.append(f"{node.describe()} registered again (replacement "
                         f"{machine.recovery.incarnations[node.name]}); re-sending its {len(plans)} plans{routed}")
    # the workers that left: its rounds waiting for one fail at once, naming it, as the dead one's would have
    left = [(node.name, machine._msg(Kind.BYE, rank=worker.rank)) for worker in machine._of_role("worker")
            if worker.name in machine.byes]
    outs = [(node.name, plan) for plan in plans] + routings + left
    if not plans:
        machine.recovery.pending.pop(node.name, None)
        outs += node_back(machine, node)
    return outs


def node_back(machine: Rendezvous, node: Node) -> list[Out]:
    """A replaced server or aggregator has its plans: tell the others where it listens now."""
    machine.notes.append(f"{node.describe()} is back: telling the workers its endpoints")
    back = machine.recovery.back(node.node_id, node.rank, node.name, node.endpoints, node.role)
    # ps.replicas: the servers too, as the one restarted may hold or send another's mirror (ps/mirror_links.py)
    servers = [n for n in machine._of_role("server") if n is not node] \
        if machine.recovery.replicas and node.role == "server" else []
    aggregators = [n for n in machine._of_role("aggregator") if n is not node]
    return [(n.name, back) for n in machine._of_role("worker") + aggregators + servers]
