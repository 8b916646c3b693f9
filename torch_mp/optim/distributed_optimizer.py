"""``torch_mp.DistributedOptimizer``: optimizer state sharded over the data-parallel ranks
(ZeRO-1, as Megatron's distributed optimizer), on the C++ core's ``ParameterShards``
(``csrc/torch_mp/optim/parameter_shards.h``); LibTorch applications get the same as
``torch_mp::DistributedOptimizer``.

The parameters are laid end to end in flat buckets, each cut into ``dp`` equal contiguous
ranges; data rank r owns range r and keeps the optimizer state of those elements only. A step
runs the wrapped optimizer on this rank's shards (1-D views of the parameters' elements, or
fp32 masters) with the gradients ``DataParallel`` averaged, then all-gathers the updated
buckets. For the user it is a ``torch.optim.Optimizer`` over the whole parameters.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from torch_mp import _C
from torch_mp.mesh import Mesh, find_mesh, get_mesh

#: How many DistributedOptimizers with ``overlap_param_gather`` were made: DataParallel's forward
#: hooks skip the wait while there is none.
overlapping = 0


class DistributedOptimizer(torch.optim.Optimizer):
    """An optimizer whose state is sharded over the data-parallel group (ZeRO-1).

    Each data rank keeps the state of its 1/dp of the parameters' elements (``.state`` holds
    this rank's only, keyed by its shards), steps them with the averaged gradients, and
    all-gathers the updated parameters, so that after :meth:`step` every rank holds the same
    model as with ``optimizer_class`` over all parameters. Everything else is a
    ``torch.optim.Optimizer``'s: ``param_groups`` (which learning-rate schedulers set),
    ``zero_grad``, ``state_dict`` / ``load_state_dict`` (in the plain optimizer's format, so
    either loads the other's, at any data-parallel size), and ``torch_mp.checkpoint``.

    The update must be elementwise (an element's update reads that element's gradient and
    state alone): Adam, AdamW, SGD, Adagrad, RMSprop, Lion and the like, not LBFGS or
    optimizers that take norms of whole tensors.

    Every parameter's gradient must be averaged over the group by a ``torch_mp.DataParallel``
    (or a ``DistributedDataParallel``) that holds it, and every parameter must get one in the
    synced backward: otherwise :meth:`step` raises on every rank, naming the parameter, rather
    than step one rank's own gradient (the replicas would drift apart).

    Args:
        params: Parameters or parameter groups, as for any optimizer: the whole model's on
            this rank (its stage and tensor shard), the same on every data rank. Named
            parameters (``module.named_parameters()``, or groups whose ``"params"`` are
            ``(name, parameter)`` pairs) are named in errors.
        optimizer_class: The optimizer that steps the shards, e.g. ``torch.optim.AdamW``.
        mesh: Takes ``mesh.dp_cp_group``; pass ``group`` or ``mesh``, not both.
        group: The data-parallel group; ``mesh.dp_cp_group`` (the default mesh's data group,
            times its context group when cp > 1) when None.
        master_dtype: Keep the shards as copies in this dtype (``torch.float32`` master weights
            of bf16 or fp16 parameters), starting from the parameters' values; gradients are
            converted to it, the stepped values written back rounded. None: step the
            parameters' own elements.
        bucket_cap_mb: Size of a flat bucket of the all-gather, in MiB.
        overlap_param_gather: Return from :meth:`step` with the parameters' all-gather still
            running (Megatron's ``--overlap-param-gather``), bucket by bucket overlapped with
            what follows: a ``torch_mp.DataParallel``'s forward waits for each bucket just
            before the first module that uses it (and its ``state_dict`` for all), as do this
            optimizer's own methods and ``torch_mp.checkpoint``. Until then the parameters hold
            the other ranks' ranges of the last step: anything else that reads them between the
            step and the next forward calls :meth:`wait_for_parameters` first.
        **defaults: The optimizer's arguments (``lr=``, ``weight_decay=``, ...).

    Raises:
        RuntimeError: On every rank, if the data ranks' parameters differ in number, shape or
            dtype, or a parameter is not contiguous.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        mesh: Mesh | None = None,
        group: dist.ProcessGroup | None = None,
        master_dtype: torch.dtype | None = None,
        bucket_cap_mb: float = 25.0,
        overlap_param_gather: bool = False,
        **defaults: Any,
    ) -> None:
        if mesh is not None and group is not None:
            raise ValueError("DistributedOptimizer: pass group= or mesh=, not both")
        if group is None:
            group = (mesh or get_mesh()).dp_cp_group
        groups = list(params)
        if not groups:
            raise ValueError("DistributedOptimizer: got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [_unnamed(dict(g, params=_as_list(g["params"]))) for g in groups]
        names = [n for g in groups for n in g.get("param_names", [None] * len(g["params"]))]
        parameters = [p for g in groups for p in g["params"]]
        self.group = group
        # The mesh's expert group: its experts' parameters are refused (not sharded yet).
        expert_group = getattr(mesh or find_mesh(), "ep_group", None)
        self._shards = _C.optim.ParameterShards(
            parameters,
            group.group_name,
            bucket_cap_mb,
            master_dtype,
            "" if expert_group is None else expert_group.group_name,
            names if all(names) else [],
            overlap_param_gather,
        )
        if overlap_param_gather:
            global overlapping
            overlapping += 1
        group_of = [i for i, g in enumerate(groups) for _ in g["params"]]
        local_groups = [
            {k: v for k, v in g.items() if k != "param_names"} | {"params": []} for g in groups
        ]
        for shard, (index, _, _) in zip(self._shards.shards, self._shards.pieces, strict=True):
            local_groups[group_of[index]]["params"].append(shard)
        #: The ``optimizer_class`` instance over this rank's shards, which holds the state.
        self.local_optimizer = optimizer_class(local_groups, **defaults)
        super().__init__(groups, self.local_optimizer.defaults)
        self.state = self.local_optimizer.state  # this rank's shards' state only
        self._constructed = True

    @torch.no_grad()
    def step(self, closure=None):
        """Steps this rank's shards with the parameters' (averaged) gradients, after copying
        every group's hyperparameters (a scheduler's learning rate) to the local optimizer, and
        all-gathers the updated parameters. Collective over the data-parallel group."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, local in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            local.update((k, v) for k, v in outer.items() if k != "params")
        self._shards.take_gradients()
        try:
            self.local_optimizer.step()
        finally:
            self._shards.release_gradients()
        self._shards.gather_parameters()
        return loss

    def wait_for_parameters(self) -> None:
        """Waits for the all-gather an ``overlap_param_gather`` step left running, so that the
        parameters hold the step's values."""
        self._shards.wait_for_parameters()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only at construction: the parameters are cut into shards once, together."""
        if getattr(self, "_constructed", False):
            raise NotImplementedError(
                "DistributedOptimizer: parameter groups cannot be added after construction (the "
                "parameters are cut over the data ranks together); build it with every group"
            )
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeros the parameters' gradients, and drops the averaged and main gradients a
        ``DataParallel(shard_gradients=True)`` (or ``grad_dtype``) holds for them."""
        super().zero_grad(set_to_none)
        self._shards.zero_gradients()

    # ---- the state as a plain optimizer holds it ----------------------------------------

    def gathered_state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """The state ``optimizer_class`` over the whole parameters would hold: for each
        parameter with state, its state tensors shaped as the parameter (gathered from the data
        ranks) and its other values (a step count). Collective over the data-parallel group;
        every rank gets all of it (transiently, the whole optimizer state)."""
        parameters = self._parameters()
        mine: dict[int, dict[str, Any]] = {}  # index -> key -> _SHAPED, or the value itself
        for shard, (index, _, _) in zip(self._shards.shards, self._shards.pieces, strict=True):
            for key, value in self._shard_state(shard, parameters[index]).items():
                shaped = _per_element(key, value, shard.shape)
                mine.setdefault(index, {})[key] = _SHAPED if shaped else _to_cpu(value)
        # Every rank's description of what it holds (the core's byte exchange).
        every = [
            pickle.loads(b) for b in _C.all_gather_bytes(pickle.dumps(mine), self.group.group_name)
        ]
        described: dict[int, dict[str, Any]] = {}
        for rank_state in every:
            for index, state in rank_state.items():
                for key, value in state.items():
                    described.setdefault(index, {}).setdefault(key, value)
        shaped = sorted({k for s in described.values() for k, v in s.items() if _is_shaped(v)})
        whole = {}  # key -> the whole tensor of every parameter
        for key in shaped:
            per_shard = [
                self._shard_state(shard, parameters[index]).get(key)
                for shard, (index, _, _) in zip(
                    self._shards.shards, self._shards.pieces, strict=True
                )
            ]
            whole[key] = self._shards.gather(per_shard)
        out: dict[torch.Tensor, dict[str, Any]] = {}
        for index in sorted(described):
            p = parameters[index]
            state = {}
            for key, value in described[index].items():
                if _is_shaped(value):
                    state[key] = whole[key][index]
                elif isinstance(value, torch.Tensor):
                    state[key] = value.to(p.device) if _on_device(self, p) else value
                else:
                    state[key] = value
            out[p] = state
        return out

    def load_gathered_state(self, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Replaces this rank's state with its shards' part of ``state`` (as
        :meth:`gathered_state` returns it: by parameter, state tensors shaped as their
        parameter). Not collective."""
        parameters = self._parameters()
        known = {id(p) for p in parameters}
        for p in state:
            if id(p) not in known:
                raise ValueError(
                    f"DistributedOptimizer.load_gathered_state: a parameter of shape "
                    f"{tuple(p.shape)} is not one this optimizer holds"
                )
        self.local_optimizer.state.clear()
        per_parameter = [state.get(p, {}) for p in parameters]
        keys = sorted({k for s in per_parameter for k in s})
        sliced = {}
        shapes = [torch.Size(self._shards.shape(i)) for i in range(len(parameters))]
        for key in keys:
            values = [
                s[key] if _per_element(key, s.get(key), shape) else None
                for s, shape in zip(per_parameter, shapes, strict=True)
            ]
            sliced[key] = self._shards.slice(values)
        pieces = self._shards.pieces
        for s, (shard, (index, _, _)) in enumerate(zip(self._shards.shards, pieces, strict=True)):
            for key, value in per_parameter[index].items():
                piece = sliced[key][s]
                if key == MASTER:
                    if piece is not None and shard.dtype != parameters[index].dtype:
                        shard.copy_(piece)
                    continue
                if piece is not None:
                    dtype = shard.dtype if piece.is_floating_point() else piece.dtype
                    value = piece.to(device=shard.device, dtype=dtype)
                elif isinstance(value, torch.Tensor):
                    value = value.clone()
                self.local_optimizer.state[shard][key] = value

    def state_dict(self) -> dict[str, Any]:
        """The state dict ``optimizer_class`` over the whole parameters would return (state
        indexed by parameter, in ``param_groups`` order): plain optimizers and
        DistributedOptimizers of any data-parallel size load it. Collective over the group."""
        gathered = self.gathered_state()
        state, groups, index = {}, [], 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(index, index + len(group["params"])))
            for i, p in enumerate(group["params"], start=index):
                if p in gathered:
                    state[i] = gathered[p]
            index += len(group["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict of this optimizer, of a plain ``optimizer_class`` or of a
        DistributedOptimizer of any data-parallel size, over the same parameters and groups."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"])
            for s, g in zip(saved_groups, self.param_groups, strict=True)
        ):
            raise ValueError(
                "DistributedOptimizer.load_state_dict: the state dict's parameter groups "
                f"(sizes {[len(s['params']) for s in saved_groups]}) do not match this "
                f"optimizer's ({[len(g['params']) for g in self.param_groups]})"
            )
        by_id = {}
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            by_id.update(zip(saved["params"], group["params"], strict=True))
            group.update((k, v) for k, v in saved.items() if k != "params")
        self.load_gathered_state(
            {by_id[i]: dict(s) for i, s in state_dict["state"].items() if i in by_id}
        )

    def _shard_state(self, shard: torch.Tensor, parameter: torch.Tensor) -> dict[str, Any]:
        """The local optimizer's state of ``shard``, with the shard itself as ``MASTER`` where
        it is a master copy (in another dtype than its parameter)."""
        state = self.local_optimizer.state.get(shard, {})
        if shard.dtype != parameter.dtype:
            state = dict(state, **{MASTER: shard})
        return state

    def _parameters(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]


#: The state key of a parameter's master copy (``master_dtype``), saved and loaded with the
#: rest of the state, so that a resume continues from the masters, not the rounded parameters.
MASTER = "master"

# Stands, in the exchange between ranks, for a state tensor shaped as its shard.
_SHAPED = "<state tensor shaped as its shard>"


def _is_shaped(value: Any) -> bool:
    return isinstance(value, str) and value == _SHAPED


def _per_element(key: str, value: Any, shape: torch.Size) -> bool:
    """Whether state ``value`` holds an entry per element of a tensor of ``shape`` (a moment,
    a momentum buffer), not one for the whole tensor (a step count). For a 0-dim one (a
    learned scalar) both are 0-dim: as torch.optim does, the step is then told by its key."""
    if not isinstance(value, torch.Tensor) or value.numel() != shape.numel():
        return False
    return value.dim() > 0 or (len(shape) == 0 and key != "step")


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _on_device(optimizer: DistributedOptimizer, p: torch.Tensor) -> bool:
    """Whether the optimizer keeps ``p``'s step count on its device (fused or capturable)."""
    for group in optimizer.param_groups:
        if any(q is p for q in group["params"]):
            return bool(group.get("fused") or group.get("capturable"))
    return False


def _unnamed(group: dict[str, Any]) -> dict[str, Any]:
    """A group whose ``(name, parameter)`` pairs are split, as torch.optim splits them, into
    ``params`` and ``param_names``."""
    pairs = [isinstance(p, tuple) for p in group["params"]]
    if not any(pairs):
        return group
    if not all(pairs):
        raise ValueError("DistributedOptimizer: give every parameter of a group a name, or none")
    return dict(
        group,
        params=[p for _, p in group["params"]],
        param_names=[name for name, _ in group["params"]],
    )


def _as_list(params: Any) -> list[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, set):
        raise TypeError("DistributedOptimizer: parameters must be an ordered collection, not a set")
    return list(params)
