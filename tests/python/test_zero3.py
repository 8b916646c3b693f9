"""ZeRO-3: ``DataParallel(shard_parameters=True, unit=...)`` with a ``DistributedOptimizer``
trains exactly as one process does, while between steps each rank holds only its range of
the parameters; composes with the bf16 recipe, clipping, ``no_sync``, recomputation and
checkpoints (which reshard to other data-parallel sizes)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from reference import assert_close, error_of, rank_tensor, use_mesh
from test_zero_edges import _Branchy
from torch import nn

import torch_mp
from torch_mp import checkpoint

WIDTH = 8
LR = 1e-2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class Net(nn.Module):
    """An input layer, three blocks, a norm and an output layer (tied to the input's weight
    when ``tied``), with a scalar outside every block."""

    def __init__(self, tied: bool = False, recompute: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.tensor(0.75))
        self.recompute = recompute
        if tied:
            self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = torch_mp.recompute(block, h) if self.recompute else block(h)
        return self.out(self.norm(h)) * self.scale


def _is_block(m: nn.Module) -> bool:
    return isinstance(m, Block)


def _batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rank_tensor(step, 0, 4 * dp, WIDTH), rank_tensor(step + 100, 0, 4 * dp, WIDTH)


def _mine(t: torch.Tensor, mesh) -> torch.Tensor:
    return t.chunk(mesh.dp_size)[mesh.dp_rank]


def _loss(model, x, y) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _held(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _bound(model: nn.Module, dp: int) -> int:
    """⌈Ψ/dp⌉ plus a bucket's padding for each parameter (an upper bound of the padding)."""
    params = list(model.parameters())
    return math.ceil(sum(p.numel() for p in params) / dp) + len(params) * dp


def _train(
    unit=None,
    tied: bool = False,
    recompute: bool = False,
    clip: float | None = None,
    micro_batches: int = 1,
    steps: int = 3,
) -> None:
    mesh = use_mesh(1)
    dp = mesh.dp_size
    reference = Net(tied, recompute)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    model = Net(tied, recompute)
    bound = _bound(model, dp)
    wrapped = torch_mp.DataParallel(model, mesh=mesh, shard_parameters=True, unit=unit)
    optimizer = torch_mp.DistributedOptimizer(
        model.parameters(), torch.optim.AdamW, mesh=mesh, lr=LR
    )
    assert _held(model) <= bound
    for step in range(steps):
        x, y = _batch(step, dp * micro_batches)
        reference_optimizer.zero_grad()
        _loss(reference, x, y).backward()
        optimizer.zero_grad()
        xs, ys = _mine(x, mesh).chunk(micro_batches), _mine(y, mesh).chunk(micro_batches)
        for k in range(micro_batches):
            if k < micro_batches - 1:
                with wrapped.no_sync():
                    (_loss(wrapped, xs[k], ys[k]) / micro_batches).backward()
            else:
                (_loss(wrapped, xs[k], ys[k]) / micro_batches).backward()
        if clip is not None:
            expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            norm = torch_mp.clip_grad_norm_(model.parameters(), clip, mesh=mesh)
            assert_close(norm, expected, f"step {step}: the gradient norm")
        reference_optimizer.step()
        optimizer.step()
        assert _held(model) <= bound, f"step {step}: {_held(model)} elements held"
    with wrapped.gathered_parameters():
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert_close(p, q, f"{name} after {steps} steps")
    state = model.state_dict()
    for name, q in reference.state_dict().items():
        assert_close(state[name], q, f"state_dict()[{name!r}]")
    assert _held(model) <= bound


def test_zero3_trains_as_one_process(world):
    world.run(_train)


_UNITS = {"class": Block, "classes": (Block, nn.LayerNorm), "predicate": _is_block}


@pytest.mark.parametrize("unit", list(_UNITS))
def test_units_by_class_or_predicate(unit, world2):
    world2.run(_train, _UNITS[unit])


def test_tied_parameters_belong_to_the_unit_that_holds_both(world2):
    world2.run(_train, None, True)


def test_zero3_with_recompute_clipping_and_no_sync(world):
    world.run(_train, Block, False, True, 0.05, 2)


def _refuses_a_container_unit() -> str | None:
    mesh = use_mesh(1)
    return error_of(
        torch_mp.DataParallel, Net(), mesh=mesh, shard_parameters=True, unit=nn.ModuleList
    )


def test_a_container_unit_is_refused(world2):
    for message in world2.run(_refuses_a_container_unit):
        assert message is not None and "blocks, a ModuleList, which is never called" in message


# ---- the bf16 recipe ---------------------------------------------------------------------------


def _bf16_against_zero2() -> None:
    # ZeRO-3 and ZeRO-2 do the same arithmetic (the same fp32 main gradients, reduce-scattered
    # alike, the same fp32 masters): they agree bit for bit.
    mesh = use_mesh(1)
    runs = []
    for shard_parameters in (False, True):
        model = Net().to(torch.bfloat16)
        wrapped = torch_mp.DataParallel(
            model, mesh=mesh, grad_dtype=torch.float32, shard_parameters=shard_parameters
        )
        optimizer = torch_mp.DistributedOptimizer(
            model.parameters(), torch.optim.AdamW, mesh=mesh, master_dtype=torch.float32, lr=LR
        )
        losses = []
        for step in range(3):
            x, y = (_mine(t, mesh).to(torch.bfloat16) for t in _batch(step, mesh.dp_size))
            optimizer.zero_grad()
            loss = _loss(wrapped, x, y)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        with wrapped.gathered_parameters():
            runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (losses2, params2), (losses3, params3) = runs
    for step, (a, b) in enumerate(zip(losses3, losses2, strict=True)):
        assert torch.equal(a, b), f"step {step}: loss {a} (ZeRO-3) against {b} (ZeRO-2)"
    for (name, _), a, b in zip(Net().named_parameters(), params3, params2, strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name


def test_the_bf16_recipe_equals_zero2_bit_for_bit(world):
    world.run(_bf16_against_zero2)


# ---- checkpoints -------------------------------------------------------------------------------


def _reference_after(steps: int) -> nn.Module:
    reference = Net()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    for step in range(steps):
        x, y = _batch(step, 1)
        optimizer.zero_grad()
        _loss(reference, x, y).backward()
        optimizer.step()
    return reference


def _steps(wrapped, optimizer, mesh, steps: range) -> None:
    for step in steps:
        x, y = _batch(step, 1)
        optimizer.zero_grad()
        _loss(wrapped, _mine(x, mesh), _mine(y, mesh)).backward()
        optimizer.step()


def _wrapped(shard_parameters: bool):
    mesh = use_mesh(1)
    model = Net()
    wrapped = torch_mp.DataParallel(model, mesh=mesh, shard_parameters=shard_parameters)
    optimizer = torch_mp.DistributedOptimizer(
        model.parameters(), torch.optim.AdamW, mesh=mesh, lr=LR
    )
    return mesh, model, wrapped, optimizer


def _save_at_zero3(path: str) -> None:
    mesh, model, wrapped, optimizer = _wrapped(True)
    _steps(wrapped, optimizer, mesh, range(2))
    checkpoint.save(path, model, optimizer, mesh=mesh)
    dense = checkpoint.dense_state_dict(model)
    for name, q in _reference_after(2).state_dict().items():
        assert_close(dense[name], q, f"dense_state_dict()[{name!r}] after 2 steps")
    assert _held(model) <= _bound(model, mesh.dp_size)


def _load_and_step(path: str, shard_parameters: bool) -> None:
    mesh, model, wrapped, optimizer = _wrapped(shard_parameters)
    checkpoint.load(path, model, optimizer, mesh=mesh)
    _steps(wrapped, optimizer, mesh, range(2, 3))
    with wrapped.gathered_parameters():
        for (name, p), q in zip(
            model.named_parameters(), _reference_after(3).parameters(), strict=True
        ):
            assert_close(p, q, f"{name}: saved at ZeRO-3 dp 2, loaded at dp {mesh.dp_size}")


def test_a_zero3_checkpoint_loads_at_other_data_parallel_sizes(tmp_path):
    from conftest import get_world

    path = str(tmp_path / "ckpt")
    get_world(2).run(_save_at_zero3, path)
    get_world(1).run(_load_and_step, path, False)  # no sharding at all
    get_world(2).run(_load_and_step, path, True)
    get_world(4).run(_load_and_step, path, True)


# ---- master weights across a resume ------------------------------------------------------------


def _bf16(shard_parameters: bool):
    mesh = use_mesh(1)
    model = Net().to(torch.bfloat16)
    wrapped = torch_mp.DataParallel(
        model, mesh=mesh, grad_dtype=torch.float32, shard_parameters=shard_parameters
    )
    optimizer = torch_mp.DistributedOptimizer(
        model.parameters(), torch.optim.AdamW, mesh=mesh, master_dtype=torch.float32, lr=LR
    )
    return mesh, model, wrapped, optimizer


def _bf16_steps(wrapped, optimizer, mesh, steps: range) -> None:
    for step in steps:
        x, y = (_mine(t, mesh).to(torch.bfloat16) for t in _batch(step, 1))
        optimizer.zero_grad()
        _loss(wrapped, x, y).backward()
        optimizer.step()


def _whole(wrapped, model) -> list[torch.Tensor]:
    with wrapped.gathered_parameters():
        return [p.detach().clone() for p in model.parameters()]


def _bf16_resume(shard_parameters: bool, how: str, path: str) -> None:
    # A resume continues from the fp32 masters (saved with the optimizer's state), not from
    # the parameters rounded to bf16, and equals the run that never stopped, bit for bit.
    mesh, model, wrapped, optimizer = _bf16(shard_parameters)
    _bf16_steps(wrapped, optimizer, mesh, range(2))
    model_state = copy.deepcopy(model.state_dict())
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    checkpoint.save(path, model, optimizer, mesh=mesh)
    _bf16_steps(wrapped, optimizer, mesh, range(2, 4))
    expected = _whole(wrapped, model)

    mesh, model, wrapped, optimizer = _bf16(shard_parameters)
    if how == "checkpoint":
        checkpoint.load(path, model, optimizer, mesh=mesh)
    else:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
    _bf16_steps(wrapped, optimizer, mesh, range(2, 4))
    for (name, _), a, b in zip(
        model.named_parameters(), _whole(wrapped, model), expected, strict=True
    ):
        assert torch.equal(a, b), f"{name} after a resume by {how}"


@pytest.mark.parametrize("how", ["checkpoint", "state_dict"])
@pytest.mark.parametrize("shard_parameters", [False, True], ids=["zero2", "zero3"])
def test_a_bf16_resume_continues_from_the_masters(shard_parameters, how, world2, tmp_path):
    world2.run(_bf16_resume, shard_parameters, how, str(tmp_path / "ckpt"))


def _masters_follow_loaded_parameters(shard_parameters: bool) -> None:
    # Parameters loaded (here without masters in the optimizer's state) after the optimizer
    # was built: its masters take them, as if it had been built after the load.
    mesh, model, wrapped, optimizer = _bf16(shard_parameters)
    _bf16_steps(wrapped, optimizer, mesh, range(2))
    model_state = copy.deepcopy(model.state_dict())
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    for state in optimizer_state["state"].values():
        del state["master"]
    runs = []
    for built_before in (True, False):
        model = Net().to(torch.bfloat16)
        wrapped = torch_mp.DataParallel(
            model, mesh=mesh, grad_dtype=torch.float32, shard_parameters=shard_parameters
        )

        def build(model=model):
            return torch_mp.DistributedOptimizer(
                model.parameters(), torch.optim.AdamW, mesh=mesh, master_dtype=torch.float32
            )

        optimizer = build() if built_before else None
        model.load_state_dict(model_state)
        optimizer = optimizer or build()
        optimizer.load_state_dict(optimizer_state)
        _bf16_steps(wrapped, optimizer, mesh, range(2, 3))
        runs.append(_whole(wrapped, model))
    for (name, _), a, b in zip(model.named_parameters(), *runs, strict=True):
        assert torch.equal(a, b), f"{name}: the masters kept their values over loaded ones"


@pytest.mark.parametrize("shard_parameters", [False, True], ids=["zero2", "zero3"])
def test_masters_follow_parameters_loaded_after_the_optimizer(shard_parameters, world2):
    world2.run(_masters_follow_loaded_parameters, shard_parameters)


# ---- FSDP2 beside torch_mp's layers ------------------------------------------------------------


def _fully_shard_beside_tensor_parallel_layers(path: str) -> list[str | None]:
    # PyTorch's fully_shard over the data group around tensor-parallel layers (tp 2 x dp 2):
    # torch_mp's clipping, layouts and checkpoints refuse its DTensors on every rank, before any
    # collective, naming the parameter and the supported way.
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = use_mesh(2)
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
    model = nn.Sequential(
        torch_mp.ColumnParallelLinear.from_dense(dense[0]),
        nn.GELU(),
        torch_mp.RowParallelLinear.from_dense(dense[2]),
    )
    data = DeviceMesh.from_group(mesh.dp_group, "cpu")
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=data)
    fully_shard(model, mesh=data)
    model(torch.randn(4, WIDTH)).square().mean().backward()
    return [
        error_of(torch_mp.clip_grad_norm_, model.parameters(), 1.0, mesh=mesh),
        error_of(torch_mp.layout_of, model[0].weight),
        error_of(checkpoint.save, path, model, mesh=mesh),
        error_of(checkpoint.export_dense, path + ".safetensors", model, mesh=mesh),
        error_of(checkpoint.dense_state_dict, model),
    ]


def test_fully_shard_beside_torch_mp_layers_is_refused_on_every_rank(world4, tmp_path):
    for rank, messages in enumerate(
        world4.run(_fully_shard_beside_tensor_parallel_layers, str(tmp_path / "ckpt"))
    ):
        for message in messages:
            assert message is not None, f"rank {rank}: accepted"
            assert "is a DTensor" in message and "shard_parameters=True" in message, message
        assert "0.weight (shape (8, 8))" in messages[2], messages[2]


# ---- refusals ----------------------------------------------------------------------------------


def _refusals() -> list[str | None]:
    mesh = use_mesh(1)
    x, y = (_mine(t, mesh) for t in _batch(0, mesh.dp_size))
    # A unit never called leaves its parameters without a gradient: the step names them.
    model = _Branchy(WIDTH)
    wrapped = torch_mp.DataParallel(model, mesh=mesh, shard_parameters=True)
    optimizer = torch_mp.DistributedOptimizer(model.parameters(), torch.optim.SGD, mesh=mesh, lr=LR)
    _loss(wrapped, x, y).backward()
    unused = error_of(optimizer.step)
    # A plain optimizer over sharded parameters would step nothing: refused.
    model = Net()
    wrapped = torch_mp.DataParallel(model, mesh=mesh, shard_parameters=True)
    plain = torch.optim.SGD(model.parameters(), lr=LR)
    _loss(wrapped, x, y).backward()
    stepped_plainly = error_of(plain.step)
    # An optimizer built before the wrapper would find no gradients: refused.
    model = Net()
    early = torch_mp.DistributedOptimizer(model.parameters(), torch.optim.SGD, mesh=mesh, lr=LR)
    wrapped = torch_mp.DataParallel(model, mesh=mesh, shard_parameters=True)
    _loss(wrapped, x, y).backward()
    built_early = error_of(early.step)
    return [unused, stepped_plainly, built_early]


def test_zero3_refuses_on_every_rank_by_name(world2):
    for unused, plain, early in world2.run(_refusals):
        assert unused is not None and "unused.weight [3, 8]" in unused, unused
        assert plain is not None and "only torch_mp.DistributedOptimizer" in plain, plain
        assert early is not None and "made after this optimizer" in early, early
