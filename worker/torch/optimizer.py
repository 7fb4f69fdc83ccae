"""DistributedOptimizer: pushes each gradient from its autograd hook and overlaps updates with compute.

With the optimizer on the workers, `step()` returns at once (`worker.overlap_step`) and each
parameter is averaged and stepped just before the next forward pass uses it; with the optimizer on
the servers, the servers step and the forward pass waits, module by module, for the updated
parameters. Either way the first layers, whose parameters travel first, compute while the rest are
still arriving.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from sluice.errors import InvalidCallError, SluiceError
from sluice.worker.collective.engine import CollectiveEngine
from sluice.worker.staging import Staging
from sluice.worker.torch.adasum_optimizer import adasum_optimizer
from sluice.worker.torch.calls import member_engine
from sluice.worker.torch.collectives import Adasum, Average, allgather_async, synchronize
from sluice.worker.torch.compression import Compression, Compressor
from sluice.worker.torch.fusion import FusedGradients, GroupWait, Reduction, build_fusion, choose_routes
from sluice.worker.torch.options import Done, LocalMixin, Options, local_only, named_parameters_of, parse_options
from sluice.worker.torch.priority import ParameterPriorities
from sluice.worker.torch.rebind import track
from sluice.worker.torch.server_side import seed_servers, server_options
from sluice.worker.torch.state import OPTIMIZERS, PENDING, STATE, Waitable, declare_missing, log_metrics, require
from sluice.worker.torch.updates import READY, finish_updates, step_ready, synchronize_parameters


class _DistributedMixin(LocalMixin):
    """Mixed in front of the user's optimizer class, so isinstance and LR schedulers keep working."""

    param_groups: list[dict[str, Any]]

    def _sluice_setup(
        self, kind: type, named_parameters: Iterable[tuple[str, torch.Tensor]] | None, model: torch.nn.Module | None,
        horovod: Options, prefix: str, on: CollectiveEngine, process_set: Any,
    ) -> None:
        """`prefix` keeps this optimizer's names on the servers and in the collectives apart from other
        optimizers' of the process ('' for the first, then 'opt1.', ...: the same on every rank); `on`
        is the engine of its process set (its gradients are summed over its workers only, by allreduce or on
        the servers)."""
        self._sluice_kind = kind
        self._sluice_engine, self._sluice_process_set = on, process_set
        self._sluice_steps = 0
        self._sluice_options = horovod
        #: id(param) -> backward passes since its gradient was last sent (backward_passes_per_step)
        self._sluice_passes: dict[int, int] = {}
        params = [p for group in self.param_groups for p in group["params"]]
        named = named_parameters_of(self.param_groups, named_parameters)
        #: Horovod's attribute: each parameter's name
        self._parameter_names = {p: name for name, p in named}
        self._sluice_names = {id(p): prefix + name for name, p in named}
        self._sluice_prefix = prefix
        self._sluice_on_server = STATE.settings.optimizer_on == "server"
        self._sluice_handles: dict[int, tuple[Waitable, Callable[[], Any]]] = {}
        self._sluice_stages: dict[int, Staging] = {}
        in_order = [(self._sluice_names[id(p)], p) for p in params]
        node = require()
        if self._sluice_on_server:
            if on.label:
                raise SluiceError("worker.optimizer_on = 'server' steps the job's one copy of each parameter: a "
                                  "DistributedOptimizer of a process set runs its optimizer on the workers")
            if not node.ps.servers:
                raise SluiceError("worker.optimizer_on = 'server' needs parameter servers; this job has none (-s 0)")
            options = {self._sluice_names[id(p)]: server_options(kind, group)
                       for group in self.param_groups for p in group["params"]}
            declare_missing(in_order, options)
            if horovod.reduction != Reduction():
                raise SluiceError("with worker.optimizer_on = 'server' the servers average the gradients themselves: "
                                  "compression, op and gradient_predivide_factor apply to optimizer_on = 'worker'")
        #: id(param) -> the fused gradients it belongs to (optimizer on the workers; made at the first hook)
        self._sluice_fused: dict[int, FusedGradients] | None = None
        self._sluice_flushed = False
        self._sluice_routes = choose_routes([(n, p) for n, p in in_order if p.requires_grad],
                                            node.collective_settings, node.hosts("worker"), node.hosts("server"))
        if on.set_id and node.by_rank("aggregator"):  # an aggregator sums its whole rack: a set takes allreduce
            self._sluice_routes = dict.fromkeys(self._sluice_routes, "allreduce")
        self._sluice_priorities = ParameterPriorities(node, STATE.settings, in_order, model)
        if self._sluice_on_server:
            seed_servers(in_order)
        self._sluice_group = {id(p): group for group in self.param_groups for p in group["params"]}
        self._sluice_params = {id(p): p for p in params}
        #: the parameters that required gradients when this optimizer was made: hooked, and fused, for good
        #: (a requires_grad switched off later leaves a zero in its slot; Horovod's hooks are made once too)
        self._sluice_hooked = [id(p) for p in params if p.requires_grad]
        #: this step's gradients are all sent (those never computed here too); a hook or zero_grad starts a step
        self._sluice_completed = False
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._sluice_hook)

    def _sluice_hook(self, param: torch.Tensor) -> None:
        self._sluice_completed = False
        self._sluice_priorities.forward_seen()  # a gradient is ready, so the forward pass is over
        key = id(param)
        passes = self._sluice_passes.get(key, 0) + 1
        every = self._sluice_options.backward_passes_per_step
        if passes > every:
            raise SluiceError(f"the gradient of {self._sluice_names[key]} was computed more than "
                              f"backward_passes_per_step = {every} times before step(): call step() after every "
                              f"{every} backward passes, or raise backward_passes_per_step")
        self._sluice_passes[key] = passes
        if passes < every:  # accumulate locally; the last pass of the step sends the sum
            return
        trace = require().trace
        if trace is not None:
            trace.ready(self._sluice_names[key], self._sluice_steps + 1, self._sluice_priorities.of(key))
        if param.grad is not None and param.grad.is_sparse:
            self._sluice_sparse(key, param)
            return
        earlier = self._sluice_handles.pop(key, None) or PENDING.pop(key, None)
        if earlier is not None:
            earlier[0].wait()
            earlier[1]()
            step_ready()
        if not self._sluice_on_server:
            self._sluice_take(key, param)
            return
        grad = param.grad
        assert grad is not None
        node, name = require(), self._sluice_names[key]
        grad_stage = self._sluice_staging(key, grad)
        data = grad_stage.load(grad)
        options = server_options(self._sluice_kind, self._sluice_group[key])
        param_stage = Staging(param) if grad_stage.direct else grad_stage
        handle = node.ps.push_pull(name, data, param_stage.array(), opt=options)
        self._sluice_handles[key] = (handle, lambda: param_stage.store(param))

    def _sluice_sparse(self, key: int, param: torch.Tensor) -> None:
        """A sparse gradient (an embedding's): dense in the fusion buffer with sparse_as_dense, else
        Horovod's sparse allreduce: every rank's indices and values gathered, then summed (coalesced)."""
        grad = param.grad
        assert grad is not None
        if self._sluice_options.sparse_as_dense:
            param.grad = grad.to_dense()
            self._sluice_take(key, param)
            return
        if self._sluice_on_server:
            raise SluiceError(f"{self._sluice_names[key]} has a sparse gradient: the servers take dense ones; "
                              "pass sparse_as_dense=True")
        grad = grad.coalesce()
        name = self._sluice_names[key]
        on = self._sluice_process_set
        indices = allgather_async(grad.indices().t().contiguous(), f"sparse.{name}.indices", on)
        values = allgather_async(grad.values().contiguous(), f"sparse.{name}.values", on)
        scale, shape = self._sluice_options.reduction.postscale(self._sluice_engine.size), grad.shape

        def finish() -> torch.Tensor:
            gathered = torch.sparse_coo_tensor(synchronize(indices).t(), synchronize(values) * scale, shape,
                                               check_invariants=True)  # a peer's indices are checked
            return gathered.coalesce()

        self._sluice_handles[key] = (Done(), finish)

    def _sluice_take(self, key: int, param: torch.Tensor) -> None:
        """Optimizer on the workers: the gradient lies in (or is copied into) its fusion buffer, and
        every group it completes leaves at once, through the servers or allreduce."""
        if self._sluice_fused is None:
            self._sluice_fused = build_fusion(self._sluice_params, self._sluice_names, self._sluice_routes,
                                              self._sluice_priorities.assigned, self._sluice_options.reduction,
                                              self._sluice_options.groups, self._sluice_prefix, self._sluice_hooked,
                                              self._sluice_engine)
        elif self._sluice_flushed:
            self._sluice_next_step()
        fused = self._sluice_fused[key]
        fused.take(key, param)
        view = fused.view(key)
        self._sluice_handles[key] = (fused.waits_for(key), lambda: view)

    def _sluice_flush(self) -> None:
        """Backward is over: a gradient this rank never computed (its loss did not reach the parameter)
        goes as zeros, as Horovod's, so the others' still count and every rank steps it alike; then
        every group not sent yet goes."""
        if not self._sluice_completed:
            self._sluice_completed = True
            # every hook fired (the usual step): nothing is missing, and no loop over the parameters
            missing = self._sluice_hooked if len(self._sluice_handles) < len(self._sluice_hooked) else ()
            for key in missing:
                param = self._sluice_params[key]
                if key not in self._sluice_handles and param.requires_grad:  # frozen now: not stepped, as torch
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
                    self._sluice_passes[key] = self._sluice_options.backward_passes_per_step - 1
                    self._sluice_hook(param)
        if self._sluice_fused is not None and not self._sluice_flushed:
            for fused in {id(f): f for f in self._sluice_fused.values()}.values():
                fused.flush()
            self._sluice_flushed = True

    def _sluice_next_step(self) -> None:
        """A new backward pass begins: finish the updates still reading the buffer about to be reused,
        then point the gradients at it, zeroed."""
        assert self._sluice_fused is not None
        for fused in {id(f): f for f in self._sluice_fused.values()}.values():
            stale = [k for k, (wait, _) in PENDING.items()
                     if isinstance(wait, GroupWait) and wait.fused is fused and wait.step.buffer != fused.active]
            finish_updates(stale)
            fused.next_step(self._sluice_params)
        self._sluice_flushed = False

    def _sluice_staging(self, key: int, grad: torch.Tensor) -> Staging:
        """The gradient itself on the CPU; else one pinned buffer per parameter, kept across steps."""
        if grad.device.type == "cpu" and grad.is_contiguous():
            return Staging(grad)
        stage = self._sluice_stages.get(key)
        if stage is None or stage.host.shape != grad.shape or stage.host.dtype != grad.dtype:
            stage = self._sluice_stages[key] = Staging(grad)
        return stage

    def synchronize(self) -> None:
        """Wait for every gradient pushed since the last step (and average it, optimizer on workers)."""
        self._sluice_flush()
        self._sluice_passes.clear()  # as Horovod's: the next backward pass starts a new accumulation
        handles, self._sluice_handles = self._sluice_handles, {}
        for key, (handle, finish) in handles.items():
            handle.wait()
            grad = finish()
            if isinstance(grad, torch.Tensor) and grad.is_sparse:  # fused gradients are param.grad already
                self._sluice_params[key].grad = grad

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        self._sluice_steps += 1
        require().step_times.tick(time.monotonic())  # the Prometheus endpoint's sluice_step_seconds
        self._sluice_passes.clear()
        every = STATE.settings.metrics_every
        if every and self._sluice_steps % every == 0 and require().rank == 0:
            window = f"steps {self._sluice_steps - every + 1}-{self._sluice_steps}"
            log_metrics(require().transport.stats(reset=True), window)
        self._sluice_flush()
        if self._sluice_on_server:
            loss = closure() if closure is not None else None
            PENDING.update(self._sluice_handles)
            self._sluice_handles = {}
            return loss
        if closure is not None or not STATE.settings.overlap_step or not self._sluice_handles:
            self.synchronize()  # nothing to overlap (or the caller synchronized already): step all now
            return super().step(closure)  # type: ignore[misc, no-any-return]
        # the hyper-parameters as they are now: an LR scheduler may change them before the updates run
        settings = {id(g): {k: v for k, v in g.items() if k != "params"} for g in self.param_groups}
        for key, (handle, average) in self._sluice_handles.items():
            step_one = functools.partial(self._sluice_step_one, key, average, settings[id(self._sluice_group[key])])
            PENDING[key] = (handle, step_one)
        self._sluice_handles = {}
        return None

    def _sluice_step_one(self, key: int, average: Callable[[], Any], settings: dict[str, Any]) -> None:
        """Average one parameter's summed gradient and queue it for `step_ready()`, which steps a
        module's parameters together (called just before the forward pass uses it)."""
        READY.append((self, key, average(), settings))

    def _sluice_step_params(self, ready: list[tuple[int, torch.Tensor, dict[str, Any]]]) -> None:
        """Run the optimizer on these parameters alone, one step per group and step() call, with the
        group's settings as they were at that step()."""
        batches: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        settings_of: dict[tuple[int, int], tuple[dict[str, Any], dict[str, Any]]] = {}
        for key, grad, settings in ready:
            group = self._sluice_group[key]
            batch = (id(group), id(settings))
            batches.setdefault(batch, []).append((self._sluice_params[key], grad))
            settings_of[batch] = (group, settings)
        lists = [g["params"] for g in self.param_groups]
        for batch, pairs in batches.items():
            group, settings = settings_of[batch]
            # zero_grad() may have dropped param.grad meanwhile: step with the gradients we averaged
            current = [param.grad for param, _ in pairs]
            later = {k: group[k] for k in settings}
            try:
                group.update(settings)
                for param, grad in pairs:
                    param.grad = grad
                for g in self.param_groups:
                    g["params"] = [param for param, _ in pairs] if g is group else []
                started = time.monotonic()
                super().step()  # type: ignore[misc]
                trace = require().trace
                if trace is not None:
                    for param, _ in pairs:
                        trace.applied(self._sluice_names[id(param)], self._sluice_steps, started, time.monotonic())
            finally:
                for g, params in zip(self.param_groups, lists, strict=True):
                    g["params"] = params
                group.update(later)
                for (param, _), previous in zip(pairs, current, strict=True):
                    param.grad = previous

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, then the map from each parameter to its group again: torch makes new group dicts."""
        super().load_state_dict(state_dict)  # type: ignore[misc]
        self._sluice_group = {id(p): group for group in self.param_groups for p in group["params"]}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """With the optimizer on the workers, gradients stay views of the fusion buffers (as DDP's
        gradient_as_bucket_view): this points them at the other buffer, zeroed, whatever set_to_none
        says, while the updates of the last step may still read the first."""
        self._sluice_completed = False
        if self._sluice_fused is not None:
            if not self._sluice_flushed:  # in the middle of a step: finish it first
                self.synchronize()
            self._sluice_next_step()
            return
        if not set_to_none:  # zeroing in place would race with updates still in flight: finish them
            synchronize_parameters()
        super().zero_grad(set_to_none)  # type: ignore[misc]


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: str = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | Sequence[Sequence[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
    model: torch.nn.Module | None = None,
) -> torch.optim.Optimizer:
    """Wrap `optimizer` so its gradients (or updates) go through the parameter servers or allreduce.

    Horovod's arguments: `compression` (Compression.none, fp16, bf16: the wire dtype of the fused
    gradients), `op` (Average or Sum; Adasum: Horovod's delta optimizer, adasum_optimizer.py),
    `gradient_predivide_factor`, `backward_passes_per_step` (gradients accumulate locally over that
    many backward passes, then one reduction), `groups` (an
    int: that many balanced fused groups; lists of parameters: each list one fused message),
    `num_groups` (Horovod's older name for an int `groups`), `sparse_as_dense`. Parameters get
    priorities by how soon the forward pass needs them (`worker.priority`): from the torch.fx graph of
    `model` when it is given and traceable, else from the first forward pass. `process_set`: its
    workers reduce among themselves (allreduce); on a worker outside it, the optimizer steps on the
    local gradients, as Horovod's.
    """
    node = require()
    on = member_engine(process_set)
    if on is None:  # this worker is not in the set: Horovod's optimizer then steps on the local gradients
        return local_only(optimizer)
    index = next(OPTIMIZERS if not on.label else _SET_OPTIMIZERS.setdefault(on.label, itertools.count()))
    prefix = (f"set{on.set_id}." if on.set_id else "") + (f"opt{index}." if index else "")
    if op == Adasum and node.size > 1:  # Horovod's delta optimizer (at size 1 it is the plain one, as there)
        if on.label:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        if gradient_predivide_factor != 1.0:
            raise InvalidCallError("gradient_predivide_factor not supported with op != Average")
        return adasum_optimizer(optimizer, named_parameters, prefix)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    options = parse_options(compression, backward_passes_per_step, op, gradient_predivide_factor,
                       groups if groups is not None else (num_groups or None), sparse_as_dense, params)
    base: Any = optimizer.__class__
    cls: Any = type(base.__name__, (_DistributedMixin, base), {})
    wrapped: Any = cls.__new__(cls)
    base.__init__(wrapped, optimizer.param_groups)
    wrapped._sluice_setup(optimizer.__class__, named_parameters, model, options, prefix, on, process_set)
    return track(wrapped)  # type: ignore[no-any-return]


#: DistributedOptimizers of each process set made in this process (by its engine's label), numbered alike
_SET_OPTIMIZERS: dict[str, Iterator[int]] = {}
