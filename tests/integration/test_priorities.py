"""Parameter priorities in a real job: derived from the forward pass or the fx graph, overridable,
in force from the first backward pass, carried by every push, and written out on request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from testbed.cluster import LocalCluster
from tests.integration import prefork

prefork.torch_optimizers()  # once here, not in every forked worker

pytestmark = pytest.mark.timeout(90)


class Backwards(torch.nn.Module):
    """Modules declared in the opposite order to the one the forward pass runs them in."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(8, 2)
        self.middle = torch.nn.Linear(16, 8)
        self.stem = torch.nn.Linear(4, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.middle(torch.tanh(self.stem(x)))))


# the forward pass uses stem, then middle, then head: that, not the declaration, sets the priorities
EXPECTED = {"stem.weight": 0, "stem.bias": 1, "middle.weight": 2, "middle.bias": 3, "head.weight": 4, "head.bias": 5}


def _train(steps: int, give_model: bool) -> dict[str, Any]:
    import sluice.torch as hvd
    from sluice.worker.torch.state import require

    hvd.init()
    node = require()
    model = Backwards()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        model=model if give_model else None,
    )
    pushed: list[tuple[str, int, int]] = []
    send = node.transport.send

    def spy(peer: str, channel: int, msg: Any) -> None:
        if msg.kind.name == "PUSH":  # unfused, each gradient is its own group, declared at the first backward
            keys = {t.key: name for name, t in node.ps._tensors.items()}
            pushed.append((_param_of(opt, keys[msg.key]), msg.priority, channel))
        send(peer, channel, msg)

    node.transport.send = spy  # type: ignore[method-assign]
    x = torch.randn(8, 4)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), torch.zeros(8, 2)).backward()
        opt.step()
    return {
        "priorities": {_param_of(opt, name): t.priority for name, t in node.ps._tensors.items()},
        "channels": {_param_of(opt, name): t.channel for name, t in node.ps._tensors.items()},
        "pushed": pushed,
        "metrics": hvd.metrics(),
    }


def _param_of(opt: Any, group: str) -> str:
    """The parameter an unfused group (collective.fusion_bytes = 0) carries."""
    for fused in set(opt._sluice_fused.values()):
        if group in fused.names:
            (tensor,) = fused.plan.groups[fused.names.index(group)].tensors
            return str(opt._sluice_names[fused.keys[tensor]])
    raise KeyError(group)


#: each gradient alone, through the servers: the priorities under test are the tensors' own
UNFUSED = {"fusion_bytes": 0, "mode": "ps"}


@pytest.mark.parametrize("give_model", [False, True], ids=["first-forward-pass", "fx-graph"])
def test_priorities_follow_the_forward_pass_not_the_declaration(tmp_path: Path, give_model: bool) -> None:
    out = tmp_path / "priorities.json"
    config = {"worker": {"priority_file": str(out)}, "transport": {"channels": 3}, "collective": UNFUSED}
    with LocalCluster(2, 1, config) as cluster:
        results = cluster.run(_train, 2, give_model)
    for result in results:
        assert result["priorities"] == EXPECTED
        # 6 tensors in 3 channels: two priorities per channel, the stem's on the urgent one
        assert result["channels"] == {name: priority // 2 for name, priority in EXPECTED.items()}
        # the very first backward pass already pushes with the derived priorities, on their channels
        assert {(n, p, c) for n, p, c in result["pushed"]} == {(n, p, p // 2) for n, p in EXPECTED.items()}
        assert len(result["pushed"]) == 2 * len(EXPECTED)
        sent = result["metrics"]["sent_bytes"]
        assert all(nbytes > 0 for nbytes in sent), "every channel carried its share"
        assert set(result["metrics"]["queue_delay"]) >= set(EXPECTED.values())
    written = json.loads(out.read_text())["priorities"]
    how = "forward"
    assert [(e["name"], e["priority"], e["source"]) for e in written] == [
        (name, priority, how) for name, priority in sorted(EXPECTED.items(), key=lambda item: item[1])
    ]


@pytest.mark.parametrize(
    ("worker_settings", "expected"),
    [
        ({"priority_overrides": ["head.*=0"]}, {**EXPECTED, "head.weight": 0, "head.bias": 0}),
        ({"priority": "declaration"}, {"head.weight": 0, "head.bias": 1, "middle.weight": 2, "middle.bias": 3,
                                       "stem.weight": 4, "stem.bias": 5}),
        ({"priority": "none"}, dict.fromkeys(EXPECTED, 0)),
        ({"priority": "none", "priority_overrides": ["stem.weight=3"]}, {**dict.fromkeys(EXPECTED, 0),
                                                                          "stem.weight": 3}),
    ],
    ids=["override", "declaration", "none", "none-with-override"],
)
def test_priority_settings(worker_settings: dict[str, Any], expected: dict[str, int]) -> None:
    with LocalCluster(1, 1, {"worker": worker_settings, "collective": UNFUSED}) as cluster:
        (result,) = cluster.run(_train, 1, False)
    assert result["priorities"] == expected
    assert {(n, p) for n, p, _ in result["pushed"]} == set(expected.items())
