"""Data parallelism: ``torch_mp.DataParallel`` and the pipeline's interop with PyTorch's DDP.

Both run on one engine, c10d's Reducer (PyTorch's DDP engine: buckets, gradient hooks,
reduction overlapped with backward), through the C++ core's ``GradientSync``; LibTorch
applications get the same as ``torch_mp::DataParallel``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torch_mp import _C
from torch_mp.mesh import Mesh, find_mesh, get_mesh


class DataParallel(nn.Module):
    """Averages the gradients of ``module`` over the data-parallel group, like DDP.

    Construction copies rank 0's parameters and buffers to every rank. Each forward with autograd
    arms the reduction for the backward that follows: gradients are all-reduced bucket by bucket
    as backward produces them, overlapped with the rest of backward, and averaged by the end of
    it. Under :meth:`no_sync` backwards accumulate locally; the next synced backward reduces the
    sum. Inside a :class:`torch_mp.pipeline.Pipeline` the reduction runs once per step, after the
    stage's last backward, whatever the schedule.

    Works with torch_mp's tensor-parallel layers (each data group holds the same shard on every
    rank) and with any other module.

    Args:
        module: The module to replicate.
        group: The data-parallel group; ``mesh.dp_cp_group`` (the default mesh's data group,
            times its context group when cp > 1: parameters are replicated over both, and each
            context rank's gradient covers its part of the sequence) when None.
        mesh: Takes ``mesh.dp_cp_group``; pass ``group`` or ``mesh``, not both.
        bucket_cap_mb: Size of a gradient bucket in MiB.
        gradient_as_bucket_view: Make each ``.grad`` a view into its bucket (the default: the
            gradients and the buckets are one copy, not two; DDP's default is False) instead of
            copying gradients into the buckets and back. Either way the sums are the same.
        broadcast_buffers: Copy rank 0's buffers (BatchNorm statistics) to every rank before the
            first forward of each synced step.
        comm_hook: ``None``, ``"fp16"`` or ``"bf16"``: all-reduce the buckets in 16 bits (half the
            bytes; the sum is then rounded to that precision).
        shard_gradients: Reduce-scatter the gradients instead, in the flat buckets of a
            :class:`torch_mp.DistributedOptimizer` over ``module.parameters()``, so that each
            rank keeps the averaged gradients of its own range only (ZeRO-2). The parameters'
            ``.grad`` are then None after a synced backward: only that optimizer (and
            :func:`torch_mp.clip_grad_norm_`) reads the gradients, and a plain optimizer
            stepping these parameters raises.
        grad_dtype: Add every backward's gradients into main gradients of this dtype
            (``torch.float32`` for bf16 or fp16 parameters: micro-batches and the reduction
            accumulate in fp32, not in 16 bits), and reduce-scatter them as
            ``shard_gradients`` does (which it implies).
        shard_parameters: Shard the parameters too (ZeRO-3; implies ``shard_gradients``):
            between uses each rank holds only its range of them, and each ``unit``'s
            parameters are all-gathered just before its forward (the next unit's gather
            prefetched while this one computes), freed after it, gathered again just before
            its backward and freed once their gradients are reduce-scattered. A parameter's
            ``.data`` is an empty tensor while its unit is not gathered: read whole
            parameters inside :meth:`gathered_parameters`, through ``state_dict`` /
            ``load_state_dict`` of the wrapped module (which gather them), or through
            ``torch_mp.checkpoint``. Step with a ``torch_mp.DistributedOptimizer`` over
            ``module.parameters()``, which steps this rank's range. Parameters that do not
            require grad stay whole on every rank.
        unit: Under ``shard_parameters``, which submodules are gathered as one: a module
            class, a tuple of classes, or a predicate ``unit(module) -> bool``; the default
            is each child of ``module``. ``module`` itself is always a unit, holding the
            parameters outside every other unit (an embedding, a final norm); a parameter
            shared by several units (tied embeddings) belongs to the innermost unit that
            holds them all.

    Expert parallelism (:mod:`torch_mp.moe`): the parameters whose layout is sharded over the
    mesh's ``ep_group`` (a mixture of experts' experts, which differ between its ranks) start
    from rank 0 of ``mesh.expert_dp_group`` and are reduced over it, divided by the data group's
    size: each rank's expert gradients already sum its expert group's tokens, so that is the
    average over every data rank, as the other parameters get. ``shard_gradients`` does not
    take them yet.

    Every parameter that requires grad must get a gradient in each synced backward (there is no
    ``find_unused_parameters``): a step after one that left some without (an optimizer's
    ``step``, the next forward) raises on every rank, naming them by their names in
    ``module``, rather than step this rank's own gradient and let the replicas drift apart.

    :meth:`zero_grad` of this module (or of a ``DistributedOptimizer`` over its parameters) also
    drops the gradients a sharding engine holds: the main gradients of ``grad_dtype`` and the
    reduced ones, so that a backward dropped before the step adds nothing to it. (The wrapped
    module's own ``zero_grad`` cannot reach them.)

    Raises:
        RuntimeError: On every rank, if the ranks' parameters differ in number, shape or dtype.
    """

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None = None,
        *,
        mesh: Mesh | None = None,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = True,
        broadcast_buffers: bool = True,
        comm_hook: str | None = None,
        shard_gradients: bool = False,
        grad_dtype: torch.dtype | None = None,
        shard_parameters: bool = False,
        unit: type | tuple[type, ...] | Callable[[nn.Module], bool] | None = None,
    ) -> None:
        super().__init__()
        if mesh is not None and group is not None:
            raise ValueError("DataParallel: pass group= or mesh=, not both")
        if group is None:
            group = (mesh or get_mesh()).dp_cp_group
        # The mesh's expert and expert-data groups, for the experts' parameters (if any).
        experts = mesh or find_mesh()
        expert_names = ("", "")
        if experts is not None and experts.ep_group is not None:
            expert_names = (experts.ep_group.group_name, experts.expert_dp_group.group_name)
        self.module = module
        # (what parallelize looks for: it would replace parameters that this wrapper holds)
        module._torch_mp_wrapped_by = type(self).__name__
        self.group = group
        self.require_backward_grad_sync = True
        self.shard_gradients = shard_gradients or grad_dtype is not None or shard_parameters
        self.shard_parameters = shard_parameters
        if unit is not None and not shard_parameters:
            raise ValueError("DataParallel: unit= is for shard_parameters=True")
        names = [name for name, _ in module.named_parameters()]
        _check_plain_optimizers()
        _wait_for_parameter_gathers(module)
        if self.shard_gradients:
            if comm_hook is not None:  # (its engine has no c10d buckets to view)
                raise ValueError(
                    "DataParallel: shard_gradients (grad_dtype, shard_parameters) takes no "
                    "comm_hook"
                )
            for name, p in module.named_parameters():
                if _C.data_parallel.is_expert_parameter(p, expert_names[0]):
                    raise ValueError(
                        "DataParallel: shard_gradients (grad_dtype, shard_parameters) does not "
                        f"take a mixture of experts' expert parameters yet ({name}, of shape "
                        f"{tuple(p.shape)}, is sharded over the expert group); wrap it without "
                        "shard_gradients and step it with a plain optimizer"
                    )
            units = _units(module, unit) if shard_parameters else []
            self._sync = _C.data_parallel.ShardedState(
                list(module.parameters()),
                list(module.buffers()),
                group.group_name,
                bucket_cap_mb,
                grad_dtype,
                broadcast_buffers,
                names,
                shard_parameters,
                [index for _, index in units],
            )
            if shard_parameters:
                _hook_units(module, self._sync, units)
            return
        # The engine (and the buffer bookkeeping) is the C++ core's GradientSync, which also
        # copies rank 0's parameters and buffers to every rank here.
        self._sync = _C.data_parallel.GradientSync(
            list(module.parameters()),
            list(module.buffers()),
            group.group_name,
            bucket_cap_mb,
            gradient_as_bucket_view,
            broadcast_buffers,
            comm_hook or "none",
            *expert_names,
            names,
        )

    def __deepcopy__(self, memo):
        raise RuntimeError(
            "DataParallel cannot be deep-copied (its gradient hooks belong to the original "
            "parameters); copy the wrapped module and wrap the copy"
        )

    def forward(self, *args, **kwargs):
        self.prepare_for_forward()
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.prepare_for_backward()
        return output

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeros (or drops) the parameters' gradients, as ``nn.Module.zero_grad``; with
        ``shard_gradients`` or ``grad_dtype``, also the reduced and main gradients the engine
        holds for them."""
        super().zero_grad(set_to_none)
        if self.shard_gradients:
            self._sync.zero_grad()

    @contextlib.contextmanager
    def gathered_parameters(self, write_back: bool = False) -> Iterator[None]:
        """Under ``shard_parameters``: every parameter whole on every rank inside (all
        gathered: transiently the whole model), e.g. to read or write them; with
        ``write_back``, what was written into them is kept (each rank keeps its range) when the
        block ends. Collective over the data-parallel group. Without ``shard_parameters`` the
        parameters are always whole, and this does nothing."""
        with whole_parameters(self.module, write_back):
            yield

    def prepare_for_forward(self) -> None:
        """Before a forward (``forward`` calls it): rebuilds the buckets once, in the order the
        first synced backward produced gradients, and broadcasts the buffers when due."""
        self._sync.prepare_for_forward()

    def prepare_for_backward(self) -> None:
        """Arms the reduction for the next backward (``forward`` does it unless under
        :meth:`no_sync`)."""
        self._sync.prepare_for_backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards of forwards run inside accumulate gradients locally (e.g. all micro-batches
        but the last); the next synced backward reduces the accumulated sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous


@contextlib.contextmanager
def whole_parameters(
    modules: nn.Module | Iterable[nn.Module], write_back: bool = False
) -> Iterator[bool]:
    """Inside, the parameters of ``modules`` that a ``DataParallel(shard_parameters=True)``
    shards are whole (as :meth:`DataParallel.gathered_parameters`, for every such DataParallel
    they belong to): what checkpoints read and write through. Collective over those
    DataParallels' groups. Nothing sharded: does nothing. Yields whether something was
    gathered (tensors read inside are then freed after it: copy what is kept)."""
    if isinstance(modules, nn.Module):
        modules = [modules]
    whole = _C.data_parallel.WholeParameters(
        [p for m in modules for p in m.parameters()], write_back
    )
    try:
        yield whole.gathered
    finally:
        whole.release()


def _units(module: nn.Module, unit) -> list[tuple[nn.Module, int]]:
    """For each parameter of ``module`` (in ``module.parameters()`` order), the unit it is
    gathered with and that unit's index: the innermost unit whose modules hold every use of it
    (unit 0 is ``module`` itself)."""
    if unit is None:
        children, todo = set(), list(module.children())
        while todo:  # (a ModuleList or ModuleDict is never called: its members are the units)
            child = todo.pop()
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                todo.extend(child.children())
            else:
                children.add(id(child))

        def is_unit(m: nn.Module) -> bool:
            return id(m) in children

    elif isinstance(unit, type) or (
        isinstance(unit, tuple) and all(isinstance(u, type) for u in unit)
    ):

        def is_unit(m: nn.Module) -> bool:
            return isinstance(m, unit)

    elif callable(unit):
        is_unit = unit
    else:
        raise TypeError(
            f"DataParallel: unit= takes a module class, a tuple of classes or a predicate "
            f"unit(module) -> bool, got {unit!r}"
        )
    index = {id(module): 0}
    modules = [module]
    chains: dict[int, list[int]] = {}  # id(p) -> the unit chain common to its uses so far
    chain_of = {"": [0]}
    for path, m in module.named_modules(remove_duplicate=False):
        if path:
            chain = list(chain_of[path.rpartition(".")[0]])
            if is_unit(m) and isinstance(m, (nn.ModuleList, nn.ModuleDict)):
                raise ValueError(
                    f"DataParallel: unit= matches {path}, a {type(m).__name__}, which is never "
                    "called (its members are): its parameters would never be gathered; name "
                    "the members' class instead"
                )
            if is_unit(m):
                if id(m) not in index:
                    index[id(m)] = len(modules)
                    modules.append(m)
                chain.append(index[id(m)])
            chain_of[path] = chain
        chain = chain_of[path]
        for p in m.parameters(recurse=False):
            known = chains.get(id(p))
            if known is None:
                chains[id(p)] = chain
            else:  # shared: the common part of both chains
                k = 0
                while k < min(len(known), len(chain)) and known[k] == chain[k]:
                    k += 1
                chains[id(p)] = known[:k]
    return [(modules[chains[id(p)][-1]], chains[id(p)][-1]) for p in module.parameters()]


def _hook_units(module: nn.Module, sync, units: list[tuple[nn.Module, int]]) -> None:
    """Hooks each unit's forward (and the backward of its outputs) to the engine's gathers and
    frees, and the wrapped module's state_dict and load_state_dict to whole parameters."""
    by_index = {index: m for m, index in units} | {0: module}

    def before_backward(index: int):
        def hook(grad):
            sync.before_backward(index)

        return hook

    for index, m in by_index.items():

        def pre(_m, _args, index=index) -> None:
            sync.before_forward(index)

        def post(_m, _args, output, index=index) -> None:
            sync.after_forward(index)
            if torch.is_grad_enabled():
                for t in torch.utils._pytree.tree_leaves(output):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(before_backward(index))

        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)
    module.register_state_dict_pre_hook(lambda *_: sync.gather_parameters())

    def copy_and_free(_m, state_dict, prefix, _metadata) -> None:
        for key, value in state_dict.items():  # (a tied parameter's every name too)
            if key.startswith(prefix) and isinstance(value, torch.Tensor):
                state_dict[key] = value.clone()
        sync.free_parameters()

    module.register_state_dict_post_hook(copy_and_free)
    module.register_load_state_dict_pre_hook(lambda *_: sync.gather_parameters())
    module.register_load_state_dict_post_hook(lambda *_: sync.write_back_parameters())


def _wait_for_parameter_gathers(module: nn.Module) -> None:
    """Makes each submodule that holds parameters wait, just before its forward, for a
    ``DistributedOptimizer(overlap_param_gather=True)``'s all-gather of the buckets that hold
    them; and ``module.state_dict()`` for all of them."""
    from torch_mp.optim import distributed_optimizer

    def wait(parameters: list[torch.Tensor]) -> None:
        if distributed_optimizer.overlapping:
            _C.optim.wait_for_gathers(parameters)

    for m in module.modules():
        own = list(m.parameters(recurse=False))
        if own:
            m.register_forward_pre_hook(lambda _m, _args, own=own: wait(own))
    everything = list(module.parameters())
    module.register_state_dict_pre_hook(lambda *_: wait(everything))


_plain_optimizer_hook = None


def _check_plain_optimizers() -> None:
    """Makes every torch.optim optimizer but a DistributedOptimizer (which checks the same
    itself) raise at its step, before changing anything: over a parameter whose gradient a
    sharding DataParallel holds (it would find no gradient there and silently leave the
    parameter as it is), and over parameters of a DataParallel whose last synced backward left
    some without a gradient (their buckets were never reduced: .grad is this rank's own)."""
    global _plain_optimizer_hook
    if _plain_optimizer_hook is not None:
        return

    def check(optimizer, args, kwargs) -> None:
        from torch_mp.optim import DistributedOptimizer

        if isinstance(optimizer, DistributedOptimizer):
            return
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        for p in parameters:
            if _C.data_parallel.ShardedState.manages(p):
                raise RuntimeError(
                    f"{type(optimizer).__name__} steps a parameter (shape "
                    f"{tuple(p.shape)}) whose gradients a DataParallel(shard_gradients="
                    "True) reduce-scatters: only torch_mp.DistributedOptimizer over "
                    "module.parameters() can step it"
                )
        _C.data_parallel.check_reductions_complete(parameters)

    _plain_optimizer_hook = register_optimizer_step_pre_hook(check)


def stage_hooks(module: nn.Module) -> tuple[Callable, Callable[[], None] | None]:
    """The pipeline's view of a stage module: its forward, and for a data-parallel stage
    (``torch_mp.DataParallel`` or ``DistributedDataParallel``) the function that arms its
    reduction. Forwards of a data-parallel stage run under ``no_sync``; the executor arms the
    reduction right before the stage's last gradient-accumulating backward of each step.

    Raises:
        ValueError: For DDP settings the pipeline cannot drive exactly.
    """
    if isinstance(module, DistributedDataParallel):
        _check_ddp(module)

        def arm() -> None:
            module.reducer.prepare_for_backward([])
            module.require_forward_param_sync = True  # buffers broadcast next step, as in DDP

    elif isinstance(module, DataParallel):
        arm = module.prepare_for_backward
    else:
        return module, None

    def forward(*inputs):
        with module.no_sync():
            return module(*inputs)

    return forward, arm


def _check_ddp(module: DistributedDataParallel) -> None:
    refused = {
        "find_unused_parameters=True": module.find_unused_parameters,
        "static_graph=True": module.static_graph,
        "mixed_precision": module.mixed_precision is not None,
        "a Python reducer (compiled autograd)": getattr(module, "_use_python_reducer", False),
        "delay_all_reduce_named_params": getattr(module, "_delay_all_reduce_all_params", False),
    }
    for setting, present in refused.items():
        if present:
            raise ValueError(
                f"Pipeline: a DistributedDataParallel stage with {setting} cannot be driven "
                "exactly by the pipeline (its reduction would run on the wrong micro-batch's "
                "graph); wrap the stage without it, or in torch_mp.DataParallel"
            )
    mesh = find_mesh()
    if mesh is not None and mesh.ep_size > 1:  # (at ep 1 every rank holds every expert)
        for name, p in module.module.named_parameters():
            if _C.data_parallel.is_expert_parameter(p, mesh.ep_group.group_name):
                raise ValueError(
                    f"Pipeline: the DistributedDataParallel stage holds the expert parameter "
                    f"{name}: DDP would average different experts' gradients over the data "
                    "group; wrap the stage in torch_mp.DataParallel, which reduces experts over "
                    "mesh.expert_dp_group"
                )
