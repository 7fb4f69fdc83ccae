"""broadcast_optimizer_state and broadcast_parameters as Horovod's, in jobs of 2 or 3 workers (one with a server)."""

from __future__ import annotations

from typing import Any

import pytest

from testbed.cluster import LocalCluster
from tests.integration import prefork
from tests.integration.optimizer_state_jobs import cases, every_optimizer, horovod_cases, parameter_forms, warm_up

pytestmark = pytest.mark.slow

prefork.torch_optimizers()  # once here, not in every forked worker
warm_up()

#: indexes in the state_dict of Net's parameters: group 0 embed.weight, frozen; group 1 fc.weight, fc.bias, unused
_WITH_STATE = {"Adagrad": [0, 1, 2, 3, 4], "Muon": [0, 2], "SparseAdam": [0], "SGD.stateless": []}
#: parameters Net's optimizer holds (and so gets a zero gradient while its state is empty)
_OPTIMIZED = {"SparseAdam": ["embed.weight"], "Muon": ["embed.weight", "fc.weight", "unused"]}


def _zero(grad: Any, sparse: bool) -> bool:
    kind, _, _, _, is_sparse, values = grad
    flat = [v for row in values for v in (row if isinstance(row, list) else [row])]
    return bool(kind == "tensor" and is_sparse == sparse and not any(flat))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("workers", "servers", "root"), [(2, 0, 0), (3, 0, 2), (2, 1, 1)])
def test_every_optimizer_takes_the_roots_state_and_hyper_parameters(workers: int, servers: int, root: int) -> None:
    with LocalCluster(workers, servers) as cluster:
        results = cluster.run(every_optimizer, root, timeout=80)
    fresh = (root + 1) % workers
    for name, _ in cases():
        want = results[root][name]["before"]
        held = sorted(want[1]["state"][1])
        assert held == _WITH_STATE.get(name, [0, 2, 3]), name  # frozen and unused have none on the root
        if name != "Adagrad":
            assert results[fresh][name]["before"][1]["state"][1] == {}, name
        for rank, out in enumerate(results):
            case = out[name]
            assert case["after"] == want, (name, rank)  # tensors, plain values and hyper-parameters, with types
            empty = case["empty_before"]
            # Adagrad makes its state when built; SGD without momentum never has any
            assert empty == (name == "SGD.stateless" or (rank == fresh and name != "Adagrad")), (name, rank)
            optimized = _OPTIMIZED.get(name, ["embed.weight", "fc.weight", "fc.bias", "unused"])
            for param, grad in case["grads"].items():
                if empty and param in optimized:  # Horovod's zero gradients, sparse for SparseAdam
                    assert grad is not None and _zero(grad, name == "SparseAdam"), (name, rank, param)
                else:  # requires_grad=False, outside the optimizer, or the state was there: untouched
                    assert grad is None, (name, rank, param)
            assert case["trained"] == results[root][name]["trained"], (name, rank)
        assert results[root][name]["trained"] == pytest.approx(results[root][name]["reference"], rel=1e-5,
                                                               abs=1e-6), name
    others = [rank for rank in range(workers) if rank not in (root, fresh)]
    for rank in others:  # state the root lacks (the unused parameter's) is dropped
        before = results[rank]["Adam"]["before"][1]["state"][1]
        assert 4 in before and 4 not in results[rank]["Adam"]["after"][1]["state"][1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [2, 3])
def test_horovod_cases_gradients_plain_values_and_refusals(workers: int) -> None:
    with LocalCluster(workers, 0) as cluster:
        results = cluster.run(horovod_cases, timeout=50)
    for rank, out in enumerate(results):
        for wrapped in (True, False):  # Horovod's test_broadcast_state_no_grad
            case = out[f"no_grad.{wrapped}"]
            assert isinstance(case, list), (rank, wrapped, case)
            a_grad_is_none, b_grad, same_as_root, state = case
            assert a_grad_is_none and same_as_root, (rank, wrapped)
            assert b_grad == ["tensor", "torch.float32", [4], "cpu", False, [0.0] * 4]
            assert state == results[0][f"no_grad.{wrapped}"][3]
        dense = {"embed.weight": [False, 0.0], "fc.weight": [False, 0.0], "fc.bias": [False, 0.0], "frozen": None,
                 "unused": [False, 0.0]}
        assert out["sparse.True"] == {**dense, "embed.weight": [True, 0.0]}  # model= marks the sparse embedding
        assert out["sparse.False"] == dense
        values = out["values"]
        root_before = results[0]["values"]["before"]
        assert values["after"] == root_before, rank
        state = root_before[1]["state"][1][0][1]
        assert state["note"] == ["tuple", [["str", "tag"], ["int", 3], ["float", 2.5], ["NoneType", None],
                                           ["bool", True]]]
        assert state["count"] == ["int", 7] and "stale" not in state
        group = root_before[1]["param_groups"][1][0][1]
        assert group["scale"] == ["int", 2] and group["name"] == ["str", "head"]
        assert group["betas"] == ["tuple", [["float", 0.8], ["float", 0.9]]] and group["lr"] == ["float", 0.1]
        assert group["lr_scale"][:5] == ["tensor", "torch.float64", [], "cpu", False]
        for wrapped in (False, True):
            assert out[f"lbfgs.{wrapped}"].split("|")[1:] == ["True", "cannot broadcast torch.optim.LBFGS state"]
        mismatch, unsendable = out["mismatch"].split("|"), out["unsendable"].split("|")
        assert mismatch[1] == "True" and "parameter groups" in mismatch[2], out["mismatch"]  # every rank, ValueError
        assert unsendable[1] == "True" and "'schedule'" in unsendable[2], out["unsendable"]
        assert out["in_step"] == [float(workers)]  # the ranks stay in step after the refusals


@pytest.mark.timeout(45)
@pytest.mark.parametrize(("workers", "root"), [(2, 1), (3, 0)])
def test_broadcast_parameters_takes_horovods_forms(workers: int, root: int) -> None:
    with LocalCluster(workers, 0) as cluster:
        results = cluster.run(parameter_forms, root, timeout=35)
    for form in ("dict", "tuples", "generator", "bare"):
        want = results[root][f"{form}.before"]
        assert results[1 - root][f"{form}.before"] != want  # the ranks start apart
        for rank, out in enumerate(results):
            assert out[form] == want, (form, rank, str(out[form])[:200])
