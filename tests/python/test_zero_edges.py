"""ZeRO and DataParallel at the edges: a dropped backward leaves nothing behind once any
``zero_grad`` ran; a parameter that got no gradient, or that no DataParallel reduces, is refused
at the step, by name, on every rank; a 0-dim parameter (a learned scalar) steps, saves and loads
under the distributed optimizer as under a plain one."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import assert_close, error_of, rank_tensor, use_mesh
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torch_mp
from torch_mp import checkpoint

WIDTH = 6
LR = 1e-2


class _Branchy(nn.Module):
    """Two layers, of which forward uses ``used`` only (``unused`` gets no gradient)."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.used = nn.Linear(width, width)
        self.unused = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class _Scaled(nn.Module):
    """A linear layer times a learned scalar (a 0-dim parameter)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))


def _batch(seed: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rank_tensor(seed, 0, 4 * dp, WIDTH), rank_tensor(seed + 100, 0, 4 * dp, WIDTH)


def _mine(t: torch.Tensor, mesh) -> torch.Tensor:
    return t.chunk(mesh.dp_size)[mesh.dp_rank]


def _loss(model, x, y) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


# ---- 1. zero_grad clears the fp32 main gradients ----------------------------------------------

_ZERO_GRADS = {
    "optimizer": lambda wrapped, optimizer: optimizer.zero_grad(),
    "optimizer-to-zeros": lambda wrapped, optimizer: optimizer.zero_grad(set_to_none=False),
    "module": lambda wrapped, optimizer: wrapped.zero_grad(),
    "module-to-zeros": lambda wrapped, optimizer: wrapped.zero_grad(set_to_none=False),
}


def _dropped_backward_leaves_nothing(dropped: str, how: str, shard_only: bool) -> None:
    mesh = use_mesh(1)
    reference = _mlp()
    model = copy.deepcopy(reference)
    if shard_only:
        wrapped = torch_mp.DataParallel(model, mesh=mesh, shard_gradients=True)
    else:
        wrapped = torch_mp.DataParallel(model, mesh=mesh, grad_dtype=torch.float32)
    optimizer = torch_mp.DistributedOptimizer(model.parameters(), torch.optim.SGD, mesh=mesh, lr=LR)
    drop_x, drop_y = _batch(1, mesh.dp_size)
    if dropped == "no_sync":
        with wrapped.no_sync():
            _loss(wrapped, _mine(drop_x, mesh), _mine(drop_y, mesh)).backward()
    else:  # a synced backward whose step is skipped
        _loss(wrapped, _mine(drop_x, mesh), _mine(drop_y, mesh)).backward()
    _ZERO_GRADS[how](wrapped, optimizer)
    x, y = _batch(2, mesh.dp_size)
    _loss(wrapped, _mine(x, mesh), _mine(y, mesh)).backward()
    optimizer.step()

    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    _loss(reference, x, y).backward()
    reference_optimizer.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert_close(p, q, f"{name} after a dropped {dropped} backward and {how} zero_grad")


@pytest.mark.parametrize("how", list(_ZERO_GRADS))
@pytest.mark.parametrize("dropped", ["no_sync", "synced"])
def test_zero_grad_drops_a_dropped_backwards_main_gradients(dropped, how, world2):
    world2.run(_dropped_backward_leaves_nothing, dropped, how, False)


def test_zero_grad_drops_main_gradients_at_every_size(world):
    world.run(_dropped_backward_leaves_nothing, "no_sync", "optimizer", False)
    world.run(_dropped_backward_leaves_nothing, "no_sync", "module", True)


# ---- 2. a parameter without a gradient is refused at the step ---------------------------------


def _step_without_a_gradient(kind: str) -> tuple[str | None, bool]:
    mesh = use_mesh(1)
    torch.manual_seed(0)
    model = _Branchy()
    wrapped = torch_mp.DataParallel(model, mesh=mesh, shard_gradients=kind == "zero2")
    if kind == "plain":
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        optimizer = torch_mp.DistributedOptimizer(
            model.parameters(), torch.optim.AdamW, mesh=mesh, lr=LR
        )
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch(3, mesh.dp_size)
    _loss(wrapped, _mine(x, mesh), _mine(y, mesh)).backward()
    message = error_of(optimizer.step)
    unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    return message, unchanged


@pytest.mark.parametrize("kind", ["plain", "zero1", "zero2"])
def test_a_parameter_without_gradient_is_refused_at_the_step_by_name(kind, world2):
    for message, unchanged in world2.run(_step_without_a_gradient, kind):
        assert message is not None, f"{kind}: stepped a parameter whose gradient was not averaged"
        assert "unused.weight" in message and "unused.bias" in message, message
        assert unchanged, f"{kind}: the refused step changed parameters"


def _next_forward_after_an_incomplete_backward() -> str | None:
    mesh = use_mesh(1)
    torch.manual_seed(0)
    model = _Branchy()
    wrapped = torch_mp.DataParallel(model, mesh=mesh)
    x, y = _batch(3, mesh.dp_size)
    _loss(wrapped, _mine(x, mesh), _mine(y, mesh)).backward()
    return error_of(wrapped, _mine(x, mesh))


def test_the_next_forward_names_the_parameters_without_gradient(world2):
    for message in world2.run(_next_forward_after_an_incomplete_backward):
        assert message is not None and "unused.weight" in message, message


# ---- 3. parameters no DataParallel reduces ----------------------------------------------------


def _optimizer_over_a_parameter_outside(shard_gradients: bool, named: bool) -> str | None:
    mesh = use_mesh(1)
    model = _mlp()
    wrapped = torch_mp.DataParallel(model[0], mesh=mesh, shard_gradients=shard_gradients)
    params = model.named_parameters() if named else model.parameters()

    def build_and_step():
        optimizer = torch_mp.DistributedOptimizer(params, torch.optim.AdamW, mesh=mesh, lr=LR)
        x, y = _batch(4, mesh.dp_size)
        _loss(lambda t: model[2](model[1](wrapped(t))), _mine(x, mesh), _mine(y, mesh)).backward()
        optimizer.step()

    return error_of(build_and_step)


@pytest.mark.parametrize("shard_gradients", [False, True], ids=["zero1", "zero2"])
def test_a_parameter_outside_the_data_parallel_module_is_refused(shard_gradients, world2):
    for message in world2.run(_optimizer_over_a_parameter_outside, shard_gradients, False):
        assert message is not None, "stepped a parameter with one rank's gradient"
        assert "parameter 2" in message and "[6, 12]" in message, message


def test_the_refusal_names_named_parameters(world2):
    for message in world2.run(_optimizer_over_a_parameter_outside, False, True):
        assert message is not None and "2.weight" in message, message


def _ddp_with_the_distributed_optimizer() -> None:
    mesh = use_mesh(1)
    reference = _mlp()
    model = copy.deepcopy(reference)
    wrapped = DistributedDataParallel(model, process_group=mesh.dp_group)
    optimizer = torch_mp.DistributedOptimizer(model.parameters(), torch.optim.SGD, mesh=mesh, lr=LR)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    x, y = _batch(5, mesh.dp_size)
    _loss(wrapped, _mine(x, mesh), _mine(y, mesh)).backward()
    optimizer.step()
    _loss(reference, x, y).backward()
    reference_optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert_close(p, q, "DDP + DistributedOptimizer against one process")


def test_ddp_parameters_are_taken(world2):
    world2.run(_ddp_with_the_distributed_optimizer)


# ---- 4. a 0-dim parameter ----------------------------------------------------------------------


def _train(model, optimizer, steps: range, mesh, whole: bool = False) -> None:
    """Steps on the batches of ``mesh``'s data ranks: this rank's share, or all of it."""
    for step in steps:
        optimizer.zero_grad()
        x, y = _batch(10 + step, mesh.dp_size)
        if not whole:
            x, y = _mine(x, mesh), _mine(y, mesh)
        _loss(model, x, y).backward()
        optimizer.step()


def _scalar_parameter_reloads(how: str, path: str) -> None:
    mesh = use_mesh(1)
    reference = _Scaled()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    _train(reference, reference_optimizer, range(3), mesh, whole=True)

    model = _Scaled()
    wrapped = torch_mp.DataParallel(model, mesh=mesh)
    optimizer = torch_mp.DistributedOptimizer(
        model.parameters(), torch.optim.AdamW, mesh=mesh, lr=LR
    )
    _train(wrapped, optimizer, range(2), mesh)
    restored_model = copy.deepcopy(model)
    restored = torch_mp.DataParallel(restored_model, mesh=mesh)
    restored_optimizer = torch_mp.DistributedOptimizer(
        restored_model.parameters(), torch.optim.AdamW, mesh=mesh, lr=LR
    )
    if how == "state_dict":
        restored_optimizer.load_state_dict(optimizer.state_dict())
    elif how == "plain state_dict":
        plain_model = _Scaled()
        plain_optimizer = torch.optim.AdamW(plain_model.parameters(), lr=LR)
        _train(plain_model, plain_optimizer, range(2), mesh, whole=True)
        restored_optimizer.load_state_dict(plain_optimizer.state_dict())
    else:
        checkpoint.save(path, model, optimizer, mesh=mesh)
        checkpoint.load(path, restored_model, restored_optimizer, mesh=mesh)
    _train(restored, restored_optimizer, range(2, 3), mesh)
    for (name, p), q in zip(restored_model.named_parameters(), reference.parameters(), strict=True):
        assert_close(p, q, f"{name} after {how} and a step")


@pytest.mark.parametrize("how", ["state_dict", "plain state_dict", "checkpoint"])
def test_a_scalar_parameter_steps_after_a_load(how, world, tmp_path):
    world.run(_scalar_parameter_reloads, how, str(tmp_path / "ckpt"))


# ---- parameters moved after the optimizer was built -------------------------------------------


def _model_moved_after_the_optimizer() -> str | None:
    mesh = use_mesh(1)
    model = _mlp()
    wrapped = torch_mp.DataParallel(model, mesh=mesh)
    optimizer = torch_mp.DistributedOptimizer(model.parameters(), torch.optim.SGD, mesh=mesh, lr=LR)
    model[0].weight.data = model[0].weight.data.clone()  # as module.to(...) does
    x, y = _batch(6, mesh.dp_size)
    _loss(wrapped, _mine(x, mesh), _mine(y, mesh)).backward()
    return error_of(optimizer.step)


def test_parameters_moved_after_the_optimizer_are_refused(world):
    for message in world.run(_model_moved_after_the_optimizer):
        assert message is not None and "was replaced after the optimizer was built" in message
        assert "parameter 0 [12, 6]" in message, message
